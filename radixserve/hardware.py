"""What this machine's CPU can do, detected once, and every dtype and kernel choice that
follows from it: the one place where the engine looks at the hardware.

Machines of this project differ: some are AMD EPYC with AVX2 only, some AMD EPYC (Zen 4)
with AVX-512 and AVX512-BF16 but no AMX, some Intel Xeon with AVX-512, AVX512-BF16 and AMX.
The figures behind each choice (SmolLM2-135M's layer shapes, torch 2.13.0, 2 threads):

- fp32 linear, 1 row (the weights streamed once): AMD (AVX2) MKL sgemv 9-13 GB/s, the
  project's `fp32_gemv.cpp` 16 GB/s; Intel (AVX-512) MKL 39 GB/s. MKL takes its slow paths
  on AMD CPUs: on the Zen 4 it streams one row at half the rate of `fp32_gemv.cpp`.
- fp32 linear, 16 / 64 / 512 rows: AMD 100-130 GFLOP/s; Intel 108 / 167 / 234 GFLOP/s.
- bf16 linear, 16 / 64 / 512 rows: AMD (AVX2) ~1.3 GFLOP/s (no bf16 units: ~50x slower than
  fp32); Intel 266 / 509 / 1,494 GFLOP/s (oneDNN on AMX: 2.5-6.4x fp32); AMD Zen 4
  (AVX512-BF16, oneDNN's vdpbf16ps kernels) 1.5-2x fp32 at every size (see BF16_WITHOUT_AMX).

Hence: bf16 weights and activations by default where AMX or AVX512-BF16 runs them
(`auto_dtype`), with the weights pre-blocked for oneDNN on AVX-512 CPUs
(`KernelPlan.packed_rows`) and decode-sized products through the project's tile-layout
kernel, AMX or AVX512-BF16 (`KernelPlan.blocked_rows`), fp32 ones through its fp32
counterpart on AVX-512 CPUs with AVX512-BF16 (AMD's Zen 4, Intel's AMX Xeons) and, in its
AVX2 build, on CPUs without AVX-512 (`KernelPlan.blocked_isa`); behind it, for where it
cannot be built, the one-row fp32 kernel wherever MKL's sgemv is the slower one, i.e.
everywhere but on Intel CPUs with AVX-512 (`KernelPlan.gemv`); the
decode-attention kernel wherever x86 AVX2 is there, for fp32, bf16 and fp16 KV pools, built
for AVX-512 where the CPU has it with AVX512-BF16 (`KernelPlan.decode_attention_isa`);
RMSNorm, rotary and SiLU*up fused (`KernelPlan.fused_elementwise`).

What the bf16 choices gave together on the Intel Xeon (AMX, 2 threads; `radixserve bench
step-breakdown --dtype bfloat16`, context 512, unprofiled ms per decode step before -> after):
34.7 -> 25.4 at 1 running, 55.0 -> 42.2 at 16, 126.9 -> 92.0 at 64; a bf16 prefill of 16 x 544
tokens 2688 -> 3322 tok/s with the fused ops alone.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from dataclasses import asdict, dataclass

import torch

from radixserve.config import CacheConfig, ModelConfig, ParallelConfig


@dataclass(frozen=True)
class CpuInfo:
    """The CPU's model name, its instruction-set flags (from /proc/cpuinfo), what torch's
    kernels dispatch to, and the threads torch uses."""

    model_name: str
    machine: str  # platform.machine(): x86_64, aarch64, ...
    torch_capability: str  # torch.backends.cpu.get_cpu_capability(): AVX2, AVX512, DEFAULT...
    flags: frozenset[str]
    threads: int
    vendor: str = ""  # /proc/cpuinfo's vendor_id: GenuineIntel, AuthenticAMD...

    @property
    def intel(self) -> bool:
        return self.vendor == "GenuineIntel"

    @property
    def x86(self) -> bool:
        return self.machine in ("x86_64", "AMD64")

    @property
    def avx2(self) -> bool:
        return self.x86 and {"avx2", "fma"} <= self.flags

    @property
    def avx512(self) -> bool:
        return self.x86 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= self.flags

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    @property
    def amx_bf16(self) -> bool:
        return {"amx_bf16", "amx_tile"} <= self.flags

    @property
    def amx_int8(self) -> bool:
        return {"amx_int8", "amx_tile"} <= self.flags

    @property
    def vnni(self) -> bool:
        return bool({"avx512_vnni", "avx_vnni"} & self.flags)

    @property
    def fast_bf16_matmul(self) -> bool:
        """bf16 matmuls beat fp32 here: AMX (oneDNN, 2.5-6.4x fp32 from 16 rows up), or
        AVX-512 with AVX512-BF16 (1.5-2x, see BF16_WITHOUT_AMX); without either ~50x
        slower."""
        return self.amx_bf16 or (self.avx512 and self.avx512_bf16)

    def features(self) -> dict[str, bool]:
        names = ("avx2", "avx512", "avx512_bf16", "amx_bf16", "amx_int8", "vnni")
        return {name: getattr(self, name) for name in names}

    def summary(self) -> str:
        """One line for the start-up log."""
        have = [name for name, on in self.features().items() if on] or ["none of the above"]
        return (
            f"CPU {self.model_name} ({self.machine}); torch kernels {self.torch_capability}; "
            f"{' '.join(have)}; {self.threads} threads"
        )

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["flags"] = sorted(self.flags & KNOWN_FLAGS)
        return {**d, **self.features()}


KNOWN_FLAGS = frozenset(
    "avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni avx_vnni avx512_bf16 "
    "avx512_fp16 amx_tile amx_bf16 amx_int8 amx_fp16".split()
)


def parse_cpuinfo(text: str) -> tuple[str, str, frozenset[str]]:
    """The model name, the vendor and the flags of the first processor in a /proc/cpuinfo
    text."""
    name, vendor, flags = "unknown", "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name == "unknown":
            name = value.strip()
        elif key == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return name, vendor, flags


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's CPU, read once per process."""
    try:
        with open("/proc/cpuinfo") as f:
            name, vendor, flags = parse_cpuinfo(f.read())
    except OSError:  # not Linux: torch's own dispatch level is all we know
        name, vendor, flags = platform.processor() or "unknown", "", frozenset()
    return CpuInfo(
        model_name=name,
        machine=platform.machine(),
        torch_capability=torch.backends.cpu.get_cpu_capability(),
        flags=flags,
        threads=torch.get_num_threads(),
        vendor=vendor,
    )


