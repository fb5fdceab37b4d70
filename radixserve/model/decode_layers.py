"""A step's decoder layers in one C++ call (`decode_layers.cpp`).

On CPU a decode step of SmolLM2 calls ~300 kernels (30 layers of norms, six products,
rotary, the K/V write, attention, SiLU * up), each from Python through ctypes with a torch
allocation for its output: ~10 ms of a ~60 ms step at 16 running on an AMD EPYC Zen 4, ~8 of
~26 at one. `DecodeLayers` resolves, once per row count, the very kernel each of those calls
would reach (the same choice `Linear.forward`, `GatedMLP`, `RMSNorm` and the attention
backend make) into a table of function pointers and weights, and hands the whole stack to
one C++ loop that calls them in the same order on the same values: the hidden states are
bit for bit the Python model's. Decode steps, and steps of up to MAX_ROWS rows with new
tokens after cached prefixes (a mixed step's arriving requests beside its decode rows, an
extend batch) where the extend-attention kernel attends them: ~10 ms of Python a step
matters there too (a step of 15 decode rows and one arriving request's 32 tokens takes
~90 ms). Products the Python layers give to torch's F.linear itself (fp32, no bias, from
256 rows: MKL's rows on AVX2 CPUs) it gives to the sgemm F.linear calls, called as torch
calls it: a large mixed step's ~450 Python calls go too. A step whose last layer runs for
its logits rows alone (`LastRows`) runs it so here too, as the Python layers do. Steps it
does not take (larger prefills, which are compute-bound and whose MLP goes in chunks, rows
gathered by index, a layer whose product goes to oneDNN or to torch some other way, tensor
parallelism, sliding windows, K/V being loaded back, a pool of another dtype than the
model) run the Python model as before.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from radixserve.lora.state import DriverLora
from radixserve.model.cpu_kernels import (
    BlockedLinear,
    FusedOps,
    LinearKernel,
    function_address,
    load_kernel,
    profiled,
)
from radixserve.model.layers import MLP_CHUNK_ROWS

logger = logging.getLogger(__name__)

LAYER_FIELDS = 30  # decode_layers.cpp's Layer: 6 pointers, then 6 linear layers of 4 fields
STEP_FIELDS = 14  # decode_layers.cpp's Step
SEGMENT_FIELDS = 8  # decode_layers.cpp's Segment
CUT_FIELDS = 7  # decode_layers.cpp's Cut
# how a linear kernel is called (decode_layers.cpp); ACT_ROWS_KIND: as ROWS_KIND, the
# gate/up product's kernel with SiLU * up applied (out: the activation); TORCH_GEMM_KIND:
# torch's own BLAS sgemm, called as its F.linear calls it (`torch_sgemm_address`)
ROWS_KIND, ONE_ROW_KIND, ACT_ROWS_KIND, TORCH_GEMM_KIND = -1, -2, -3, -4
MAX_ROWS = MLP_CHUNK_ROWS  # past it the Python MLP goes a chunk of rows at a time
# the most rows of a step with LoRA adapters the driver takes: fused_ops.cpp's lora_add
# runs on the vector units (4 rows at a time), where torch's products in the Python layers
# reach AMX / oneDNN for large steps. Measured, one request's extend step under a rank-16
# adapter on every projection (SmolLM2, Intel Xeon with AMX, 2 threads), ms driver / Python
# layers: bf16 16.4 / 34.0 at 16 rows, 48.6 / 62.2 at 128, 83.6 / 91.8 at 256, 163 / 145 at
# 512; fp32 23.0 / 32.1 at 16, 101 / 101 at 128, 166 / 170 at 256, 344 / 341 at 512
LORA_MAX_ROWS = {torch.bfloat16: 256, torch.float32: 256}


class DecodeLayers:
    """The decoder stack of a Llama-family `model` (LlamaForCausalLM, Qwen2ForCausalLM,
    Qwen3ForCausalLM: its per-head q/k norms too) for decode steps and extend or mixed steps
    of up to MAX_ROWS rows, through `library` (decode_layers.cpp) and the kernels the model
    was given. `__call__` returns None for a step it does not take."""

    def __init__(self, library: ctypes.CDLL, model: torch.nn.Module, fused: FusedOps) -> None:
        self._run = library.decode_layers
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._run.argtypes = [p, p, i64, p, p, p, p, p, p, p, i64, p, p, f32, f32, p, p]
        self._run.restype = None
        self.model, self.fused = model, fused
        config = model.config
        attention = model.layers[0].self_attn
        self.hidden, self.eps = config.hidden_size, float(config.rms_norm_eps)
        self.heads, self.kv_heads = attention.num_heads, attention.num_kv_heads
        self.head_dim = attention.head_dim
        self.intermediate = model.layers[0].mlp.intermediate
        self.dtype = model.embed_tokens.weight.dtype
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.scratch_per_row = self.hidden + 2 * q_width + 2 * kv_width + 3 * self.intermediate
        # the scratch's stretches (each a multiple of these widths from a torch allocation)
        # start 64-byte aligned, as torch's own tensors do: MKL's sums may depend on it
        widths = (self.hidden, q_width, kv_width, self.intermediate)
        self._aligned = all(width * 4 % 64 == 0 for width in widths)  # (fp32's products alone)
        # (rows, threads, pool address, act_in_product, fp32 precision) → (step fields, layer
        # fields), or None where some product of that many rows does not go to a C kernel
        self._plans: dict[tuple, tuple[torch.Tensor, torch.Tensor] | None] = {}

    @staticmethod
    def takes(model: torch.nn.Module, fused: FusedOps | None) -> bool:
        """The model is one this driver runs: a Llama-family stack (q/k norms, if any,
        Llama's RMSNorm), one rank, SiLU MLPs, its element-wise ops fused (`fused`) for its
        dtype and widths."""
        from radixserve.model.layers import RMSNorm
        from radixserve.model.llama import LlamaForCausalLM

        if fused is None or not isinstance(model, LlamaForCausalLM):
            return False
        if model.qk_norm not in (None, RMSNorm):
            return False
        if model.tp.size != 1 or not len(model.layers):
            return False
        dtype = model.embed_tokens.weight.dtype
        probe = torch.empty(1, model.config.hidden_size, dtype=dtype, device="meta")
        layer = model.layers[0]
        norms_fused = model.qk_norm is None or all(
            layer.self_attn.q_norm.fused is fused and layer.self_attn.k_norm.fused is fused
            for layer in model.layers
        )
        return (
            all(layer.mlp.act is F.silu and layer.mlp.fused is fused for layer in model.layers)
            and norms_fused
            and fused.fits(probe)
            and fused.fits(probe.new_empty(1, 2 * layer.mlp.intermediate), widths=2)
            and fused.fits(probe.new_empty(1, layer.self_attn.head_dim), widths=2)
        )

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn,
        meta,
        last=None,
        lora: DriverLora | None = None,
    ) -> torch.Tensor | None:
        """x (M, hidden): the embeddings of a step's M tokens → the residual stream after
        the last layer (before the final norm), or None where this step is not one the
        driver takes (the caller runs the Python layers then). With `last` ((LastRows,
        their rotary tables)) the last layer runs past its K/V for those rows alone, as
        the Python layers do, and the result holds those rows. With `lora` (the step's
        adapters, `LoraState.driver_lora`; never with `last`) their products are added to
        each layer's as `LoraSite.add` adds them."""
        rows = x.shape[0]
        if rows > MAX_ROWS or x.dtype != self.dtype or not x.is_contiguous():
            return None
        if lora is not None and (
            last is not None
            or rows > LORA_MAX_ROWS.get(self.dtype, 0)
            or lora.fields.shape[0] != len(self.model.layers)
        ):
            return None
        view = getattr(attn, "driver_view", None)
        view = None if view is None else view(meta, self.dtype)
        if view is None:
            return None
        threads = torch.get_num_threads()
        plan = self._plan_for(rows, threads, view, act_in_product=lora is None)
        if plan is None:
            return None
        step, layers = plan
        segments = _segment_fields(view)
        cut, kept = None, rows
        if last is not None:
            cut = self._cut(last, attn, threads)
            if cut is None:
                return None
            kept = last[0].rows.numel()
        delta = torch.empty_like(x)
        scratch = torch.empty(rows * self.scratch_per_row, dtype=x.dtype)
        with profiled("kernel:decode_layers"):
            self._run(
                step.data_ptr(), layers.data_ptr(), len(self.model.layers), x.data_ptr(),
                delta.data_ptr(), cos.data_ptr(), sin.data_ptr(), view.slots.data_ptr(),
                view.table.data_ptr(), segments.data_ptr(), len(view.segments),
                None if cut is None else cut[0].data_ptr(), scratch.data_ptr(), self.eps,
                attn.scale, None if lora is None else lora.fields.data_ptr(),
                None if lora is None or lora.row_owner is None else lora.row_owner.data_ptr(),
            )  # fmt: skip
        return x[:kept] + delta[:kept]

    def _plan_for(
        self, rows: int, threads: int, view, act_in_product: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        # (torch's fp32 precision: where it turns to bf16 or tf32, F.linear leaves MKL)
        precision = torch.backends.mkldnn.matmul.fp32_precision
        key = (rows, threads, view.pool_k[0].data_ptr(), act_in_product, precision)
        if key not in self._plans:
            self._plans[key] = self._plan(rows, threads, view, act_in_product)
        return self._plans[key]

    def _cut(self, last, attn, threads: int) -> tuple[torch.Tensor, ...] | None:
        """decode_layers.cpp's Cut for `last` ((LastRows, rotary tables)) and the tensors
        it points into, or None where the narrowed last layer is not the driver's (its
        attention or some product of its rows goes elsewhere)."""
        rows, tables = last
        view = attn.driver_view(rows.meta, self.dtype)
        plan = None if view is None else self._plan_for(rows.rows.numel(), threads, view)
        if plan is None:
            return None
        layers = plan[1]
        segments = _segment_fields(view)
        indices = rows.rows.contiguous()
        cos, sin = tables.cos.contiguous(), tables.sin.contiguous()
        fields = [
            indices.data_ptr(), indices.numel(), cos.data_ptr(), sin.data_ptr(),
            layers[-1].data_ptr(), segments.data_ptr(), len(view.segments),
        ]  # fmt: skip
        assert len(fields) == CUT_FIELDS
        return torch.tensor(fields, dtype=torch.int64), layers, segments, indices, cos, sin, view

    def _plan(
        self, rows: int, threads: int, view, act_in_product: bool
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step and layer fields for steps of `rows` rows, or None where some product
        goes elsewhere than a C kernel. Without `act_in_product` (a step with adapters,
        whose products go onto gate/up's before SiLU * up), no gate/up kernel applies
        SiLU * up itself."""
        pool_k, pool_v = view.pool_k, view.pool_v
        layers = []
        probe = torch.empty(rows, self.hidden, dtype=self.dtype, device="meta")
        for index, layer in enumerate(self.model.layers):
            attention, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm = attention.q_norm, attention.k_norm
            row = [
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                pool_k[index].data_ptr(),
                pool_v[index].data_ptr(),
                0 if q_norm is None else q_norm.weight.data_ptr(),
                0 if k_norm is None else k_norm.weight.data_ptr(),
            ]
            for linear in (
                attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
                mlp.gate_up_proj, mlp.down_proj,
            ):  # fmt: skip
                fields = self._linear_fields(linear, rows, torch_gemm=act_in_product)
                if linear is mlp.gate_up_proj and act_in_product and mlp.act_in_product(probe):
                    fields = [linear.blocked.silu_mul_address, fields[1], 0, ACT_ROWS_KIND]
                if fields is None:
                    return None
                row.extend(fields)
            layers.append(row)
        ops = self.fused.pointers(self.dtype)
        step = [
            ops["rms_norm"], ops["add_rms_norm"], ops["rotary"], ops["silu_mul"], ops["lora_add"],
            rows, self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
            torch.empty(0, dtype=self.dtype).element_size(), threads, view.table.stride(0),
        ]  # fmt: skip
        assert len(step) == STEP_FIELDS and all(len(r) == LAYER_FIELDS for r in layers)
        return torch.tensor(step, dtype=torch.int64), torch.tensor(layers, dtype=torch.int64)

    def _linear_fields(self, linear, rows: int, torch_gemm: bool = True) -> list[int] | None:
        """(kernel, weight, bias, kind) of the C kernel `linear.forward` calls for `rows`
        rows, or None where it calls something else (oneDNN; torch but for F.linear's own
        sgemm where `torch_gemm`: not under adapters, whose Python MLP takes its gate/up
        product whole)."""
        from radixserve.model.layers import Linear

        if not isinstance(linear, Linear):
            return None
        x = torch.empty(rows, linear.in_features, dtype=self.dtype, device="meta")
        if linear.uses_blocked(x):
            blocked: BlockedLinear = linear.blocked
            bias = 0 if linear.blocked_bias is None else linear.blocked_bias.data_ptr()
            kind = ROWS_KIND if blocked.chunk is None else blocked.chunk
            return [blocked.address, linear.blocked_weight.data_ptr(), bias, kind]
        if linear.uses_coded_prefill(x) or (
            linear.packed_rows is not None and linear.packed_rows.covers(x)
        ):
            return None
        kernel = linear.kernels.pick(x)
        if kernel is None:
            return self._torch_gemm_fields(linear, rows) if torch_gemm else None
        if not isinstance(kernel, LinearKernel) or self.dtype != torch.float32:
            return None
        bias = 0 if linear.bias is None else linear.bias.data_ptr()
        kind = ROWS_KIND if kernel.takes_rows else ONE_ROW_KIND
        return [kernel.address, linear.weight.data_ptr(), bias, kind]

    def _torch_gemm_fields(self, linear, rows: int) -> list[int] | None:
        """(torch's sgemm, weight, 0, TORCH_GEMM_KIND) where the Python layers give
        `linear`'s product of `rows` rows to torch's F.linear itself (fp32 and no bias, whose
        sums on CPU are BLAS's sgemm's: the driver calls that sgemm as torch calls it, for
        the same bits), else None. From SMALL_BATCH_ROWS rows: below, the Python MLP takes
        its gate/up product transposed (GatedMLP._local), another order of the sums. The
        products of a large mixed step (AVX2 CPUs: past FP32_EXACT_ROWS_AVX2, MKL's rows):
        its ~450 Python calls (1-11% of an 870-row step's time on an AMD EPYC Zen 3) go."""
        from radixserve.model.layers import SMALL_BATCH_ROWS

        weight, address = linear.weight, torch_sgemm_address()
        if address is None or self.dtype != torch.float32 or rows < SMALL_BATCH_ROWS:
            return None
        if not self._aligned or torch.backends.mkldnn.matmul.fp32_precision not in IEEE_FP32:
            return None
        if linear.bias is not None or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        if not weight.is_contiguous() or weight.device.type != "cpu":
            return None
        return [address, weight.data_ptr(), 0, TORCH_GEMM_KIND]


# torch's settings of fp32 matrix products under which F.linear stays on BLAS's sgemm (the
# others send it to oneDNN in bf16 or tf32)
IEEE_FP32 = ("none", "ieee")


@functools.cache
def torch_sgemm_address() -> int | None:
    """The address of the BLAS sgemm (Fortran interface) inside torch's CPU library, which
    its fp32 matrix products call (MKL's, in the x86 wheels), or None where the library
    exports none, or where another sgemm loaded ahead of it (an LD_PRELOAD'ed BLAS) would
    take torch's own calls instead."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        library = ctypes.CDLL(str(path))
    except OSError:
        return None
    function = getattr(library, "sgemm_", None)
    if function is None:
        return None
    ahead = getattr(ctypes.CDLL(None), "sgemm_", None)  # the process's global symbols
    address = function_address(function)
    return None if ahead is not None and function_address(ahead) != address else address


def _segment_fields(view) -> torch.Tensor:
    """decode_layers.cpp's Segments of an attention backend's `driver_view`, in order."""
    fields = []
    for seg in view.segments:
        extend_lens = 0 if seg.extend_lens is None else seg.extend_lens.data_ptr()
        row = [seg.kind, seg.kernel, seg.start, len(seg.req_rows), seg.req_rows.data_ptr()]
        fields.append(row + [seg.lens.data_ptr(), extend_lens, seg.code])
    assert all(len(f) == SEGMENT_FIELDS for f in fields)
    return torch.tensor(fields, dtype=torch.int64)


@functools.cache
def decode_layers_library(folder: Path | None = None) -> ctypes.CDLL | None:
    """decode_layers.cpp built (it calls the other kernels through pointers: the AVX2 flags
    suffice for every build of theirs), or None where it cannot be."""
    return load_kernel("decode_layers", folder)
