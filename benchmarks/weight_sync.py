"""What an RL trainer's weight sync costs the offline Engine, in one run: a full set of new
weights given from disk (`update_weights_from_disk`, a checkpoint folder) against the same
weights given as tensors in memory (`update_weights_from_tensor`), alternating, each
followed by a greedy generation that checks the new weights serve. Also pause (retract) →
update → continue with a request running. Prints each round and the medians.

    .venv/bin/python benchmarks/weight_sync.py --rounds 5            # the default model
    .venv/bin/python benchmarks/weight_sync.py --model-path DIR --dtype float32

The "new" weights are the loaded checkpoint's own tensors scaled by 1.001, written once to
a second folder, so the two paths serve the same values.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from radixserve import Engine
from radixserve.hardware import cpu_info
from radixserve.model.loader import iter_safetensors

PROMPT = [(7 * i) % 500 + 20 for i in range(64)]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def new_checkpoint(folder: Path, into: Path) -> dict[str, torch.Tensor]:
    """The checkpoint in `folder` with every tensor scaled by 1.001, as a folder and as
    tensors."""
    shutil.copytree(folder, into, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {name: (t.float() * 1.001).to(t.dtype) for name, t in iter_safetensors(folder)}
    save_file(tensors, str(into / "model.safetensors"))
    return tensors


def timed(call) -> tuple[float, object]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(cpu_info().summary())
    with Engine(args.model_path, progress=False, dtype=args.dtype) as engine:
        folder = Path(engine.runner.model_folder)
        work = Path(tempfile.mkdtemp(prefix="weight-sync-"))
        tensors = new_checkpoint(folder, work / "new")
        mib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
        print(f"model {folder} ({len(tensors)} tensors, {mib:.0f} MiB), dtype {args.dtype}")
        run = lambda: engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]  # noqa: E731
        expected = None
        disk, memory, paused = [], [], []
        for i in range(args.rounds):
            assert engine.update_weights_from_disk(str(folder))["success"]  # back to the old
            seconds, result = timed(lambda: engine.update_weights_from_disk(str(work / "new")))
            assert result["success"], result
            expected = expected or run()
            disk.append(seconds)
            assert engine.update_weights_from_disk(str(folder))["success"]
            seconds, result = timed(lambda: engine.update_weights_from_tensor(tensors))
            assert result["success"] and run() == expected, result
            memory.append(seconds)
            stream = engine.generate(
                input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 64}, stream=True
            )
            next(stream)

            def sync() -> None:
                engine.pause_generation("retract")
                assert engine.update_weights_from_tensor(tensors)["success"]
                engine.continue_generation()

            seconds, _ = timed(sync)
            list(stream)
            paused.append(seconds)
            print(
                f"round {i}: from disk {disk[-1]:.2f} s, from tensors {memory[-1]:.2f} s, "
                f"pause+update+continue {paused[-1]:.2f} s"
            )
        shutil.rmtree(work, ignore_errors=True)
    d, m, p = (statistics.median(x) for x in (disk, memory, paused))
    print(
        f"medians of {args.rounds}: from disk {d:.2f} s, from tensors {m:.2f} s "
        f"({d / m:.2f}x), pause(retract)+update(tensors)+continue {p:.2f} s"
    )


if __name__ == "__main__":
    main()