def auto_dtype(device: torch.device, cpu: CpuInfo | None = None) -> torch.dtype:
    """The dtype of `--dtype auto`: bf16 on CUDA and on CPUs whose bf16 matmuls are faster
    (AMX, or AVX-512 with AVX512-BF16), fp32 elsewhere (fp32 is the fidelity reference
    everywhere)."""
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if (cpu or cpu_info()).fast_bf16_matmul else torch.float32


# fp32_gemm_small.cpp up to this many rows. In-model A/B on the AVX2 machine, SmolLM2 decode
# steps, kernel vs MKL (same process, alternating steps): 1.44x at 4 running, 1.32x at 8,
# 1.21x at 16, 1.36x at 24, 1.16x at 32; 1.11x at 48 and 1.09x at 64 (a busy machine): the
# margin narrows as MKL's packing pays off, so from 33 rows (prefill chunks) MKL keeps them.
FEW_ROWS_MAX = 32

KV_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# PACKED_LINEAR: linear layers through oneDNN with the weights blocked once at load
# (`torch.ops.mkldnn._reorder_linear_weight`), on AVX-512 CPUs. Intel Xeon (Sapphire
# Rapids class, AMX), SmolLM2's shapes:
# - bf16, packed vs plain F.linear (which re-blocks the weight at every call), 1 thread:
#   1.5-2.3x at 1-16 rows, 1.5-1.9x at 64, 1.1-1.35x at 256; the 49k-row LM head 2.5x at
#   1-16 rows, 3.8x at 64. Bit-identical outputs. Every product packed.
# - fp32, packed vs MKL, decode steps in the model (2 threads, 64-token prompts): 1.5x at 2
#   running, 1.5x at 4, 1.3x at 16, 1.1x at 64; at 1 running slower (44 vs 33-38 ms: MKL's
#   sgemv streams one row at 39 GB/s), so single rows keep the plain weight and MKL; so do
#   prefill products (past 64 rows the gain is 0-6%, and oneDNN's order of the sums moved
#   SmolLM2's fp32 prefill logits 1.1e-4 from transformers', over the fidelity bar of 1e-4).
# AMD EPYC Zen 4 (AVX-512, no AMX), the same shapes, 30 layers with every weight read from
# memory, ms per pass, fp32 MKL / packed: 40.5 / 23.9 at 1 row, 68.3 / 24.4 at 2, 61.0 /
# 28.5 at 16, 139.7 / 78.9 at 64, 415.6 / 285.6 at 256 (MKL's AMD paths). fp32 prefill
# stays on MKL there too: packed layers moved the fidelity suite's prefill logits 1.1-1.6e-4
# from transformers' (over the 1e-4 bar) unless only q/k/v and gate_up were (9.5e-5).
PACKED_ROWS = {torch.bfloat16: (1, None), torch.float32: (2, 64)}  # (first, last or None)

# BF16_WITHOUT_AMX: AMD EPYC Zen 4 (AVX-512 with AVX512-BF16, no AMX), 2 threads, the 30
# layers above, ms per pass, fp32 packed / bf16 packed: 23.9 / 11.8 at 1 row, 28.5 / 18.7
# at 16, 78.9 / 44.6 at 64, 285.6 / 148.2 at 256, 2114 / 1123 at 2048 (fp32 MKL 2917). In
# the model (`bench step-breakdown`, context 256, unprofiled ms per decode step, fp32 ->
# bf16): 43 -> 28 at 1 running, 87 -> 46 at 16. So bf16 is the default there as on AMX.

# AVX512_ATTENTION: decode attention on AVX-512 + AVX512-BF16 (16 lanes, vdpbf16ps for q.k
# of a bf16 model) against the AVX2 build, SmolLM2 bf16, context 512, ms per step of
# attention: 17.3 -> 15.1 at 16 running, 60.9 -> 53.3 at 64 (it reads K/V from memory at
# ~13-16 GB/s either way); with a request's KV heads in one task 13.3 and 49.1. The AMX
# build (q . k of 16 positions per tile product, the K rows read in place where 16 slots
# are consecutive), 30 layers, context 550, K/V from memory: 13.5 -> 12.4 ms at 16 running,
# 51.3 -> 48.3 at 64; with K/V in cache 8.2 -> 6.4 (the rest is the wait for memory).

# FUSED_ELEMENTWISE: in a bf16 prefill of 16 x 544 tokens (SmolLM2, Intel Xeon AMX, 2
# threads) torch's element-wise ops took 45% of the forward (mul 19%, add 6%, copies 6%,
# pow 5%, silu 5%): each reads and writes the whole tensor, in bf16, through several
# passes. fp32 models take them too: they round as torch's fp32 ops do, but for the order of
# the norm's sum (SiLU * up is torch's bit for bit: its e^x is torch's own, see
# `CausalLM.use_fused_ops`); SiLU * up fused against torch's two ops, AMD EPYC Zen 4, fp32,
# us per call (16 / 45 / 1,024 rows of 1,536): 24.3 -> 19.0, 40.1 -> 28.0, 1226 -> 561.
# AMD EPYC Zen 4, SmolLM2 fp32 decode steps (`bench step-breakdown`, context 256,
# unprofiled ms, torch ops -> fused, before SiLU * up was): 34.5 -> 30.0 at 1
# running, 70.4 -> 64.8 at 16, 239 -> 187 at 64; the fidelity suite passes. The AVX-512 build
# (16 lanes) on CPUs with AVX-512 and AVX512-BF16, against the AVX2 one: SiLU * up 1.6-2.7x,
# RMSNorm 1.3-1.6x, rotary 1.4-1.8x (figures in fused_ops.cpp).

