"""An attention kernel of this CPU's build as the tree has it against the same source at
another git revision, both loaded in one process, the builds alternated, medians; both
builds' outputs are checked to be the same bits first. Over SmolLM2's 30 layers' pools (3
KV heads of 64 dims, 9 query heads, fp32, huge pages as the server's pool):

- decode (`decode_attention.cpp` on AVX2-only CPUs, `decode_attention_avx512.cpp` on
  AVX-512 ones): requests of --positions each, their slots in runs (as a fresh pool hands
  them out), scattered at random, or in pairs sharing their first 512;
- extend (`extend_attention.cpp` / `extend_attention_avx512.cpp`): the batches of the
  serving workloads' prefills: two prompts of 512, a step's end of one prompt and start of
  the next (544 + 469), 16 questions of 32 tokens after a cached prefix of 512 they share,
  one prompt of 2,048; both builds' bits are first compared on several head shapes.

    .venv/bin/python benchmarks/attention_builds.py [--kind decode|extend] [--base HEAD~1] \
        [--requests 4,16,32] [--repeats 14]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from radixserve.cache.kv_pool import advise_huge_pages
from radixserve.hardware import cpu_info
from radixserve.model.attention import (
    DecodeKernel,
    ExtendKernel,
    decode_attention_kernel,
    extend_attention_kernel,
)
from radixserve.model.cpu_kernels import ISA_FLAGS, KERNEL_FLAGS, cpu_runs

LAYERS, KV_HEADS, HEADS, DIM = 30, 3, 9, 64
SCALE = DIM**-0.5
MODEL = Path(__file__).resolve().parent.parent / "radixserve" / "model"
# extend batches: name -> (prefix_lens, extend_lens)
EXTENDS = {
    "2 prompts of 512": ([0, 0], [512, 512]),
    "544 + 469 (a chunk)": ([0, 0], [544, 469]),
    "16 x 32 after 512": ([512] * 16, [32] * 16),
    "1 prompt of 2048": ([0], [2048]),
}


def base_build(revision: str, name: str, isa: str, folder: Path) -> ctypes.CDLL:
    """`name`.cpp and the headers beside it as of `revision`, built into `folder`."""
    for path in [MODEL / f"{name}.cpp", *MODEL.glob("*.h")]:
        relative = path.relative_to(MODEL.parent.parent)
        shown = subprocess.run(
            ["git", "show", f"{revision}:{relative}"], capture_output=True, cwd=MODEL
        )
        if shown.returncode == 0:  # a header the revision did not have is not needed
            (folder / path.name).write_bytes(shown.stdout)
    library = folder / f"{name}.so"
    flags = (*KERNEL_FLAGS, *ISA_FLAGS[isa])
    subprocess.run(["g++", *flags, str(folder / f"{name}.cpp"), "-o", str(library)], check=True)
    return ctypes.CDLL(str(library))


def pool(slots: int) -> torch.Tensor:
    buf = torch.empty(slots, KV_HEADS, DIM)
    advise_huge_pages(buf)
    return buf.normal_()


def compare(label: str, builds: dict, layers: list[tuple], repeats: int) -> None:
    """Each build called on every layer's arguments (`layers`): the first layer's outputs
    checked for the same bits, then all layers timed, the builds alternated."""
    outs = [kernel(*layers[0]) for kernel in builds.values()]
    assert torch.equal(outs[0], outs[1]), "the builds' outputs differ"
    times: dict[str, list[float]] = {name: [] for name in builds}
    for rep in range(repeats + 1):
        for name, kernel in builds.items():
            start = time.perf_counter()
            for arguments in layers:
                kernel(*arguments)
            if rep:
                times[name].append(time.perf_counter() - start)
    line = " | ".join(f"{k} {statistics.median(v) * 1e3:7.1f}" for k, v in times.items())
    print(f"{label}, ms: {line}", flush=True)


def decode_cases(builds: dict[str, DecodeKernel], args: argparse.Namespace) -> None:
    length = args.positions
    for layout in ("runs", "scattered", "pairs sharing 512"):
        for count in map(int, args.requests.split(",")):
            slots = count * length + 1
            scattered = layout == "scattered"
            order = torch.randperm(slots - 1) + 1 if scattered else torch.arange(1, slots)
            table = order.view(count, length).contiguous()
            if layout.startswith("pairs"):
                table[1::2, :512] = table[0::2, :512]
            batch = (table, torch.arange(count), torch.full((count,), length))
            q = torch.randn(count, HEADS, DIM)
            layers = [(q, pool(slots), pool(slots), *batch, SCALE) for _ in range(LAYERS)]
            compare(f"{layout:18s} {count:3d} requests", builds, layers, args.repeats)
            del layers  # before the next batch's pools


def extend_batch(prefixes: list[int], extends: list[int]) -> tuple[int, tuple]:
    """Slots a pool needs and (table, rows, prefix_lens, extend_lens) for requests whose
    slots run in order, all sharing the first request's prefix (as the shared-prefix
    workload's questions share their system prompt's cached K/V) where they have one."""
    lens = [p + e for p, e in zip(prefixes, extends, strict=True)]
    table = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    first = 1
    for row, (prefix, n) in enumerate(zip(prefixes, lens, strict=True)):
        table[row, :n] = torch.arange(first, first + n)
        first += n
        if row and prefix and prefix <= prefixes[0]:
            table[row, :prefix] = table[0, :prefix]
    batch = (table, torch.arange(len(lens)), torch.tensor(prefixes), torch.tensor(extends))
    return first, batch


# (query heads, KV heads, head size) whose bits both builds must agree on before timing:
# one, two, three and eight query heads a KV head (each way the kernel groups them)
EXTEND_SHAPES = [(8, 8, 64), (8, 4, 64), (9, 3, 64), (16, 2, 128), (8, 1, 256)]


def extend_cases(builds: dict[str, ExtendKernel], args: argparse.Namespace) -> None:
    slots, batch = extend_batch([0, 40, 512], [70, 33, 32])
    for heads, kv_heads, dim in EXTEND_SHAPES:
        k_pool, v_pool = (torch.randn(slots, kv_heads, dim) for _ in range(2))
        q = torch.randn(int(batch[3].sum()), heads, dim)
        outs = [kernel(q, k_pool, v_pool, *batch, dim**-0.5) for kernel in builds.values()]
        assert torch.equal(outs[0], outs[1]), f"the builds' outputs differ at {heads, kv_heads}"
    print(f"same bits at (heads, KV heads, dim) {EXTEND_SHAPES}")
    for label, (prefixes, extends) in EXTENDS.items():
        slots, batch = extend_batch(prefixes, extends)
        q = torch.randn(sum(extends), HEADS, DIM)
        layers = [(q, pool(slots), pool(slots), *batch, SCALE) for _ in range(LAYERS)]
        compare(f"{label:22s}", builds, layers, args.repeats)
        del layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("decode", "extend"), default="decode")
    parser.add_argument("--base", default="HEAD~1", help="the git revision to compare with")
    parser.add_argument("--requests", default="4,16,32", help="decode: requests a batch")
    parser.add_argument("--positions", type=int, default=544, help="decode: each request's")
    parser.add_argument("--repeats", type=int, default=14)
    args = parser.parse_args()
    isa = "avx512" if cpu_runs("avx512") else "avx2"
    name = f"{args.kind}_attention" + ("" if isa == "avx2" else "_avx512")
    if args.kind == "decode":
        tree, wrap = decode_attention_kernel(None, isa), DecodeKernel
    else:
        tree, wrap = extend_attention_kernel(None, isa), ExtendKernel
    if tree is None:
        raise SystemExit(f"the {isa} {args.kind}-attention kernel does not build or run here")
    print(f"CPU: {cpu_info().model_name} ({isa} build), {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as folder:
        builds = {args.base: wrap(base_build(args.base, name, isa, Path(folder))), "tree": tree}
        if args.kind == "decode":
            decode_cases(builds, args)
        else:
            extend_cases(builds, args)


if __name__ == "__main__":
    main()
