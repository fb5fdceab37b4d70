"""The decode-attention kernel of this CPU's build (`decode_attention.cpp` on AVX2-only
CPUs, `decode_attention_avx512.cpp` on AVX-512 ones) as the tree has it against the same
source at another git revision, both loaded in one process: ms over SmolLM2's 30 layers'
pools (3 KV heads of 64 dims, fp32, huge pages as the server's pool), requests of
--positions each, their slots in runs (as a fresh pool hands them out), scattered at random,
or in pairs sharing their first 512; the builds alternated, medians. Both builds' outputs
are checked to be the same bits first.

    .venv/bin/python benchmarks/decode_attention_builds.py [--base HEAD~1] [--requests 4,16,32]
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
from radixserve.model.attention import DecodeKernel, decode_attention_kernel
from radixserve.model.cpu_kernels import ISA_FLAGS, KERNEL_FLAGS, cpu_runs

LAYERS, KV_HEADS, HEADS, DIM = 30, 3, 9, 64
MODEL = Path(__file__).resolve().parent.parent / "radixserve" / "model"


def base_build(revision: str, name: str, isa: str, folder: Path) -> DecodeKernel:
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
    return DecodeKernel(ctypes.CDLL(str(library)))


def pool(slots: int) -> torch.Tensor:
    buf = torch.empty(slots, KV_HEADS, DIM)
    advise_huge_pages(buf)
    return buf.normal_()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="the git revision to compare with")
    parser.add_argument("--requests", default="4,16,32")
    parser.add_argument("--positions", type=int, default=544)
    parser.add_argument("--repeats", type=int, default=14)
    args = parser.parse_args()
    isa = "avx512" if cpu_runs("avx512") else "avx2"
    name = "decode_attention" if isa == "avx2" else "decode_attention_avx512"
    tree = decode_attention_kernel(None, isa)
    if tree is None:
        raise SystemExit(f"the {isa} decode-attention kernel does not build or run here")
    print(f"CPU: {cpu_info().model_name} ({isa} build), {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as folder:
        builds = {args.base: base_build(args.base, name, isa, Path(folder)), "tree": tree}
        length = args.positions
        for layout in ("runs", "scattered", "pairs sharing 512"):
            for count in map(int, args.requests.split(",")):
                slots = count * length + 1
                pools = [(pool(slots), pool(slots)) for _ in range(LAYERS)]
                scattered = layout == "scattered"
                order = torch.randperm(slots - 1) + 1 if scattered else torch.arange(1, slots)
                table = order.view(count, length).contiguous()
                if layout.startswith("pairs"):
                    table[1::2, :512] = table[0::2, :512]
                rows, lens = torch.arange(count), torch.full((count,), length)
                q = torch.randn(count, HEADS, DIM)
                outs = [k(q, *pools[0], table, rows, lens, 0.125) for k in builds.values()]
                assert torch.equal(outs[0], outs[1]), "the builds' outputs differ"
                times: dict[str, list[float]] = {label: [] for label in builds}
                for rep in range(args.repeats + 1):
                    for label, kernel in builds.items():
                        start = time.perf_counter()
                        for k_pool, v_pool in pools:
                            kernel(q, k_pool, v_pool, table, rows, lens, 0.125)
                        if rep:
                            times[label].append(time.perf_counter() - start)
                line = " | ".join(
                    f"{k} {statistics.median(v) * 1e3:7.1f}" for k, v in times.items()
                )
                print(f"{layout:18s} {count:3d} requests, ms: {line}", flush=True)
                del pools


if __name__ == "__main__":
    main()