# AMX_LINEAR: bf16 linear layers through bf16_linear_amx.cpp (AMX tiles, the weight laid out
# once in the order the kernel reads it) against oneDNN with pre-blocked weights, Intel Xeon
# (AMX), 2 threads, 30 layers of SmolLM2's 6 products each with every weight read from
# memory (as in a decode step), ms per pass: 14.4 -> 9.2 at 1 row, 15.1 -> 9.4 at 16, 16.4
# -> 11.8 at 32, 18.6 -> 15.4 at 64, 26.3 -> 22.1 at 128, 42.1 -> 38.3 at 256 (~24 GB/s
# of weights against ~15). The same outputs up to 32 rows (bit for bit), within a bf16
# rounding past. In the model (bf16 extend batches after a 512-token cached prefix, ms per
# forward, oneDNN -> AMX above 64 rows): 128 rows 79.8 -> 72.6, 256 rows 136.1 -> 127.9,
# 512 rows 259.9 -> 242.8; but 2048 rows 741 -> 883 (oneDNN's blocking for large products
# wins there). So decode steps and mixed batches up to 256 rows; prefill chunks oneDNN.
# The same source built for AVX-512 without AMX (vdpbf16ps on the same weight layout: a
# 64-byte row of it is 16 features' pair of columns, so a row of x's pair broadcast adds
# into 16 sums at once), AMD EPYC Zen 4, the 30 layers, ms, oneDNN -> kernel (three runs
# on a noisy machine: the kernel's times steady, oneDNN's moving): 12.7-14.0 -> 7.2-9.3 at 1
# row (1.5-1.8x), 10.7-14.8 -> 7.8-9.2 at 4, 15.3-19.5 -> 12.9-15.2 at 16 (1.1-1.4x), 40-47
# -> 39-40 at 64 (1.0-1.2x), 78-83 -> 74 at 128 (1.05-1.12x): up to 128 rows there. bf16
# decode steps (context 544, unprofiled ms, runs alternated): 27.9, 26.6 -> 18.5, 17.6 at 1
# running; 48.0, 70.0 -> 41.8, 48.9 at 16; 168.8, 165.1 -> 168.2, 140.5 at 64.
# With the extend attention on AMX too (Intel Xeon AMX, 2 threads, bf16 prefill forwards,
# medians of 5, up to 256 rows -> up to 4,096 rows through the kernel, ms): 1 x 544 tokens
# 134-136 -> 109-110 (a forward of up to 1,024 rows then runs its layers in one C++ call,
# DECODE_LAYERS), 2 x 512 211-213 -> 203-206, 1 x 1,024 252 -> 232, 8 x 128 186 -> 183; but
# 2 x 544 224 -> 234, 1 x 1,536 372 -> 416, 4 x 512 351 -> 463 (oneDNN's blocking wins
# there). So up to 1,024 rows: a CPU prefill chunk (CHUNKED_PREFILL).
# Then the kernel's epilogue (the bias, the rounding to bf16) ran on the vector units while
# the next tiles' products run (bf16_linear_amx.cpp Pending), and a SiLU MLP's gate/up
# product writes silu(gate) * up (I wide) rather than [gate | up] (2I) for fused_ops to read
# back (group_silu_mul; the same bits). Intel Xeon (AMX), 2 threads, SmolLM2's 30 layers of
# distinct weights at 1,024 rows, the kernel alone, medians of 7, ms: the four products
# 122.6 -> 111.5 (gate/up 63.1 -> 54.4); gate/up then SiLU * up 71.2 -> 51.6 (544 rows 37.5
# -> 29.0, 16 rows 3.89 -> 3.44). bf16 prefill forwards (medians of 5): 2 x 512 208 -> 181,
# 1 x 544 105 -> 101.5; decode steps at 1, 16 and 64 running unchanged (13.4, 27.4, 74.8).
# With products of 32 rows or more in groups of up to 6 blocks (bf16_linear_amx.cpp
# kWideGroup) and the extend kernel's row reductions and e^x made cheaper (the same bits):
# 2 x 512 -> 166, 1 x 544 -> 93.7; a mixed step of a 1,008-token prompt and 16 decode rows
# at 560 positions 219.6 -> 209.1.
AMX_ROWS = 1024
AVX512_BF16_ROWS = 128

