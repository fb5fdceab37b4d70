"""What every model class shares: the embedding and LM head, checkpoint loading, the row
kernels, and what the attention backend needs to know per layer (scale, window).

A model runs on a flat batch: hidden states are (T, hidden) for all new tokens of all
requests; attention goes through the backend, which owns the KV pool.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from radixserve.lora.state import LoraSite, LoraState
from radixserve.model.attention import AttentionBackend
from radixserve.model.cpu_kernels import BlockedLinear, CodedLinear, CodedPrefill, Codes, FusedOps
from radixserve.model.layers import (
    EVERY_ROW,
    NO_ROW_KERNELS,
    GatedMLP,
    Linear,
    PackedRows,
    RMSNorm,
    RotaryEmbedding,
    RowKernels,
    VocabParallelEmbedding,
    logits_linear,
    pack_weight,
    product_shape,
)
from radixserve.model.loader import CheckpointTensor
from radixserve.model.parallel import SINGLE, TensorParallel


@dataclass(frozen=True)
class LastRows:
    """The rows a step's last decoder layer computes past its K/V: the step's logits rows
    (`rows`, increasing; ForwardBatch.logits_rows), at `positions`, attended with `meta`
    (the attention backend's metadata of that narrowed batch)."""

    rows: torch.Tensor  # (L,) int64, indices into the step's tokens
    positions: torch.Tensor  # (L,) int64
    meta: object


GATE_UP = ".mlp.gate_up_proj."  # the fused parameter, and the checkpoint's halves in order
GATE_UP_SHARDS = (".mlp.gate_proj.", ".mlp.up_proj.")
VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")  # split by vocabulary rows


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class CausalLM(nn.Module):
    """A decoder-only model in three parts the runner calls: `hidden_states` (the decoder
    stack over every new token, written by each subclass), the final `norm` on the rows it
    wants, and `compute_logits` on those that need logits; embeddings take the normed rows
    and never pay for the LM head. `forward` chains them for the rows whose logits are
    wanted."""

    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp  # tensor parallel: this rank's slice of the model (parallel.py)
        vocab, hidden = config.vocab_size, config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(vocab, hidden, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # None when tied: the logits use the embedding matrix (int8 quantization sets a head)
        self.lm_head: nn.Module | None = None
        if not self.tie_word_embeddings:
            self.lm_head = Linear(hidden, tp.vocab_rows(vocab), bias=False)
        self.row_kernels = NO_ROW_KERNELS  # see use_row_kernels
        self.lm_packed: torch.Tensor | None = None  # see pack_linears
        self.lm_packed_rows = EVERY_ROW
        self.lm_blocked: BlockedLinear | None = None  # see use_blocked_linears
        self.lm_blocked_rows: PackedRows | None = None
        # a step's decoder layers in one C++ call (decode_layers.py), where the model
        # class runs it (Llama-family); None: layer by layer in Python
        self.decode_layers: Callable[..., torch.Tensor | None] | None = None
        self.lora: LoraState | None = None  # see use_lora

    @classmethod
    def attention_span(cls, config: PretrainedConfig) -> int | None:
        """The most positions one position may attend to where the model has a limit it
        does not implement otherwise (a sliding window on every layer): the context is
        bounded to it. None: no such limit."""
        return None

    def use_lora(self, state: LoraState) -> None:
        """Serve LoRA adapters: every decoder layer's attention and MLP add the products
        of the adapters `state` says the step's rows use."""
        for i, layer in enumerate(self.layers):
            layer.self_attn.lora = layer.mlp.lora = LoraSite(state, i)
        self.lora = state

    @property
    def lora_active(self) -> bool:
        """The step in flight has rows that use an adapter."""
        return self.lora is not None and self.lora.active

    @property
    def attention_scale(self) -> float:
        """The factor on q·k before the softmax."""
        return head_dim_of(self.config) ** -0.5

    @property
    def attention_windows(self) -> list[int]:
        """Per layer, the sliding window W (a query at position p attends the keys at
        positions p - W < s <= p), or 0 where the layer attends every earlier key."""
        return [0] * self.config.num_hidden_layers

    norm: nn.Module  # the final norm, built by the subclass

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        logits_indices: torch.Tensor,  # (L,)
        attn: AttentionBackend,
        meta: object,
    ) -> torch.Tensor:  # (L, vocab) fp32
        x = self.hidden_states(input_ids, positions, attn, meta)
        return self.compute_logits(self.norm(x[logits_indices]))  # only the rows wanted

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        attn: AttentionBackend,
        meta: object,
        last: LastRows | None = None,
    ) -> torch.Tensor:  # (T, hidden), before the final norm; with `last` (L, hidden)
        """The residual stream after the last layer: of every row, or with `last` of its
        rows alone, in order (a model may then skip the last layer's other rows)."""
        raise NotImplementedError

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (L, hidden), already normed → (L, vocab) fp32."""
        return self.lm_logits(x).float()

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (L, hidden), already normed → (L, vocab) in x's dtype (under tensor
        parallelism on rank 0; the other ranks get their vocabulary slice)."""
        rows = self.lm_blocked_rows
        if self.lm_head is None and rows is not None and rows.covers(x):
            weight = self.lm_blocked_weight
            local = self.lm_blocked(x, weight, self.embed_tokens.weight.shape[0], None)
        elif self.lm_head is None:
            packed = self.lm_packed if self.lm_packed_rows.covers(x) else None
            local = logits_linear(x, self.embed_tokens.weight, self.row_kernels, packed)
        elif isinstance(self.lm_head, Linear) and self.lm_head.uses_packed(x):
            local = self.lm_head(x)
        elif isinstance(self.lm_head, nn.Linear) and self.lm_head.bias is None:
            local = logits_linear(x, self.lm_head.weight, self.row_kernels)
        else:
            local = self.lm_head(x)
        return self.tp.gather_vocab(local, self.config.vocab_size)

    def use_row_kernels(self, kernels: RowKernels) -> None:
        """Send one row / a few rows (decode steps) of every linear layer and the LM head to
        the project's kernels."""
        self.row_kernels = kernels
        for module in self.modules():
            if isinstance(module, Linear):
                module.kernels = kernels

    def use_fused_ops(self, ops: FusedOps) -> None:
        """RMSNorms, rotary embeddings and SiLU gated MLPs through `fused_ops.cpp` (Gemma's
        norms and GELU keep their torch ops). SiLU's e^x there is torch's own (SLEEF's
        expf_u10, simd_avx512.h): fp32 SiLU * up is torch's bit for bit (an e^x of our own,
        off by an ulp here and there, had moved SmolLM2's fp32 logits to 1.001e-4 from
        transformers' in one fidelity test, over the 1e-4 bar)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding)):
                module.fused = ops
            elif isinstance(module, GatedMLP) and module.act is F.silu:
                module.fused = ops

    def linear_units(self) -> list[tuple[Linear, ...]]:
        """Every `Linear`, with those the forward gives one input together (a module's
        `shared_input_linears`: an attention's q, k and v; see `shared_input_products`) as one
        unit, each other alone (an int8 model's layers are no `Linear`s: none)."""
        units, grouped = [], set()
        for module in self.modules():
            unit = getattr(module, "shared_input_linears", tuple)()
            if unit and all(isinstance(m, Linear) for m in unit):
                units.append(tuple(unit))
                grouped.update(unit)
            elif isinstance(module, Linear) and module not in grouped:
                units.append((module,))
        return units

    def use_blocked_linears(
        self,
        kernel: BlockedLinear,
        rows: PackedRows,
        exact_rows: PackedRows | None = None,
        coded: tuple[CodedLinear, ...] = (),
    ) -> dict[Linear, Codes | None]:
        """Products of `rows` rows in every linear layer and the LM head through a kernel
        that reads its own layout of the weights (`bf16_linear_amx.cpp`,
        `fp32_linear.cpp`), each weight copied once into it; a tied head gets a copy
        of the embedding matrix. With `exact_rows`, a weight whose products the kernel gives
        bit for bit as torch's F.linear (`BlockedLinear.same_as_torch`) takes those rows
        instead. With `coded` (fp32), a weight that is low-bit codes in disguise goes to the
        first of those kernels that reads it as its codes, for the same rows (`CodedLinear`:
        the blocked kernel's bits from a fraction of the bytes). Before `pack_linears`.
        Returns each linear layer's codes where it is such codes (for
        `use_coded_prefill_linears`), else None."""

        def rows_for(weight: torch.Tensor) -> PackedRows:
            return exact_rows if exact_rows and kernel.same_as_torch(weight) else rows

        def as_codes(
            weight: torch.Tensor,
        ) -> tuple[BlockedLinear, torch.Tensor | None, Codes | None]:
            for form in coded:
                found = form.find(weight)
                if found is not None:
                    return form, form.pack(weight, found), found
            return kernel, None, None

        found: dict[Linear, Codes | None] = {}
        for module in self.modules():
            if isinstance(module, Linear):
                reader, codes, found[module] = as_codes(module.weight)
                module.use_blocked(reader, rows_for(module.weight), codes)
        if self.lm_head is None and kernel.fits(self.embed_tokens.weight):
            reader, codes, _ = as_codes(self.embed_tokens.weight)
            packed = codes if codes is not None else kernel.pack(self.embed_tokens.weight)
            self.register_buffer("lm_blocked_weight", packed, persistent=False)
            self.lm_blocked = reader
            self.lm_blocked_rows = rows_for(self.embed_tokens.weight)
        return found

    def use_coded_prefill_linears(
        self,
        kernel: CodedPrefill,
        rows: PackedRows,
        found: Mapping[Linear, Codes | None],
        shapes: Collection[tuple[int, int]] | None = None,
    ) -> int:
        """Products of `rows` rows of the linear layers whose weights are codes through
        `kernel` on those codes (`Linear.use_coded_prefill`: AMX's tiles or tables of subset
        sums; ahead of the blocked kernel's rows), where their unit's product shape (N, K) is
        in `shapes` (None: any; see `linear_units`). `found`: the codes `use_blocked_linears`
        found (the kernel looks for those of the others). Returns how many layers took it."""
        taken = 0
        for unit in self.linear_units():
            if shapes is None or product_shape(unit) in shapes:
                for module in unit:
                    taken += module.use_coded_prefill(kernel, rows, found.get(module))
        return taken

    def pack_linears(self, rows: PackedRows = EVERY_ROW) -> None:
        """Products of `rows` rows in every linear layer and the LM head with the weight in
        oneDNN's blocked layout (the kernel plan's `packed_rows`); a tied head gets its own
        packed copy of the embedding matrix, which the lookup keeps plain."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(rows)
        if self.lm_head is None:
            self.lm_packed = pack_weight(self.embed_tokens.weight)
            self.lm_packed_rows = rows

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) in; every parameter must be covered.
        A checkpoint's gate_proj / up_proj fill the halves of the fused gate_up_proj. Under
        tensor parallelism only this rank's slice of each tensor is read (`_rank_slice`)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, source in weights:
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, part = name, slice(None)
            for half, shard in enumerate(GATE_UP_SHARDS):
                if shard in name:
                    target = name.replace(shard, GATE_UP)
                    rows = params[target].shape[0] // 2 if target in params else 0
                    part = slice(half * rows, (half + 1) * rows)
            if target not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no place in the model")
            tensor = self._rank_slice(name, source)
            param = params[target].data
            if name in VOCAB_PARAMS:  # this rank's vocabulary rows; the tail stays zero
                param.zero_()
                part = slice(0, tensor.shape[0])
            param = param[part]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(param.shape)}"
                )
            param.copy_(tensor)
            loaded.add(name)
        expected = {
            p.replace(GATE_UP, shard) if GATE_UP in p else p
            for p in params
            for shard in GATE_UP_SHARDS
        }
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:4]}")

    def _rank_slice(self, name: str, source: CheckpointTensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name`, read from the file: rows (dim 0)
        of the column-parallel projections (q/k/v by heads, gate/up by columns) and of the
        vocabulary, columns (dim 1) of the row-parallel ones (o_proj, down_proj); the rest
        (and everything without tensor parallelism) whole."""
        span = self._rank_span(name)
        if span is None:
            return source.read()
        dim, first, count = span
        return source.read(dim, first, first + count)

    def _rank_span(self, name: str) -> tuple[int, int, int] | None:
        """(dim, first, count) of this rank's part of the checkpoint tensor `name`, or None
        where the rank holds it whole."""
        tp, config = self.tp, self.config
        if tp.size == 1:
            return None
        if name in VOCAB_PARAMS:
            rows = tp.vocab_rows(config.vocab_size)
            first = tp.rank * rows
            return 0, first, max(min(rows, config.vocab_size - first), 0)
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        head_dim = head_dim_of(config)
        if module in ("q_proj", "o_proj"):
            heads = tp.split(config.num_attention_heads, "attention heads")
            return int(module == "o_proj"), tp.rank * heads * head_dim, heads * head_dim
        if module in ("k_proj", "v_proj"):
            kv_heads, first_kv = tp.kv_heads(config.num_key_value_heads)
            return 0, first_kv * head_dim, kv_heads * head_dim
        if module in ("gate_proj", "up_proj", "down_proj"):
            columns = tp.split(config.intermediate_size, "MLP columns")
            return int(module == "down_proj"), tp.rank * columns, columns
        return None
