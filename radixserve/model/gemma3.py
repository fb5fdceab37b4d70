"""Gemma 3 text decoder (Gemma3ForCausalLM, config `gemma3_text`).

Against Llama: embeddings scaled by sqrt(hidden), Gemma's RMSNorm (x * (1 + w) in fp32),
four norms per layer (around attention and around the MLP), per-head q/k norms, a GELU-tanh
gated MLP, q·k scaled by query_pre_attn_scalar^-0.5, tied embeddings, an optional final
logit soft-cap, and two kinds of layers (`layer_types`): "sliding_attention" layers attend
only the last `sliding_window` positions and use their own RoPE base, "full_attention" ones
attend everything.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from radixserve.model.attention import AttentionBackend
from radixserve.model.base import CausalLM, LastRows, head_dim_of
from radixserve.model.layers import GatedMLP, GemmaRMSNorm, RotaryEmbedding, RotaryTables
from radixserve.model.llama import LlamaAttention
from radixserve.model.parallel import SINGLE, TensorParallel

SLIDING, FULL = "sliding_attention", "full_attention"


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(config, layer, False, GemmaRMSNorm, tp)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        rotary: RotaryTables,
        attn: AttentionBackend,
        meta: object,
        last: tuple[LastRows, RotaryTables] | None = None,
    ) -> torch.Tensor:  # (T, hidden); with `last` (the last layer), of its rows alone
        h = self.self_attn(self.input_layernorm(x), rotary, attn, meta, last)
        if last is not None:
            x = x[last[0].rows]
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


def check_supported(config: PretrainedConfig) -> None:
    """What this implementation does not run, said before anything is built."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("Gemma 3 with attn_logit_softcapping is not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Gemma 3 with use_bidirectional_attention is not supported")
    if getattr(config, "attention_bias", False):
        raise ValueError("Gemma 3 with attention_bias is not supported")
    unknown = set(config.layer_types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(f"Gemma 3 layer types {sorted(unknown)} are not supported")


class Gemma3ForCausalLM(CausalLM):
    def __init__(
        self, config: PretrainedConfig, max_positions: int, tp: TensorParallel = SINGLE
    ) -> None:
        check_supported(config)
        super().__init__(config, tp)
        self.layer_types: list[str] = list(config.layer_types)
        head_dim = head_dim_of(config)
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(config, head_dim, max_positions, layer_type=kind)
                for kind in sorted(set(self.layer_types))
            }
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.final_softcap: float | None = getattr(config, "final_logit_softcapping", None)

    @property
    def attention_scale(self) -> float:
        return self.config.query_pre_attn_scalar**-0.5

    @property
    def attention_windows(self) -> list[int]:
        window = int(self.config.sliding_window or 0)
        return [window if kind == SLIDING else 0 for kind in self.layer_types]

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        attn: AttentionBackend,
        meta: object,
        last: LastRows | None = None,
    ) -> torch.Tensor:  # (T, hidden), before the final norm; with `last` (L, hidden)
        x = self.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the embedding's dtype first, as transformers does
        x = x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype)
        tables = {kind: rotary.tables(positions, x.dtype) for kind, rotary in self.rotary.items()}
        final = len(self.layers) - 1
        for i, (layer, kind) in enumerate(zip(self.layers, self.layer_types, strict=True)):
            narrowed = None
            if i == final and last is not None:  # the last layer past its K/V: these rows
                narrowed = (last, self.rotary[kind].tables(last.positions, x.dtype))
            x = layer(x, tables[kind], attn, meta, narrowed)
        return x

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:  # (L, hidden) normed
        logits = self.lm_logits(x)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()