# FP32_LINEAR: fp32 linear layers of few rows through fp32_linear.cpp (the weight laid
# out once in blocks of 16 features, 8 rows of x by 3 blocks in 24 registers) against what
# the plan had there (oneDNN with pre-blocked weights from 2 rows, fp32_gemv.cpp at 1, MKL
# in the LM head's place before), AMD EPYC Zen 4 (AVX-512, 2 threads), 30 layers of
# SmolLM2's 6 products each with every weight read from memory, ms per pass, medians of 7
# alternated (two runs on a noisy machine): oneDNN -> kernel 23-28 -> 12-17 at 1 row (fp32_gemv
# ~26), 25-28 -> 12-15 at 2, 22-26 -> 14-18 at 8, 30-34 -> 22-24 at 16, 46-51 -> 36-39 at 32,
# 74-89 -> 69-71 at 64 (~36 GB/s of weights at 1-2 rows; ~210 GFLOP/s with the weights in
# L2). The tied LM head (49152 x 576), ms, oneDNN -> kernel: 5.3 -> 4.2 at 1 row (fp32_gemv
# 6.5), 6.9 -> 6.2 at 16, 19.2 -> 18.7 at 64. Up to 64 rows, and every row count (prefills)
# for the weights whose products it gives bit for bit as torch's F.linear (its sums in MKL's
# chunks, found at start-up: cpu_kernels.torch_sum_chunk; another order of the sums moved the
# fidelity suite past its bar, see PACKED_LINEAR): MKL -> kernel, same CPU, 2 threads, ms,
# 544 rows: 2.01 -> 1.66 (576 x 576), 6.16 -> 4.64 (1536 x 576), 5.54 -> 4.71 (576 x 1536),
# i.e. 156-179 -> 204-217 GFLOP/s; a 544-token prefill of SmolLM2 through the runner, medians
# of 20 alternated: 584-638 -> 735-781 tok/s. With each thread's next group of weights
# fetched into L2 while it works on a group: all 30 layers + the LM head at 16 rows 29.6-34.0
# -> 24.8-25.7 ms, at 8 rows 23.6 -> 20.2 (fp32_linear.cpp).
# Intel Xeon (AMX, AVX-512, 2 threads), where oneDNN on pre-blocked weights had 2-64 rows
# and MKL one (and so a step's layers ran one by one from Python: decode_layers.cpp drives
# the project's kernels only), SmolLM2 fp32, two runs alternated: `bench step-breakdown
# --context-len 544`, unprofiled ms per decode step, 31.4, 30.8 -> 21.5, 21.8 at 1 running;
# 74.3, 76.7 -> 53.2, 54.8 at 16; 191.1, 193.5 -> 168.1, 168.3 at 64; `bench one-batch
# --input-len 544`, prefill tok/s 1144, 1156 -> 1183, 1156 (the same).
FP32_BLOCKED_ROWS = 64

# FP32_LINEAR_AVX2: fp32_linear.cpp's AVX2 build (a block's 16 features in two 256-bit
# registers, 6 rows of x a pass, each block's chunk of weights kept in L1 while every row
# runs) on CPUs without AVX-512, in place of fp32_gemv.cpp (1 row), fp32_gemm_small.cpp
# (2-32) and MKL. MKL there sums in chunks of 192 columns as on a Zen 4, and the build
# reproduces F.linear bit for bit (torch_sum_chunk finds 192). AMD EPYC (Zen 3: family 25
# model 1), AVX2 only, 2 threads, SmolLM2's 180 linear weights (30 layers) from memory, ms,
# medians of 7 alternated, the plan before (fp32_gemv / fp32_gemm_small / MKL) -> the
# kernel: 26.6 -> 25.1 at 1 row, 28.8 -> 26.6 at 4, 35.7 -> 30.5 at 8, 52.3 -> 45.2 at 16,
# 80.6 -> 76.4 at 32, 170.2 -> 142.2 at 64, 281 -> 258 at 128, 568 -> 507 at 256; but 914
# -> 961 at 512 and 2,019 -> 1,936 at 1,024 (MKL 1,950): even past 256 rows. Its coded form
# (CODED_LINEAR) there, first measured: 20.2 at 1 row, 22.0 at 4, but 33.3 at 8, 47.2 at 16,
# 80.4 at 32, 147.7 at 64 (behind the plain kernel at a decode batch's rows); measured again
# (a later session, the same CPU, `benchmarks/fp32_blocked_vs_plan.py`, three runs, blocked
# -> coded): 22.1-23.6 -> 12.9-18.0 at 1 row, 23.2-25.5 -> 18.7-20.2 at 8, 31.5-38.4 ->
# 27.5-39.0 at 16, 40.4-50.3 -> 37.0-50.9 at 24, 89.6-99.4 -> 88.2-92.4 at 64, 176 -> 167 at
# 128, 323 -> 336 at 256; and whole decode steps (544 positions, the plan without -> with
# the coded form, medians of 11 x 3 steps alternated in one process, two runs, the same
# greedy tokens): 31.5, 23.6 -> 25.2, 16.7 ms at 1 running; 26.1 -> 19.2 at 4; 42.5, 39.3
# -> 45.6, 34.1 at 8; 59.1, 60.3 -> 56.3, 58.4 at 16; 92.0, 86.7 -> 90.3, 83.4 at 24. So
# the coded form takes the blocked kernel's rows here too (and no fp32 blocked copy of a
# coded weight is made). Not the lookup kernel (CODED_LUT: a 2 x 512 prefill 1,865 ms on
# MKL, 2,388 on its best build).
# Decode steps (`bench step-breakdown --context-len 544`, fp32, unprofiled ms, the plan before
# -> this one, runs alternated on a noisy machine): 38.6, 43.6 -> 37.2, 36.3 at 1 running;
# 123.6-126.3 -> 84.6-121.4 at 16; 385-565 -> 326-410 at 64 (from 33 rows the plan before
# left the products to MKL and the layers to Python; the one-call driver takes them now).
FP32_EXACT_ROWS_AVX2 = 256

# CODED_LINEAR: fp32 linear layers whose weights are 4-bit codes in disguise (every run of 32
# columns of a row (d * q) + m: GGUF's Q4_1 dequantized, as the default model's 210 linear
# weights come; its tied head is Q8_0's and stays fp32) through fp32_linear.cpp's
# coded form: the codes (6 bits a weight with d and m in fp32) decoded into fp32 in cache,
# then the blocked kernel's sums in its order: its bits from under a fifth of the bytes.
# Intel Xeon (AMX, AVX-512, 2 threads), SmolLM2's 30 layers of real weights (from memory),
# ms, medians of 4 x 3 alternated: blocked -> coded 20.4 -> 7.7 at 1 row, 21.0 -> 9.0 at 4,
# 32.0 -> 18.1 at 16, 47.3 -> 34.6 at 32, 65.2 -> 51.5 at 64, 476.6 -> 446.7 at 544; where
# MKL has the rows past 64 (its sums are in no order the blocked kernel can take on this
# CPU), MKL -> coded 86.5 -> 57.7 at 64, 94.8 -> 72.3 at 80, 129.4 -> 109.5 at 128, 191.8
# -> 163.4 at 192, 235.0 -> 218.0 at 256, 329.3 -> 325.8 at 384; but its sums (in chunks of
# 128 columns there) took the fidelity suite's batch prefill (8 prompts, 104 rows) 1.04e-4
# from transformers' logits, over its bar: so the coded form takes the blocked kernel's rows
# (up to 64 there; on a CPU where the blocked kernel's sums are MKL's, every row count).

