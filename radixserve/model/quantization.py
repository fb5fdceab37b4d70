"""Weight-only int8 quantization (`--quantization int8`): a quarter of the weight bytes.

Decode on CPU is bound by memory bandwidth: every step reads every weight once (538 MB in
fp32 for SmolLM2-135M). Here each linear weight, and the LM head, is stored as int8 with
one fp32 scale per output channel (symmetric: scale = max|row| / 127); activations stay
fp32, so the only error is the rounding of the weights. The embedding lookup stays fp32: a
tied LM head gets its own int8 copy of the embedding matrix.

The matmul is chosen once per process:
- `int8_linear.cpp` (AVX2 + FMA; built by cpu_kernels.py once): it reads int8
  and widens in registers.
- otherwise torch's `_weight_int8pack_mm`: the same arithmetic, vectorized only for
  AVX-512 and ARM (on AVX2 it is 5-50x slower than fp32 matmul; a warning says so).
From `dequant_min_rows` rows up (48 on AVX2, 16 on AVX-512: `radixserve.hardware`) the
product is bound by compute, not bytes: the weight is widened to fp32 and the matmul goes to
MKL like the unquantized model's.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.base import CausalLM
from radixserve.model.cpu_kernels import load_kernel, profiled

logger = logging.getLogger(__name__)

DEQUANT_MIN_ROWS = 48  # AVX2: from here on MKL on the widened weight is as fast (measured)

# (x (M, K) fp32 contiguous, weight (N, K) int8, scale (N,), bias (N,) | None) -> (M, N)
Int8Matmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def check_int8_supported(device: torch.device, dtype: torch.dtype) -> None:
    """int8 runs on CPU in float32 only; say so before any weights are loaded."""
    if device.type != "cpu":
        raise ValueError(
            f"--quantization int8 runs on CPU only (its kernels are CPU kernels), not on "
            f"{device}; use --device cpu, or --quantization none"
        )
    if dtype != torch.float32:
        raise ValueError(f"--quantization int8 computes in float32; got --dtype {dtype}")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (N, K) int8 and (N,) fp32 scales, symmetric per output channel."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """A linear layer with an int8 weight (N, K), fp32 scales (N,) and an optional bias."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        matmul: Int8Matmul,
        dequant_min_rows: int = DEQUANT_MIN_ROWS,
    ) -> None:
        super().__init__()
        self.dequant_min_rows = dequant_min_rows
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.matmul = matmul

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        matmul: Int8Matmul | None = None,
        dequant_min_rows: int = DEQUANT_MIN_ROWS,
    ) -> Int8Linear:
        q, scale = quantize_weight(weight)
        return cls(q, scale, bias, matmul or int8_matmul(), dequant_min_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            out = self.forward(x.reshape(-1, self.in_features))
            return out.view(*x.shape[:-1], self.out_features)
        # (M, K): the model's flat batches; this path runs ~200 times per decode step, so it
        # is kept to the few tensor calls it needs
        if x.shape[0] >= self.dequant_min_rows:
            out = F.linear(x, self.weight.to(x.dtype)) * self.scale
            return out if self.bias is None else out + self.bias
        return self.matmul(x.contiguous(), self.weight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_model_int8(
    model: CausalLM,
    kernel_dir: Path | None = None,
    dequant_min_rows: int = DEQUANT_MIN_ROWS,
) -> None:
    """Replace every nn.Linear of `model` (in place) by an Int8Linear; a head tied to the
    embedding gets its own int8 copy (the lookup keeps the fp32 matrix)."""
    matmul = int8_matmul(kernel_dir)

    def int8(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        return Int8Linear.from_float(weight, bias, matmul, dequant_min_rows)

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, int8(child.weight, child.bias))
    if model.lm_head is None:
        model.lm_head = int8(model.embed_tokens.weight, None)


@functools.cache
def int8_matmul(kernel_dir: Path | None = None) -> Int8Matmul:
    """The int8 matmul for this machine, chosen once: the AVX2 kernel if it builds here
    (into `kernel_dir`), else torch's `_weight_int8pack_mm`."""
    library = load_kernel("int8_linear", kernel_dir)
    if library is None:
        logger.warning("int8 layers use torch's _weight_int8pack_mm (slower than fp32 on AVX2)")
        return torch_int8_matmul
    kernel = library.int8_linear
    kernel.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    kernel.restype = None

    def avx2_int8_matmul(x: torch.Tensor, weight, scale, bias) -> torch.Tensor:
        (m, k), n = x.shape, weight.shape[0]
        out = torch.empty(m, n, dtype=torch.float32)
        bias_ptr = None if bias is None else bias.data_ptr()
        ptrs = (x.data_ptr(), weight.data_ptr(), scale.data_ptr(), bias_ptr, out.data_ptr())
        with profiled("kernel:linear"):
            kernel(*ptrs, m, n, k, torch.get_num_threads())
        return out

    return avx2_int8_matmul


def torch_int8_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The fallback: torch's own kernel, the same arithmetic."""
    out = torch.ops.aten._weight_int8pack_mm(x, weight, scale)
    return out if bias is None else out + bias
