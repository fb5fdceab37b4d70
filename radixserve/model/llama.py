"""Llama-family decoders: LlamaForCausalLM, MistralForCausalLM (Llama's layers; its sliding
window bounds the context), Qwen2ForCausalLM (adds QKV biases) and Qwen3ForCausalLM (adds
per-head q/k RMS norms before the rotary embedding).

The model runs on a flat batch: hidden states are (T, hidden) for all new tokens of all
requests; attention goes through the backend, which owns the KV pool.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from radixserve.lora.state import LoraSite
from radixserve.model.attention import AttentionBackend
from radixserve.model.base import CausalLM, LastRows, head_dim_of
from radixserve.model.layers import (
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    RotaryTables,
    shared_input_products,
)
from radixserve.model.parallel import SINGLE, TensorParallel

__all__ = [
    "LlamaAttention",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "head_dim_of",
]

NormClass = type[nn.Module]  # RMSNorm, GemmaRMSNorm: (dim, eps) → module


class LlamaAttention(nn.Module):
    """q/k/v projections, optional per-head q/k norms (`qk_norm`: the norm class, applied
    over head_dim before the rotary embedding), rotary, the backend's attention, o_proj;
    with `lora` set (LoRA serving), the step's adapters' products added to the projections'."""

    lora: LoraSite | None = None

    def __init__(
        self,
        config: PretrainedConfig,
        layer: int,
        qkv_bias: bool,
        qk_norm: NormClass | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.layer = layer
        # tensor parallel: this rank's query heads and KV heads, o_proj's matching columns
        self.tp = tp
        self.num_heads = tp.split(config.num_attention_heads, "attention heads")
        self.num_kv_heads, _ = tp.kv_heads(config.num_key_value_heads)
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Separate projections: on CPU the fused QKV matmul measured no faster, and its
        # strided q/k/v views made the rotary element-wise ops slower.
        self.q_proj = Linear(config.hidden_size, q_size, bias=qkv_bias)
        self.k_proj = Linear(config.hidden_size, kv_size, bias=qkv_bias)
        self.v_proj = Linear(config.hidden_size, kv_size, bias=qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps)

    def shared_input_linears(self) -> tuple[Linear, ...]:
        """The linear layers whose products of one input `forward` computes together."""
        return self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        rotary: RotaryTables,
        attn: AttentionBackend,
        meta: object,
        last: tuple[LastRows, RotaryTables] | None = None,
    ) -> torch.Tensor:  # (T, hidden); with `last`, of its rows alone
        """With `last` (the last layer), every row's K/V and only `last`'s rows' queries:
        all K/V go to the pool, then those rows attend as the narrowed batch's."""
        lora = self.lora if self.lora is not None and self.lora.active else None
        if last is None:
            q, k, v = shared_input_products(self.shared_input_linears(), x)
            if lora is not None:
                lora.add("qkv", x, [q, k, v])
        else:
            assert lora is None, "a step with LoRA rows runs every row of the last layer"
            q, k, v = self.q_proj(x[last[0].rows]), self.k_proj(x), self.v_proj(x)
        q = q.view(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, KH, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if last is None:
            q, k = rotary.apply(q, k)
            out = attn.forward(self.layer, q, k, v, meta)
            if lora is None:
                return self.tp.all_reduce(self.o_proj(out))
            out = out.reshape(out.shape[0], -1)
            projected = self.o_proj(out)
            lora.add("o", out, [projected])
            return self.tp.all_reduce(projected)
        rows, tables = last
        k, q = rotary.apply_one(k), tables.apply_one(q)
        attn.write(self.layer, k, v, meta)  # every row's; the rows' again below, alike
        out = attn.forward(self.layer, q, k[rows.rows], v[rows.rows], rows.meta)
        return self.tp.all_reduce(self.o_proj(out))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer: int,
        qkv_bias: bool,
        qk_norm: NormClass | None,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(config, layer, qkv_bias, qk_norm, tp)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act, tp)

    def forward(self, x, delta, rotary, attn, meta, last=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream arrives as x + delta (delta None in the first layer) and
        leaves the same way: each residual add is done with the norm after it (one pass
        with the fused ops), the last one by the caller. With `last` ((LastRows, their
        rotary tables): the last layer) it leaves for those rows alone."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_forward(x, delta)
        attended = self.self_attn(h, rotary, attn, meta, last)
        if last is not None:
            x = x[last[0].rows]
        x, h = self.post_attention_layernorm.add_forward(x, attended)
        return x, self.mlp(h)


class LlamaForCausalLM(CausalLM):
    qkv_bias = False
    qk_norm: NormClass | None = None

    def __init__(
        self, config: PretrainedConfig, max_positions: int, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, tp)
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.qkv_bias, self.qk_norm, tp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        attn: AttentionBackend,
        meta: object,
        last: LastRows | None = None,
    ) -> torch.Tensor:  # (T, hidden), before the final norm; with `last` (L, hidden)
        x, delta = self.embed_tokens(input_ids), None
        rotary = self.rotary.tables(positions, x.dtype)
        narrowed = None if last is None else (last, self.rotary.tables(last.positions, x.dtype))
        if self.decode_layers is not None:  # one C++ call
            lora = self.lora.driver_lora(len(self.layers)) if self.lora_active else None
            out = self.decode_layers(x, rotary.cos, rotary.sin, attn, meta, narrowed, lora)
            if out is not None:
                return out
        final = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, delta, rotary, attn, meta, narrowed if i == final else None)
        return x if delta is None else x + delta


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layers. A sliding window shorter than the context (Mistral 7B
    v0.1's 4096 of 32768) is served by bounding the context to it (`attention_span`):
    every position then sees all the positions its window holds."""

    @classmethod
    def attention_span(cls, config: PretrainedConfig) -> int | None:
        window = getattr(config, "sliding_window", None)
        if window is not None and not isinstance(window, int):  # (one per layer: not served)
            raise ValueError(f"sliding_window {window!r}: only one window for every layer")
        return window or None


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = RMSNorm