# CODED_AMX: fp32 products of many rows of weights that are GGUF codes in disguise (the
# default model's 180 linear weights, Q4_1) on AMX's bf16 tiles (fp32_coded_amx.cpp): the
# codes are small integers, exact in bf16, x goes in as three bf16 parts that sum to it
# exactly, so every product is exact and summed in fp32, from three tile products per 32
# columns. Intel Xeon (AMX, 2 threads), SmolLM2's 30 layers of real weights, ms, medians of
# 3 x 2 alternated, the kernel alone (x split once) / with its split: MKL 108.9 -> 48.7 / 58.3
# at 128 rows, 364.7 -> 187.1 / 231.0 at 512, 717.0 -> 386.0 / 459.5 at 1,024 (1.85x at
# 1,024 with q, k and v reading one split); a prefill of 2 x 512 tokens through the runner
# 853 -> 597 ms. Accuracy, against the same weights in fp64 (max |error| / max |output|, one
# product of 200 rows): 2.3-3.5e-7 against MKL's 2.8-5.7e-7. Through the model (SmolLM2,
# the fidelity suite's 8 prompts, logits against transformers run in fp64, max / mean abs
# error): as they are (84 rows) 8.8e-5 / 1.13e-5, transformers fp32 8.99e-5 / 1.13e-5, the
# MKL path 1.06e-4 / 1.28e-5; each repeated 4 times (336 rows) 8.8e-5 / 8.7e-6, 8.75e-5 /
# 9.3e-6, 7.3e-5 / 8.7e-6: fp32's accuracy, as the others. But its rounding is not MKL's,
# and transformers' is MKL's: against transformers fp32 the suite's 84-row batch lands
# 1.75e-4 away (the MKL path 7.6e-5; transformers itself moves 6.8e-5 between row counts).
# The fidelity suite's bar (1e-4 from transformers fp32) is kept by leaving products of under
# 128 rows to MKL (the suite's batch is 84 rows); the kernel's accuracy is tested against
# fp64 (tests/test_packed_linear.py).
CODED_AMX_ROWS = 128

# CODED_LUT: fp32 products of many rows of weights that are 4-bit GGUF codes (Q4_1) by tables of
# subset sums (fp32_coded_lut.cpp): per 8 columns, 4 vector loads and 3 exact doublings stand in for
# 8 FMAs (~11 512-bit loads and ~30 other instructions per feature, 16 rows and 16 columns, against
# MKL's 16 512-bit FMAs), so the kernel beats MKL (at the FMA peak) where a core issues one 512-bit
# FMA a cycle (AMD's Zen 4; expected ~1.4x), and loses where it issues two (Intel's Xeons). What a
# core issues can not be read from its flags, so on CPUs with the blocked fp32 kernel and no AMX
# (AMD's Zen 4; Intel's AVX-512 Xeons without AMX) it is measured at start-up (`measure_coded_lut`:
# each build of the kernel against MKL on one weight of each shape, CODED_LUT_SAMPLE_ROWS rows, 7
# alternated) and a shape takes the kernel where it ran CODED_LUT_MARGIN times faster than MKL or
# more, by the least times and by the medians both (a process that took a core during the
# median-only version made a 0.8x shape read 1.36x once), for products of CODED_LUT_ROWS rows or
# more (the fidelity suite's 84-row batch stays on MKL, as for CODED_AMX: through the model the
# kernel lands 1.4e-4 from transformers fp32, though 1.13e-4 from fp64 against transformers' own
# 9.0e-5, mean 1.03e-5 against 1.13e-5). An attention's q, k and v take x's tables in one call
# (`shared_input_products`), so they are measured and taken as the one product they make (960 x 576
# for SmolLM2; alone, k's and v's 192 features ran 0.71x: too few to pay for the tables). Intel
# Xeon (AVX-512, two 512-bit FMAs a cycle), 2 threads, a layer's products (q, k, v in one call),
# ms, medians of 7 alternated, MKL / 16 rows a vector in chunks of 2 groups (the best build
# there): 3.37 / 3.47 at 128 rows, 12.41 / 13.41 at 512, 23.78 / 26.75 at 1,024 (0.89x; 1 group
# 0.84x, 4 groups 0.83x, 8 rows a vector 0.58-0.79x); a 2 x 512 prefill 877 vs 965 ms
# (benchmarks/coded_lut_vs_mkl.py, raw
# benchmarks/coded-lut-vs-mkl-2026-12-05-intel-amx-session20.txt; the nineteenth session's
# build, its transposes scalar and q, k, v called apart: 0.82x at 1,024 rows, 875 vs 1,087 ms);
# its start-up measurement there ~0.5 s, per shape 0.85-0.90x (960 x 576), 0.81-0.86x (576 x
# 576), 0.85-0.86x (576 x 1,536), 1.00-1.12x (3,072 x 576; three runs): the AMX kernel is the
# one on AMX CPUs anyway. Accuracy against fp64 as MKL's (max |error| / max
# |output| 4.7e-7 vs 5.2e-7). Unmeasured on AMD's Zen 4: its start-up measurement decides there.
# On a Zen 4 the blocked kernel over codes takes every row count (its sums are MKL's there, see
# FP32_LINEAR; ~1.25x MKL at 544 rows), so that is what the lookup kernel must beat there, and
# it is measured against it (the layers as they run without it); its rows come before the
# blocked kernel's (`Linear.uses_blocked`). Until the twenty-first session the kernel was
# measured against MKL and, once chosen, never ran there (the blocked kernel came first). On
# the Intel Xeon with the blocked kernel forced to every row count (`coded_lut_vs_mkl.py
# --blocked-prefill`, 2 threads, medians of 7): a layer's products on the best build 0.94x /
# 0.97x the blocked kernel's at 256 / 1,024 rows; a 2 x 512 prefill 924 vs 920 ms (1.00x).
CODED_LUT_ROWS = 128
CODED_LUT_SAMPLE_ROWS = 256
CODED_LUT_MARGIN = 1.1

