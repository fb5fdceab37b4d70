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
from radixserve.model.layers import (
    NO_ROW_KERNELS,
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    RotaryTables,
    RowKernels,
    logits_linear,
)

GATE_UP = ".mlp.gate_up_proj."  # the fused parameter, and the checkpoint's halves in order
GATE_UP_SHARDS = (".mlp.gate_proj.", ".mlp.up_proj.")


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, qkv_bias: bool) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Separate projections: on CPU the fused QKV matmul measured no faster, and its
        # strided q/k/v views made the rotary element-wise ops slower.
        self.q_proj = Linear(config.hidden_size, q_size, bias=qkv_bias)
        self.k_proj = Linear(config.hidden_size, kv_size, bias=qkv_bias)
        self.v_proj = Linear(config.hidden_size, kv_size, bias=qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        rotary: RotaryTables,
        attn: AttentionBackend,
        meta: object,
    ) -> torch.Tensor:
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)  # (T, KH, D)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary.apply(q, k)
        return self.o_proj(attn.forward(self.layer, q, k, v, meta))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, qkv_bias: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer, qkv_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x, rotary, attn, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, attn, meta)
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
        # None when tied: the logits use the embedding matrix (int8 quantization sets a head)
        self.lm_head: nn.Module | None = None
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.row_kernels = NO_ROW_KERNELS  # see use_row_kernels

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

    # The runner calls the three parts below: the decoder stack over every new token, the
    # final norm (`norm`) on the rows it wants, and the LM head on those that need logits;
    # embeddings take the normed rows and never pay for the head. A model class of another
    # architecture provides the same three.
    def hidden_states(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        attn: AttentionBackend,
        meta: object,
    ) -> torch.Tensor:  # (T, hidden), before the final norm
        x = self.embed_tokens(input_ids)
        rotary = self.rotary.tables(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rotary, attn, meta)
        return x

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:  # (L, hidden) normed → (L, vocab)
        if self.lm_head is None:
            return logits_linear(x, self.embed_tokens.weight, self.row_kernels).float()
        if isinstance(self.lm_head, nn.Linear) and self.lm_head.bias is None:
            return logits_linear(x, self.lm_head.weight, self.row_kernels).float()
        return self.lm_head(x).float()

    def use_row_kernels(self, kernels: RowKernels) -> None:
        """Send one row / a few rows (decode steps) of every linear layer and the LM head to
        the project's kernels."""
        self.row_kernels = kernels
        for module in self.modules():
            if isinstance(module, Linear):
                module.kernels = kernels

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) in; every parameter must be covered.
        A checkpoint's gate_proj / up_proj fill the halves of the fused gate_up_proj."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, part = name, slice(None)
            for half, shard in enumerate(GATE_UP_SHARDS):
                if shard in name:
                    target = name.replace(shard, GATE_UP)
                    rows = self.config.intermediate_size
                    part = slice(half * rows, (half + 1) * rows)
            if target not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no place in the model")
            param = params[target].data[part]
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


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}
