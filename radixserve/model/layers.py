"""Layers shared by the model classes: RMSNorm, rotary embedding, gated MLP.

Arithmetic follows transformers' reference implementation step for step (same order of
operations, fp32 where it computes in fp32) so outputs match it to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from radixserve.lora.state import LoraSite
from radixserve.model.cpu_kernels import BlockedLinear, CodedPart, CodedPrefill, Codes, FusedOps
from radixserve.model.parallel import SINGLE, TensorParallel

SMALL_BATCH_ROWS = 256  # below this many rows, the transposed product wins on CPU
# A CPU prefill's MLP runs this many rows at a time (see GatedMLP.forward)
MLP_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class RowKernels:
    """The project's CPU linear kernels the model uses, from the kernel plan: `gemv` for one
    row (`fp32_gemv.cpp`: a batch-1 decode step), `few` for 2..few_max_rows rows
    (`fp32_gemm_small.cpp`: small decode batches). Each is (x, weight, bias) -> x @ weight.T."""

    gemv: Callable[..., torch.Tensor] | None = None
    few: Callable[..., torch.Tensor] | None = None
    few_max_rows: int = 0

    def pick(self, x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """The kernel for x's rows, or None (torch's matmul)."""
        if x.dim() != 2:
            return None
        rows = x.shape[0]
        if rows == 1:
            return self.gemv
        return self.few if rows <= self.few_max_rows else None


NO_ROW_KERNELS = RowKernels()


@dataclass(frozen=True)
class PackedRows:
    """The products that go to `packed_linear`: those of first..last rows (the kernel plan's
    `packed_rows`)."""

    first: int = 1
    last: int | None = None  # None: no upper bound

    @property
    def every(self) -> bool:
        return self.first <= 1 and self.last is None

    def covers(self, x: torch.Tensor) -> bool:
        rows = x.shape[0]
        return rows >= self.first and (self.last is None or rows <= self.last)


EVERY_ROW = PackedRows()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of weight (N, K) in oneDNN's blocked layout for `packed_linear` (an opaque
    tensor of the same shape and dtype)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (M, K) @ weight.T + bias through oneDNN with the weight already in its blocked
    layout: a plain bf16 F.linear re-blocks the weight on every call. Bit-identical to
    F.linear in bf16 (both oneDNN, fp32 accumulation); in fp32 equal to MKL's F.linear up to
    the order of the sums. Measured figures: `radixserve.hardware.PACKED_LINEAR`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear that hands one row, or a few, to the project's kernels when the model was
    given them (`RowKernels`): on CPU in float32 they stream the weights faster than MKL's
    sgemv / sgemm do at those sizes, which is what decode steps are made of. After
    `use_blocked(kernel, rows)` products of those rows go to a kernel that reads its own
    copy of the weight (`BlockedLinear`); after `use_coded_prefill(kernel, rows)` products of
    those rows go to a kernel on the weight's codes (`CodedPrefill`: AMX's tiles or tables of
    subset sums) instead, where the blocked kernel's rows take them too (on a CPU where its
    sums are torch's it takes every row count: AMD's Zen 4); after `pack(rows)` products of
    those rows go to `packed_linear` with a copy of the weight in oneDNN's blocked layout."""

    kernels: RowKernels = NO_ROW_KERNELS
    packed_weight: torch.Tensor | None = None
    packed_rows: PackedRows | None = None
    blocked: BlockedLinear | None = None  # see use_blocked
    blocked_rows: PackedRows | None = None
    blocked_bias: torch.Tensor | None = None
    coded_prefill: CodedPrefill | None = None  # see use_coded_prefill
    coded_prefill_rows: PackedRows | None = None
    coded_prefill_min = False

    def use_blocked(
        self, kernel: BlockedLinear, rows: PackedRows, packed: torch.Tensor | None = None
    ) -> None:
        """Products of `rows` rows through `kernel`, with a copy of the weight in its layout
        (a buffer: the model's bytes count it; `packed` where the caller has made it); a
        weight whose shape or dtype the kernel does not take is left alone. Before `pack`,
        which may drop the plain weight."""
        if packed is None:
            if not kernel.fits(self.weight):
                return
            packed = kernel.pack(self.weight)
        self.register_buffer("blocked_weight", packed, persistent=False)
        self.blocked, self.blocked_rows = kernel, rows
        self.blocked_bias = None if self.bias is None else self.bias.detach().float()

    def use_coded_prefill(
        self, kernel: CodedPrefill, rows: PackedRows, found: Codes | None = None
    ) -> bool:
        """Products of `rows` rows through `kernel` on the weight's codes, where the weight
        is codes in disguise that it takes (`kernel.pack`, given `found` where they were
        found already; else False, nothing changed)."""
        packed = kernel.pack(self.weight, found)
        if packed is None:
            return False
        codes, scales, self.coded_prefill_min = packed
        self.register_buffer("coded_prefill_codes", codes, persistent=False)
        self.register_buffer("coded_prefill_scales", scales, persistent=False)
        self.coded_prefill, self.coded_prefill_rows = kernel, rows
        self.blocked_bias = None if self.bias is None else self.bias.detach().float()
        return True

    def coded_prefill_part(self) -> CodedPart:
        """What the coded-prefill kernel takes after x: (codes, scales, N, bias, has_min)."""
        return (
            self.coded_prefill_codes,
            self.coded_prefill_scales,
            self.out_features,
            self.blocked_bias,
            self.coded_prefill_min,
        )

    def uses_coded_prefill(self, x: torch.Tensor) -> bool:
        rows = self.coded_prefill_rows
        return rows is not None and x.dim() == 2 and rows.covers(x)

    def pack(self, rows: PackedRows) -> None:
        """Keep a oneDNN-blocked copy of the weight for products of `rows` rows; for every
        row count it replaces the plain weight, which nothing reads then."""
        packed = pack_weight(self.weight)
        if rows.every:
            self.weight = nn.Parameter(packed, requires_grad=False)  # an alias, no copy
        self.packed_weight, self.packed_rows = packed, rows

    def uses_blocked(self, x: torch.Tensor) -> bool:
        """x's product goes to the blocked kernel: its rows, and not the coded-prefill
        kernel's, which come first where both take them."""
        if self.blocked_rows is None or x.dim() != 2 or not self.blocked_rows.covers(x):
            return False
        return not self.uses_coded_prefill(x)

    def uses_packed(self, x: torch.Tensor) -> bool:
        """A product of x's rows reads a weight laid out at load (the blocked kernel's or
        oneDNN's)."""
        if self.uses_blocked(x) or self.uses_coded_prefill(x):
            return True
        return self.packed_rows is not None and self.packed_rows.covers(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_blocked(x):
            return self.blocked(x, self.blocked_weight, self.out_features, self.blocked_bias)
        if self.uses_coded_prefill(x):
            return self.coded_prefill(x, *self.coded_prefill_part())
        if self.packed_rows is not None and self.packed_rows.covers(x):
            return packed_linear(x, self.packed_weight, self.bias)
        kernel = self.kernels.pick(x)
        if kernel is not None:
            return kernel(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def product_shape(linears: Sequence[Linear]) -> tuple[int, int]:
    """(N, K) of linear layers of one input as one product (`shared_input_products`)."""
    return sum(linear.out_features for linear in linears), linears[0].in_features


def shared_input_products(linears: Sequence[Linear], x: torch.Tensor) -> list[torch.Tensor]:
    """Each linear layer's product of the same x: in one call where they all take x's rows
    through one kernel that computes several products of one input (the lookup kernel builds
    x's tables once for all), else one by one."""
    kernel = getattr(linears[0], "coded_prefill", None)  # None for other modules (int8)
    together = getattr(kernel, "products", None)
    if together is None or not all(
        isinstance(linear, Linear)
        and linear.coded_prefill is kernel
        and linear.uses_coded_prefill(x)
        for linear in linears
    ):
        return [linear(x) for linear in linears]
    return together(x, [linear.coded_prefill_part() for linear in linears])


LOGITS_CHUNK = 2048  # vocabulary rows per product: 4.7 MB of fp32 weights, stays in L2/L3


def logits_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    kernels: RowKernels = NO_ROW_KERNELS,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (M, hidden) @ weight (vocab, hidden).T, the LM head. With `packed` (the weight in
    oneDNN's layout) it goes to `packed_linear`. On CPU with several rows it is
    computed in vocabulary chunks, each (chunk @ x.T) into a (vocab, M) buffer: measured
    1.5x (64 rows) to 2x (16 rows) faster than one F.linear over the 49k-row matrix of
    SmolLM2, and alike at one row. One row or a few go to the row kernels when set."""
    if packed is not None:
        return packed_linear(x, packed)
    kernel = kernels.pick(x)
    if kernel is not None:
        return kernel(x, weight, None)
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] == 1:
        return F.linear(x, weight)
    out = x.new_empty(weight.shape[0], x.shape[0])
    xt = x.t()
    for start in range(0, weight.shape[0], LOGITS_CHUNK):
        torch.mm(weight[start : start + LOGITS_CHUNK], xt, out=out[start : start + LOGITS_CHUNK])
    return out.t().contiguous()


class VocabParallelEmbedding(nn.Module):
    """The token embedding; under tensor parallelism each rank holds `tp.vocab_rows` rows
    of the vocabulary (its slice, zero past the end), looks up the ids that fall in it, and
    the ranks' rows are summed (exactly: all but one are zero)."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp, self.vocab = tp, vocab
        rows = tp.vocab_rows(vocab)
        self.first = tp.rank * rows  # this rank's first token id
        self.weight = nn.Parameter(torch.empty(rows, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))


class RMSNorm(nn.Module):
    """Llama's RMSNorm; with `fused` (the kernel plan's fused ops) bf16 and fp32 rows go to
    one C++ pass (`fused_ops.cpp`) that rounds where these torch ops do."""

    fused: FusedOps | None = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and self.fused.fits(x, self.weight):
            return self.fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, the norm of that sum): a residual add and the norm after it, in one
        pass where the fused ops take them; the same values as the two steps."""
        if self.fused is not None and self.fused.fits(x, delta, self.weight):
            return self.fused.add_rms_norm(x, delta, self.weight, self.eps)
        total = x + delta
        return total, self(total)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x * (1 + weight), all in fp32, then back to x's dtype (the checkpoint
    stores weight - 1; llama.cpp's GGUF stores 1 + weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


def rope_inv_freq(
    config: PretrainedConfig, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for the config's RoPE type; with
    `layer_type` ("sliding_attention", "full_attention": Gemma 3), that kind of layer's
    entry of `rope_parameters`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None:
        params = dict(params.get(layer_type) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' is not supported (it depends on the sequence length)")
    # Scaled variants (linear, llama3, yarn, ...): transformers owns their definitions.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}")
    extra = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **extra)
    return inv_freq.float(), float(scale)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the context length, indexed per token
    (`layer_type`: the RoPE of that kind of layer, see `rope_inv_freq`); `fused`: the
    tables it hands out rotate bf16 q/k in one C++ pass."""

    fused: FusedOps | None = None

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        max_positions: int,
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        self.config, self.head_dim, self.max_positions = config, head_dim, max_positions
        self.layer_type = layer_type
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the tables, e.g. after the module was created on the meta device."""
        if self.cos.is_meta:
            return
        inv_freq, scale = rope_inv_freq(self.config, self.head_dim, self.layer_type)
        freqs = torch.arange(self.max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1).double()  # (P, D)
        # cos and sin of the fp32 angles in fp64, rounded to fp32: the fp32 values correctly
        # rounded. torch's fp32 cos over this (P, D) table came out ~11 bits accurate in one
        # thread's half of it in some processes (the first runner a test process built, on
        # an Intel Xeon with AMX: cos(1) 0.5403335 for 0.5403023), so that two runners of
        # one model disagreed by 1.3e-3 in a tiny model's logits
        self.cos.copy_(emb.cos().float() * scale)
        self.sin.copy_(emb.sin().float() * scale)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        """cos/sin rows for the batch's positions (T,), looked up once per forward pass."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # (T, 1, D)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return RotaryTables(cos, sin, self.fused)


@dataclass
class RotaryTables:
    cos: torch.Tensor  # (T, 1, D)
    sin: torch.Tensor  # (T, 1, D)
    fused: FusedOps | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (T, H, D), k (T, KH, D) rotated by their positions (in place when fused)."""
        cos, sin = self.cos, self.sin
        if self.fused is not None and self.fused.fits(q, k, cos, sin, widths=2):
            return self.fused.rotary_(q, k, cos, sin)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def apply_one(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, heads, D), q or k alone, rotated as `apply` rotates it."""
        return self.apply(x, x.new_empty(x.shape[0], 0, x.shape[2]))[0]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up as one (2 * intermediate, hidden) weight.

    On CPU with 2..255 rows (decode batches) the gate/up product is computed transposed,
    W @ x.T → (2I, M): MKL's kernel for that operand order measured 1.1-2x faster at 8-128
    rows, its two halves are contiguous (the activation runs on plain blocks), and the down
    projection takes the (M, I) view of the transposed product as is. Bit-identical to two
    separate transposed products, ~8% faster than them with their copies back (batch 16-64).
    Prefill rows (256 and up) take two F.linear products on the weight's halves (one over
    the fused weight, then strided halves, measured 5% slower prefill). Elsewhere (one row,
    CUDA, an int8 layer, a packed weight): one product and its halves, or where the AMX
    kernel takes the rows, one product that comes out as the activation (`act_in_product`).
    The transposed order is kept to gate/up: on every projection it moved SmolLM2's batch-8
    decode logits 1.1e-4 from transformers' (over the 1e-4 fidelity bar; 5.9e-5 like this).
    With `lora` set and a step's adapters in flight, their products are added to gate/up's
    and down's (one plain product each, whole).
    """

    lora: LoraSite | None = None

    def __init__(self, hidden: int, intermediate: int, act: str, tp: TensorParallel = SINGLE):
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(
                f"activation {act!r} is not supported; supported: silu, gelu_pytorch_tanh"
            )
        # tensor parallel: this rank's columns of gate and up, rows of down (then summed)
        self.tp = tp
        self.intermediate = intermediate = tp.split(intermediate, "MLP columns")
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.act = F.silu if act == "silu" else lambda x: F.gelu(x, approximate="tanh")
        self.fused: FusedOps | None = None  # silu(gate) * up in one pass (silu only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None and self.lora.active:
            return self.tp.all_reduce(self._with_lora(x, self.lora))
        if self._in_chunks(x):
            return self.tp.all_reduce(torch.cat([self._local(p) for p in x.split(MLP_CHUNK_ROWS)]))
        return self.tp.all_reduce(self._local(x))

    def _in_chunks(self, x: torch.Tensor) -> bool:
        """A CPU prefill of more than MLP_CHUNK_ROWS rows goes MLP_CHUNK_ROWS at a time
        where that leaves the sums as they are. Whole, its gate/up output (2I wide) grows
        past 32 MB (SmolLM2 fp32: 100 MB at 8,160 rows), which glibc's malloc maps afresh
        for every layer (hardware.MALLOC), page faults and all, and act * up streams it
        through memory twice. Only where both products
        go through the blocked kernel at every row count (fp32 where it reproduces
        F.linear), whose order of the sums does not depend on the rows: the chunks' outputs
        are the whole product's bits. SmolLM2 fp32 on an AMD EPYC Zen 4 (2 threads), a
        prefill of 15 x 544 tokens: 641 -> 716-748 tok/s (act * up 0.91 -> 0.35 s of it).
        Not for bf16 through oneDNN: 1331 -> 1280 tok/s there."""
        if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] <= MLP_CHUNK_ROWS:
            return False
        layers = (self.gate_up_proj, self.down_proj)
        return all(
            isinstance(layer, Linear)
            and layer.blocked_rows is not None
            and layer.blocked_rows.every
            for layer in layers
        )

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, half = self.gate_up_proj, self.intermediate
        cpu_rows = isinstance(gate_up, nn.Linear) and x.device.type == "cpu" and x.dim() == 2
        cpu_rows = cpu_rows and not (isinstance(gate_up, Linear) and gate_up.uses_packed(x))
        cpu_rows = cpu_rows and getattr(gate_up, "kernels", NO_ROW_KERNELS).pick(x) is None
        if cpu_rows and 1 < x.shape[0] < SMALL_BATCH_ROWS:
            h = gate_up.weight @ x.t()  # (2I, M)
            return self.down_proj(self._act_mul(h[:half], h[half:]).t())
        if cpu_rows and x.shape[0] > 1:  # prefill: two products on the weight's halves
            weight = gate_up.weight
            return self.down_proj(
                self._act_mul(F.linear(x, weight[:half]), F.linear(x, weight[half:]))
            )
        if self.act_in_product(x):
            return self.down_proj(gate_up.blocked.silu_mul(x, gate_up.blocked_weight, half))
        h = gate_up(x)
        if self.fused is not None and h.dim() == 2 and self.fused.fits(h, widths=2):
            return self.down_proj(self.fused.silu_mul(h))
        return self.down_proj(self.act(h[..., :half]) * h[..., half:])

    def _with_lora(self, x: torch.Tensor, lora: LoraSite) -> torch.Tensor:
        h, half = self.gate_up_proj(x), self.intermediate
        gate, up = h[..., :half], h[..., half:]
        lora.add("gate_up", x, [gate, up])
        if self.fused is not None and h.dim() == 2 and self.fused.fits(h, widths=2):
            act = self.fused.silu_mul(h)  # one pass, as `_local` takes it
        else:
            act = self.act(gate) * up
        out = self.down_proj(act)
        lora.add("down", act, [out])
        return out

    def act_in_product(self, x: torch.Tensor) -> bool:
        """The gate/up product of x's rows goes to a blocked kernel that applies SiLU * up
        in its epilogue (bf16_linear_amx.cpp): the same bits as the product and then
        FusedOps.silu_mul, without the 2I-wide product written out and read back."""
        gate_up = self.gate_up_proj
        return (
            self.act is F.silu
            and isinstance(gate_up, Linear)
            and gate_up.bias is None
            and gate_up.uses_blocked(x)
            and gate_up.blocked.silu_mul_address is not None
        )

    def _act_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up for two contiguous tensors of one shape: in one pass over them as
        flat rows where the fused op takes them."""
        flat_gate, flat_up = gate.view(1, -1), up.view(1, -1)
        if self.fused is not None and self.fused.fits(flat_gate, flat_up):
            return self.fused.silu_mul_halves(flat_gate, flat_up).view(gate.shape)
        return self.act(gate) * up