# EXTEND_ATTENTION: prefill / extend attention of a model over a pool of its dtype, SmolLM2's
# heads (9 query, 3 KV, dim 64), AMD EPYC Zen 4 (AVX-512, AVX512-BF16), 2 threads, ms per
# layer, torch SDPA (flash, CPU; extends: K/V gathered, a mask) -> extend_attention_avx512.cpp,
# bf16: one 544-token prompt 5.5 -> 1.5 (~230 GFLOP/s); 16 requests of 32 new tokens after 512
# cached 8.9 -> 2.8. Outputs within SDPA's own bf16 error of an fp64 reference. fp32, the
# same shapes: 6.1 -> 2.2 and 9.7 -> 4.6 (extend_attention_avx512.cpp); the AVX2 build
# (8 lanes) on the same CPU 3.9 and 7.1 (not measured on an AVX2-only CPU).

# DECODE_LAYERS: a decode step's 30 decoder layers from one C++ call (decode_layers.cpp:
# the same kernels in the same order, logits bit for bit the Python layers') against the
# Python loop over them (~300 calls a step through torch's dispatch), AMD EPYC Zen 4
# (AVX-512, no AMX), 2 threads, SmolLM2 fp32, context 560, ms per forward, runs alternated:
# 28.4 -> 21.1 at 1 running, 34.0 -> 22.5 at 4, 61.5-61.9 -> 48.0-52.7 at 16, 109.3 -> 93.6
# at 32, 207-213 -> 176-199 at 64; bf16 18.2 -> 13.0 at 1, 25.3 -> 16.5 at 5, 41.0 -> 34.1
# at 16. `bench step-breakdown` (unprofiled ms per step, layer by layer -> one call): 28.8
# -> 22.6 at 1, 60.3 -> 50.7 at 16; at 64 the two overlap on this noisy machine (182-203
# against 165-231 over 3 runs each). The gain is the dispatch between the kernels, so it
# falls as a step's products grow; every row count takes it. Mixed steps (the Engine, 64
# shared-prefix requests, 16 running, medians over a run, two runs alternated, ms): 15
# decode rows + one request's 32 new tokens after a cached 512 90.6, 91.6 -> 79.7, 82.0;
# with two such requests (78 rows) 125.1, 137.2 -> 124.9, 117.3. Up to 1,024 rows (past
# them the Python MLP goes in chunks, and a step's products dwarf the calls between).
# Where the Python layers give a product of 256 rows or more to torch's F.linear (fp32, no
# bias: on AVX2 CPUs MKL's rows, past the blocked kernel's), the driver calls the sgemm F.linear
# calls, as it calls it (the same bits), rather than leave the step to Python. AMD EPYC
# (Zen 3, AVX2 only), 2 threads, SmolLM2 fp32, a mixed step of 16 decode rows (544 cached)
# and two arriving prompts of 544 and 310 tokens (870 rows), ms, medians of 10 alternated
# (`benchmarks/decode_driver_ab.py --batch-sizes 16 --context-len 544 --arriving 544 310`),
# Python layers -> one call: 1639 -> 1511, 1689 -> 1527, 1610 -> 1596, 1835 -> 1726, 2221 ->
# 2174, 1746 -> 1646 (1.01-1.11x, six runs; the Python calls cost more when the machine is
# busier, the worker thread waking late for each of the ~450 kernels). `bench serving`, 64
# prompts of 544 sharing nothing, 16 streams, req/s without -> with, three rounds
# alternated: 0.77 -> 0.84, 0.75 -> 0.81, 0.82 -> 0.81 (prefill forward 73.3 -> 66.9 s,
# 76.4 -> 69.3, 68.5 -> 69.4).


