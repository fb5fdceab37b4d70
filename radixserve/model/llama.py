"""Llama-family decoder (LlamaForCausalLM, and Qwen2ForCausalLM which adds QKV biases).

The model runs on a flat batch: hidden states are (T, hidden) for all new tokens of all
requests; attention goes through the backend, which owns the KV pool.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from radixserve.model.attention import AttentionBackend
from radixserve.model.layers import GatedMLP, RMSNorm, RotaryEmbedding


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, qkv_bias: bool) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        attn: AttentionBackend,
        meta: object,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, KH, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        return self.o_proj(attn.forward(self.layer, q, k, v, meta))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, qkv_bias: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer, qkv_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x, positions, rotary, attn, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, attn, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    qkv_bias = False

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.qkv_bias) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        logits_indices: torch.Tensor,  # (L,)
        attn: AttentionBackend,
        meta: object,
    ) -> torch.Tensor:  # (L, vocab) fp32
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rotary, attn, meta)
        x = self.norm(x[logits_indices])  # only the positions whose logits are wanted
        head = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(x, head).float()

    # -- weights -------------------------------------------------------------------------
    # Hugging Face checkpoint names → (our parameter, shard) for the fused projections.
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) in; every parameter must be covered."""
        params = dict(self.named_parameters())
        expected = {(name, shard) for name in params for shard in range(self._num_shards(name))}
        loaded: set[tuple[str, int]] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            parts, shard = name.split("."), 0
            if len(parts) >= 2 and parts[-2] in self._FUSED:
                parts[-2], shard = self._FUSED[parts[-2]]
                name = ".".join(parts)
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no place in the model")
            dest = self._shards(name, params[name])[shard]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add((name, shard))
        missing = sorted(
            f"{n}[{s}]" if self._num_shards(n) > 1 else n for n, s in expected - loaded
        )
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:4]}")

    def _num_shards(self, name: str) -> int:
        return len(self._shards(name, None))

    def _shards(self, name: str, param: torch.Tensor | None) -> list:
        """A parameter's row blocks in checkpoint order (one block unless it is fused)."""
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in ("qkv_proj", "gate_up_proj"):
            return [None if param is None else param.data]
        owner = self.get_submodule(".".join(parts[:-2]))
        if isinstance(owner, LlamaAttention):
            sizes = [owner.q_size, owner.kv_size, owner.kv_size]
        else:
            sizes = [owner.intermediate, owner.intermediate]
        return sizes if param is None else list(param.data.split(sizes, dim=0))


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}
