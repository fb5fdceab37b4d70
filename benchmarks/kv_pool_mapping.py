"""A fresh KV pool written in 1,024-slot steps through a one-thread copy (as decode_layers.cpp
copies a step's K/V): its pages faulted in by the writes, or mapped first by
`KVPool.map_for_slots` (MAPPING_THREADS at once). Run each case in a new process, some
seconds after the last: pages the VM backed for an earlier run map far faster.

    for case in mapped faulted mapped faulted; do sleep 20; .venv/bin/python \\
        benchmarks/kv_pool_mapping.py $case; done
"""

from __future__ import annotations

import sys
import time

import torch

from radixserve.cache.kv_pool import KVPool

SLOTS, LAYERS, KV_HEADS, HEAD_DIM, STEP = 20_000, 30, 3, 64, 1024  # SmolLM2's shape, fp32


def main(case: str) -> None:
    torch.set_num_threads(1)
    pool = KVPool(SLOTS, LAYERS, KV_HEADS, HEAD_DIM, torch.float32, "cpu", prefault=True)
    if not pool.mapping:
        sys.exit("this kernel cannot map pages without writing them (Linux 5.14+)")
    k = torch.randn(STEP, KV_HEADS, HEAD_DIM)
    start = time.perf_counter()
    for first in range(1, SLOTS - STEP, STEP):
        slots = torch.arange(first, first + STEP)
        if case == "mapped":
            pool.map_for_slots(slots)
        for layer in range(LAYERS):
            pool.write(layer, slots, k, k)
    written = (SLOTS - STEP) * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4 / 2**20
    print(f"{case}: {time.perf_counter() - start:.2f} s for {written:.0f} MiB of K/V")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mapped")