@dataclass(frozen=True)
class KernelPlan:
    """Which of the project's C++ CPU kernels the model uses; torch ops do the rest."""

    decode_attention: bool  # decode_attention.cpp: one-token rows read K/V in the pool
    # fp32_gemv.cpp: one-row fp32 linear layers (batch-1 decode), where MKL's sgemv is
    # slower (every CPU but Intel's with AVX-512) and no blocked kernel takes them, ahead of
    # packed_rows' other products (AVX2-only CPUs: behind the blocked kernel's AVX2 build,
    # for where that cannot be built)
    gemv: bool
    # fp32_gemm_small.cpp for linear layers of 2..few_rows_max rows (small decode batches);
    # 0: off. AVX2-only CPUs (see FEW_ROWS_MAX); unmeasured on AVX-512, which keeps MKL there
    few_rows_max: int = 0
    # --quantization int8: from this many rows up, MKL on the weight widened to fp32 instead
    # of the int8 kernel. AVX2: 48 (measured: the kernel, which reads a quarter of the bytes,
    # wins below it). AVX-512: 16 (there MKL fp32 streams 39 GB/s, and the AVX2 int8 kernel
    # measured slower than MKL fp32 at 16 rows: multi-turn serving 0.84x fp32).
    int8_dequant_min_rows: int = 48
    # products of (first, last) rows (last None: no bound) in every linear layer and the LM
    # head with the weight pre-blocked for oneDNN (`layers.packed_linear`); None: off.
    # AVX-512 CPUs: bf16 (AMX or AVX512-BF16) every product, fp32 2-64 rows (see
    # PACKED_LINEAR)
    packed_rows: tuple[int, int | None] | None = None
    # which build of the decode-attention kernel: "avx2" (decode_attention.cpp), or
    # "avx512" (decode_attention_avx512.cpp: 16 lanes, and vdpbf16ps for a bf16 model's
    # q . k) on CPUs with AVX-512 and AVX512-BF16 (see AVX512_ATTENTION), or "amx" (that
    # source built with AMX: a bf16 model's q . k on the tile unit) where AMX-BF16 is there
    decode_attention_isa: str = "avx2"
    # bf16 and fp32 models: RMSNorm, rotary and SiLU * up as one C++ pass each instead of
    # chains of torch ops (see FUSED_ELEMENTWISE), built for this ISA:
    # "avx2" or "avx512" (fused_ops.cpp's 8- or 16-lane build; AVX512-BF16 too); "": off
    fused_elementwise: str = ""
    # products of 1..blocked_rows rows (decode steps) through a kernel that reads its own
    # layout of the weights, ahead of packed_rows; 0: off. bf16: bf16_linear_amx.cpp on
    # CPUs with AMX-BF16, and AVX-512 CPUs with AVX512-BF16 (see AMX_LINEAR), the build
    # named by blocked_isa ("amx" or "avx512"); fp32: fp32_linear.cpp on AVX-512
    # CPUs with AVX512-BF16, AMD's and Intel's (see FP32_LINEAR), its "avx2" build on
    # CPUs without AVX-512 (see FP32_LINEAR_AVX2)
    blocked_rows: int = 0
    blocked_isa: str = "avx512"
    # fp32 on the blocked kernel: the most rows of a product that a weight whose products
    # it gives bit for bit as torch's F.linear takes there (None: every row count; AVX2:
    # past FP32_EXACT_ROWS_AVX2 MKL is as fast)
    blocked_exact_rows: int | None = None
    # fp32 models on the blocked kernel: weights that are 4-bit codes in disguise (GGUF's
    # Q4_1 dequantized, the default model's) read as their codes by that kernel's coded
    # form, in the blocked kernel's rows and with its bits (see CODED_LINEAR)
    coded_linear: bool = False
    # fp32 models on the blocked kernel, CPUs with AMX-BF16: products of this many rows or
    # more (past blocked_rows: prefill chunks, large mixed steps) of weights that are GGUF
    # codes in disguise through fp32_coded_amx.cpp (x split into three bf16 parts that sum
    # to it exactly, the codes exact in bf16: every product exact, sums in fp32) instead of
    # MKL; 0: off (see CODED_AMX)
    coded_amx_rows: int = 0
    # fp32 models on the blocked kernel, CPUs without AMX: products of this many rows or more
    # of weights that are 4-bit codes through fp32_coded_lut.cpp (tables of subset sums),
    # for the shapes where it measures faster than MKL at start-up; 0: off (see CODED_LUT)
    coded_lut_rows: int = 0
    # a model's prefill and extend rows (new tokens after a cached prefix) attend over a
    # pool of the model's dtype in place, flash-style, instead of torch's SDPA over gathered
    # K/V with a mask: fp32 models on any CPU with AVX2 (extend_attention.cpp, or the
    # AVX-512 build where decode_attention_isa says so), bf16 ones on CPUs with AVX-512 and
    # AVX512-BF16 (extend_attention_avx512.cpp) (see EXTEND_ATTENTION)
    extend_attention: bool = False
    # a step's decoder layers driven from one C++ call (decode_layers.cpp) where every
    # kernel of the step is one of the above or torch's F.linear's own sgemm (decode steps;
    # mixed and extend steps of up to 1,024 rows where the extend kernel runs): the same
    # kernels in the same order, without ~300 Python calls a step (see DECODE_LAYERS)
    decode_layers: bool = False

    @classmethod
    def choose(
        cls,
        kernels: str,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        cpu: CpuInfo | None = None,
    ) -> KernelPlan:
        """`--kernels torch`: none. `auto`: each kernel where it wins on this CPU (see the
        list at the top of this module)."""
        cpu = cpu or cpu_info()
        on_x86 = kernels == "auto" and device.type == "cpu" and cpu.avx2
        fp32_linears = on_x86 and dtype == torch.float32 and not cpu.avx512  # AVX2-only, fp32
        # one fp32 row: MKL's sgemv streams fastest on Intel's AVX-512 CPUs, not elsewhere
        gemv = on_x86 and dtype == torch.float32 and not (cpu.avx512 and cpu.intel)
        onednn = kernels == "auto" and device.type == "cpu" and torch.backends.mkldnn.is_available()
        packed = onednn and cpu.avx512 and (dtype == torch.float32 or cpu.fast_bf16_matmul)
        attention = on_x86 and kv_dtype in KV_KERNEL_DTYPES
        wide = cpu.avx512 and cpu.avx512_bf16  # the kernels' 16-lane builds run here
        fused_dtype = dtype in (torch.bfloat16, torch.float32)
        blocked_rows = 0  # through bf16_linear_amx.cpp (AMX or AVX-512) or fp32_linear.cpp
        # fp32: AMD's Zen 4 and Intel's AMX Xeons alike (see FP32_LINEAR); the AVX2 build
        # where there is no AVX-512 (see FP32_LINEAR_AVX2)
        fp32_blocked = on_x86 and dtype == torch.float32 and (wide or not cpu.avx512)
        blocked_isa = "avx512"
        if packed and dtype == torch.bfloat16 and wide:
            blocked_rows = AMX_ROWS if cpu.amx_bf16 else AVX512_BF16_ROWS
            blocked_isa = "amx" if cpu.amx_bf16 else "avx512"
        elif fp32_blocked:
            blocked_rows = FP32_BLOCKED_ROWS
            blocked_isa = "avx512" if wide else "avx2"
        return cls(
            decode_attention=attention,
            gemv=gemv and not (fp32_blocked and wide),
            few_rows_max=FEW_ROWS_MAX if fp32_linears else 0,
            int8_dequant_min_rows=16 if cpu.avx512 else 48,
            packed_rows=PACKED_ROWS.get(dtype) if packed and not fp32_blocked else None,
            decode_attention_isa=(
                ("amx" if cpu.amx_bf16 else "avx512") if attention and wide else "avx2"
            ),
            fused_elementwise=("avx512" if wide else "avx2") if on_x86 and fused_dtype else "",
            blocked_rows=blocked_rows,
            blocked_isa=blocked_isa,
            blocked_exact_rows=FP32_EXACT_ROWS_AVX2 if fp32_blocked and not wide else None,
            coded_linear=fp32_blocked,
            coded_amx_rows=CODED_AMX_ROWS if fp32_blocked and cpu.amx_bf16 else 0,
            coded_lut_rows=CODED_LUT_ROWS if fp32_blocked and wide and not cpu.amx_bf16 else 0,
            decode_layers=attention and on_x86 and fused_dtype,
            extend_attention=attention
            and dtype == kv_dtype
            and (dtype == torch.float32 or (wide and dtype == torch.bfloat16)),
        )


