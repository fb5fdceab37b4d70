"""CPU detection and the choices that follow from it, for each kind of machine this project
runs on (AMD EPYC with AVX2 only; AMD EPYC Zen 4 with AVX-512 and AVX512-BF16, no AMX; Intel
Xeon with AVX-512, AVX512-BF16 and AMX), whichever one the tests run on."""

from __future__ import annotations

import dataclasses
import platform
import sys

import torch

from radixserve.config import CacheConfig, ModelConfig
from radixserve.hardware import (
    AMX_ROWS,
    AVX512_BF16_ROWS,
    CODED_AMX_ROWS,
    CODED_LUT_ROWS,
    FEW_ROWS_MAX,
    FP32_BLOCKED_ROWS,
    FP32_EXACT_ROWS_AVX2,
    CpuInfo,
    KernelPlan,
    auto_dtype,
    cpu_info,
    keep_freed_memory,
    parse_cpuinfo,
    resolve_device_and_dtype,
    resolve_kv_dtype,
)

AMD_FLAGS = "fpu sse sse2 avx f16c fma avx2 bmi2 sha_ni vaes"
INTEL_FLAGS = (
    AMD_FLAGS + " avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16"
    " amx_bf16 amx_tile amx_int8"
)
CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: {flags}

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: {flags}
"""
ZEN4_FLAGS = AMD_FLAGS + " avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"
CPU = torch.device("cpu")


def cpu(flags: str, capability: str = "AVX2", vendor: str = "") -> CpuInfo:
    return CpuInfo("test cpu", "x86_64", capability, frozenset(flags.split()), 2, vendor)


def intel_cpu(flags: str = INTEL_FLAGS) -> CpuInfo:
    return cpu(flags, "AVX512", "GenuineIntel")


def test_parse_cpuinfo_reads_the_first_processor():
    name, vendor, flags = parse_cpuinfo(CPUINFO.format(flags=INTEL_FLAGS))
    assert name == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert vendor == "GenuineIntel"
    assert {"amx_bf16", "avx512_bf16", "avx2"} <= flags
    assert parse_cpuinfo("") == ("unknown", "", frozenset())


def test_features_of_each_kind():
    amd, intel = cpu(AMD_FLAGS), intel_cpu()
    assert amd.avx2 and not amd.avx512 and not amd.amx_bf16 and not amd.fast_bf16_matmul
    assert intel.intel and not amd.intel
    zen4 = cpu(ZEN4_FLAGS, "AVX512", "AuthenticAMD")
    assert zen4.avx512 and zen4.avx512_bf16 and not zen4.amx_bf16 and zen4.fast_bf16_matmul
    assert intel.avx2 and intel.avx512 and intel.avx512_bf16 and intel.amx_bf16
    assert intel.fast_bf16_matmul and intel.vnni and intel.amx_int8
    assert "avx2" in amd.summary() and "amx_bf16" not in amd.summary()
    assert "amx_bf16" in intel.summary()
    arm = CpuInfo("arm", "aarch64", "DEFAULT", frozenset({"asimd", "fma", "avx2"}), 2)
    assert not arm.avx2  # flag names only count on x86


def test_auto_dtype_is_bf16_only_where_bf16_units_make_it_faster():
    assert auto_dtype(CPU, cpu(AMD_FLAGS)) == torch.float32
    assert auto_dtype(CPU, cpu(AMD_FLAGS + " avx512f avx512bw avx512vl")) == torch.float32
    assert auto_dtype(CPU, cpu(ZEN4_FLAGS, "AVX512")) == torch.bfloat16  # AVX512-BF16
    assert auto_dtype(CPU, cpu(INTEL_FLAGS, "AVX512")) == torch.bfloat16
    assert auto_dtype(torch.device("cuda"), cpu(AMD_FLAGS)) == torch.bfloat16


def test_config_resolution_follows_this_machine():
    _, dtype = resolve_device_and_dtype(ModelConfig(device="cpu"))
    assert dtype == auto_dtype(CPU, cpu_info())
    _, dtype = resolve_device_and_dtype(ModelConfig(device="cpu", dtype="float32"))
    assert dtype == torch.float32  # an explicit dtype is never overridden
    _, dtype = resolve_device_and_dtype(ModelConfig(device="cpu", quantization="int8"))
    assert dtype == torch.float32  # int8 layers compute in fp32, on AMX CPUs too
    assert resolve_kv_dtype(CacheConfig(), torch.float32) == torch.float32
    assert resolve_kv_dtype(CacheConfig(kv_cache_dtype="bfloat16"), torch.float32) == (
        torch.bfloat16
    )


def test_kernel_plan_per_cpu():
    f32, bf16 = torch.float32, torch.bfloat16
    amd, intel = cpu(AMD_FLAGS), intel_cpu()
    # AVX2 only: the blocked fp32 kernel's AVX2 build up to 64 rows, up to 256 for weights
    # whose products it gives as torch's (the one-row and few-rows kernels behind it, for
    # where it cannot be built); decode attention for any pool; the fused
    # element-wise ops (fp32 and bf16 models alike), their 8-lane build; the extend
    # kernel's AVX2 build where the pool is fp32 as the model; with decode attention and
    # fused ops for the model's dtype, a decode step's layers driven from one C++ call;
    # weights that are GGUF codes read as their codes in the blocked kernel's rows, but no
    # lookup kernel for prefills (FP32_LINEAR_AVX2)
    avx2_fp32 = KernelPlan(
        *(True, True, FEW_ROWS_MAX, 48),
        fused_elementwise="avx2",
        decode_layers=True,
        blocked_rows=FP32_BLOCKED_ROWS,
        blocked_isa="avx2",
        blocked_exact_rows=FP32_EXACT_ROWS_AVX2,
        coded_linear=True,
    )
    assert KernelPlan.choose("auto", CPU, f32, bf16, amd) == avx2_fp32
    assert KernelPlan.choose("auto", CPU, f32, f32, amd) == dataclasses.replace(
        avx2_fp32, extend_attention=True
    )
    # AVX-512: MKL streams one row faster, and beats the int8 kernel from 16 rows up; fp32
    # and bf16 models keep the attention kernel, its AVX-512 build (AVX512-BF16 too); oneDNN
    # on pre-blocked weights from 2 rows up in fp32, for every product in bf16 (AMX)
    onednn = torch.backends.mkldnn.is_available()
    fp32_rows, bf16_rows = ((2, 64), (1, None)) if onednn else (None, None)
    # (fp32 models on AVX-512 CPUs with AVX512-BF16: the blocked fp32 kernel up to 64 rows,
    # Intel's as AMD's, and MKL past them; weights that are 4-bit codes read as such there,
    # and with AMX, as codes on the tiles from CODED_AMX_ROWS rows up)
    intel_fp32 = KernelPlan(True, False, 0, 16, None, "amx", "avx512")  # built with AMX
    intel_fp32 = dataclasses.replace(
        intel_fp32,
        extend_attention=True,
        decode_layers=True,
        blocked_rows=FP32_BLOCKED_ROWS,
        coded_linear=True,
        coded_amx_rows=CODED_AMX_ROWS,
    )
    assert KernelPlan.choose("auto", CPU, f32, f32, intel) == intel_fp32
    no_bf16 = intel_cpu(INTEL_FLAGS.replace("avx512_bf16", ""))
    no_bf16_fp32 = KernelPlan(
        *(True, False, 0, 16, fp32_rows),
        fused_elementwise="avx2",
        extend_attention=True,
        decode_layers=True,
    )
    assert KernelPlan.choose("auto", CPU, f32, f32, no_bf16) == no_bf16_fp32
    # (and bf16 models: with AMX, decode-sized products through the AMX kernel; prompts'
    # attention through the extend kernel where the pool is bf16 too)
    amx_rows = AMX_ROWS if onednn else 0
    intel_bf16 = KernelPlan(True, False, 0, 16, bf16_rows, "amx", "avx512", amx_rows, "amx")
    intel_bf16 = dataclasses.replace(intel_bf16, decode_layers=True)
    assert KernelPlan.choose("auto", CPU, bf16, f32, intel) == intel_bf16
    assert KernelPlan.choose("auto", CPU, bf16, bf16, intel) == dataclasses.replace(
        intel_bf16, extend_attention=True
    )
    assert not KernelPlan.choose("auto", CPU, f32, bf16, intel).extend_attention  # pool != q
    assert not KernelPlan.choose("auto", CPU, bf16, bf16, no_bf16).extend_attention
    amd_bf16 = KernelPlan.choose("auto", CPU, bf16, bf16, amd)
    assert amd_bf16.packed_rows is None and amd_bf16.fused_elementwise == "avx2"
    assert amd_bf16.blocked_rows == 0 and amd_bf16.blocked_exact_rows is None
    assert not amd_bf16.extend_attention  # its build needs AVX-512 and AVX512-BF16
    assert not KernelPlan.choose("auto", CPU, torch.float16, torch.float16, intel).fused_elementwise
    assert KernelPlan.choose("torch", CPU, bf16, bf16, intel).packed_rows is None
    # AVX-512 with AVX512-BF16, no AMX (AMD Zen 4): every bf16 product packed, decode-sized
    # ones through the AMX kernel's AVX-512 build; fp32 products of up to 64 rows through
    # the fp32 blocked kernel (nothing packed; no one-row kernel), and products of many rows
    # of 4-bit codes by tables of subset sums from CODED_LUT_ROWS rows up, for the shapes
    # where they measure faster than MKL at start-up
    zen4 = cpu(ZEN4_FLAGS, "AVX512", "AuthenticAMD")
    zen4_rows = AVX512_BF16_ROWS if onednn else 0  # the AVX-512 build of the AMX kernel
    assert KernelPlan.choose("auto", CPU, bf16, bf16, zen4) == KernelPlan(
        *(True, False, 0, 16, bf16_rows, "avx512", "avx512", zen4_rows, "avx512"),
        extend_attention=True,
        decode_layers=True,
    )
    assert KernelPlan.choose("auto", CPU, f32, f32, zen4) == KernelPlan(
        *(True, False, 0, 16, None, "avx512", "avx512", FP32_BLOCKED_ROWS, "avx512"),
        extend_attention=True,
        decode_layers=True,
        coded_linear=True,
        coded_lut_rows=CODED_LUT_ROWS,
    )
    # (Intel's AMX Xeons the same, but for the attention kernel's AMX build and the AMX
    # products over codes in place of the lookups; without AMX no product goes to the tiles)
    assert KernelPlan.choose("auto", CPU, f32, f32, intel) == dataclasses.replace(
        KernelPlan.choose("auto", CPU, f32, f32, zen4),
        decode_attention_isa="amx",
        coded_amx_rows=CODED_AMX_ROWS,
        coded_lut_rows=0,
    )
    assert not KernelPlan.choose("auto", CPU, torch.float16, torch.float16, zen4).extend_attention
    assert not KernelPlan.choose("auto", CPU, torch.float16, torch.float16, zen4).decode_layers
    # AVX-512 without AVX512-BF16 or AMX: bf16 matmuls are not fast, nothing packed for them
    avx512_only = cpu(AMD_FLAGS + " avx512f avx512dq avx512bw avx512vl", "AVX512")
    assert KernelPlan.choose("auto", CPU, bf16, bf16, avx512_only).packed_rows is None
    assert KernelPlan.choose("auto", CPU, f32, f32, avx512_only).blocked_rows == 0
    # torch ops only, or not a CPU with AVX2, or not a CPU at all
    assert KernelPlan.choose("torch", CPU, f32, f32, amd) == KernelPlan(False, False)
    assert KernelPlan.choose("auto", CPU, f32, f32, cpu("sse sse2 avx")) == KernelPlan(False, False)
    cuda = torch.device("cuda")
    assert KernelPlan.choose("auto", cuda, bf16, bf16, intel) == KernelPlan(False, False, 0, 16)


def test_this_machine_is_described():
    info = cpu_info()
    assert info.torch_capability == torch.backends.cpu.get_cpu_capability()
    assert info.summary().startswith("CPU ")
    report = info.as_dict()
    assert set(report["flags"]) <= info.flags
    assert report["avx2"] == info.avx2


def test_malloc_keeps_freed_memory_where_the_c_library_is_glibc():
    """The model runner tunes glibc's malloc once per process (hardware.MALLOC): mallopt
    accepts both settings there; elsewhere the call reports that nothing was done."""
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is glibc
    assert keep_freed_memory() is glibc  # once per process: the cached answer