# MALLOC: glibc's malloc returns freed memory to the kernel eagerly (blocks of 128 kB-32 MB
# go to fresh mmaps, the heap's free top is trimmed), so a forward pass that frees and
# allocates activations of a few MB, layer after layer, takes page faults (zeroed pages) on
# every new one. With big blocks kept on the heap and the heap never trimmed below 1 GiB of
# free top, a bf16 prefill of 4 x 544 tokens (SmolLM2, Intel Xeon AMX, 2 threads) ran in
# 457-466 ms against 569-580 (1.24x); decode steps (small activations) unchanged. The cost:
# the process keeps the peak of its activations mapped (what tcmalloc, which vLLM's CPU
# docs have preloaded, does too).
MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks above it are mmapped still
MALLOC_TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


@functools.cache
def keep_freed_memory() -> bool:
    """Tune glibc's malloc for a forward pass's activations (see MALLOC), once per
    process; False where the C library is not glibc (no mallopt) or refuses."""
    if not sys.platform.startswith("linux"):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: a fixed trim threshold freezes glibc's dynamic one at 128 kB
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
        and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
    )


# CHUNKED_PREFILL: the most new tokens one step takes when --chunked-prefill-size is not
# given. A GPU step costs about the same for a few hundred tokens as for a few thousand, so
# large chunks (SGLang's 8192) finish prompts in fewer steps. A CPU step's cost grows with
# its rows from a few dozen on (the products are compute-bound), so a larger chunk buys no
# throughput: every request behind it waits for the whole chunk before its first token, and
# steps of up to 1,024 rows run the decoder in one C++ call (DECODE_LAYERS). AMD EPYC Zen 4,
# 2 cores, SmolLM2 fp32, `bench serving` at 16 streams on the vs-vLLM workloads, req/s and
# TTFT p50, 8192 -> 1024 (runs alternated, 2-3 each): no sharing 1.20-1.22 -> 1.22-1.29,
# 11.4 s -> 2.5-3.4 s (TPOT p50 52 -> 300-313 ms: with prompts always waiting, each decode
# token rides in a chunk's step instead of all prefill first); shared prefix 4.53-4.63 ->
# 4.46-4.70, 743-788 -> 490-667 ms; multi-turn 4.39-4.78 -> 4.63-4.64, 1.45 -> 1.06-1.12 s.
# 2048: no sharing 1.19-1.27, shared prefix 4.25-4.46; 4096: no sharing 1.11.
CHUNKED_PREFILL = {"cpu": 1024, "cuda": 8192}


def chunk_default(device: torch.device) -> int:
    """The chunk length for `device` when --chunked-prefill-size is not given."""
    return CHUNKED_PREFILL.get(device.type, CHUNKED_PREFILL["cuda"])


def resolve_device_and_dtype(model: ModelConfig) -> tuple[torch.device, torch.dtype]:
    """The one place where "auto" device and dtype become concrete."""
    if model.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(model.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda was asked for but torch sees no CUDA device")
    if model.dtype != "auto":
        return device, getattr(torch, model.dtype)
    # int8 layers compute in fp32 (`model/quantization.py`)
    return device, torch.float32 if model.quantization == "int8" else auto_dtype(device)


def resolve_kv_dtype(cache: CacheConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype: the model's unless --kv-cache-dtype names another."""
    return dtype if cache.kv_cache_dtype == "auto" else getattr(torch, cache.kv_cache_dtype)


def place_process(parallel: ParallelConfig, index: int) -> str:
    """Threads (and cores) of the `index`-th of this machine's scheduler / tensor-parallel
    rank processes (replica d's local rank r is d * ranks_per_node + r): --cpu-threads
    each, by default the cores divided among them; when they all fit, each is bound to its
    own cores (a rank that waits for another spins on its own core, not on the other's),
    else none is bound. The calling thread's affinity only (new threads inherit it). Returns
    what was done, for the log."""
    cores = sorted(os.sched_getaffinity(0))
    threads = parallel.threads_per_replica(len(cores))
    torch.set_num_threads(threads)
    processes = parallel.dp_size * parallel.ranks_per_node
    if processes == 1 or processes * threads > len(cores):
        return f"{threads} threads"
    mine = cores[index * threads : (index + 1) * threads]
    os.sched_setaffinity(0, mine)
    return f"{threads} threads on cores {','.join(map(str, mine))}"
