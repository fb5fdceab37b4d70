"""One-time conversion of a GGUF file (architecture llama or gemma3) into a Hugging Face folder.

The folder (config.json, model.safetensors in fp32, tokenizer files with the GGUF's chat
template, generation_config.json where its metadata recommends sampling, manifest.json)
lives in the model cache, keyed by the GGUF's path, size and modification time, so later
starts read safetensors in about a second. The manifest is written last and the folder is
renamed into place atomically: a folder without a valid manifest, or whose files do not
match it, is a partial or corrupt conversion and is rebuilt. Each new conversion removes
the stale ones (of a GGUF since deleted, or changed, as a reinstalled package's is), which
would otherwise fill the disk by ~4x the GGUF each time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from radixserve.model.loader import ModelLoadError

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 2  # 2: generation_config.json from the GGUF's sampling metadata
# the sampling a GGUF recommends (llama.cpp's general.sampling.* keys) → generation_config's
SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "gemma3")
MANIFEST = "manifest.json"
REQUIRED_FILES = {"config.json", "model.safetensors", "tokenizer.json"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3: llama.cpp's names of its four norms per layer and its q/k norms; q/k are not
# permuted (its converter permutes only llama-family q/k), and every norm weight is stored as
# 1 + w (Gemma's RMSNorm multiplies by 1 + w; the checkpoint holds w).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LAYER_NAMES_OF = {"llama": _LAYER_NAMES, "gemma3": _GEMMA3_LAYER_NAMES}
GEMMA3_SLIDING_PATTERN = 6  # llama.cpp: every 6th layer attends fully, the others locally
GEMMA3_SLIDING_ROPE_THETA = 10000.0  # llama.cpp's fixed RoPE base of the local layers
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def convert_gguf(gguf_path: Path, cache_dir: Path, progress: bool = True) -> Path:
    """The converted folder for `gguf_path`, building it if it is missing or invalid."""
    target = cache_dir / _cache_key(gguf_path)
    if target.exists():
        problem = validate_converted(target)
        if problem is None:
            return target
        logger.warning("rebuilding the converted model at %s: %s", target, problem)
        shutil.rmtree(target, ignore_errors=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=cache_dir))
    try:
        _convert_into(gguf_path, tmp, progress)
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same conversion first
            if validate_converted(target) is not None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    remove_stale_conversions(cache_dir)
    return target


def remove_stale_conversions(cache_dir: Path) -> list[Path]:
    """Remove the conversions whose GGUF is gone or is no longer the file they were made from.

    Only folders this converter made (named by `_cache_key` of the source their manifest
    records) are touched; partial conversions in progress and anything else are left alone.
    """
    removed = []
    for folder in sorted(cache_dir.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        try:
            source = json.loads((folder / MANIFEST).read_bytes())["source"]
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if not isinstance(source, str):
            continue
        source_path = Path(source)
        if not folder.name.startswith(source_path.stem + "-"):
            continue
        try:
            current = _cache_key(source_path)
        except OSError:  # the GGUF is gone
            current = None
        if current == folder.name:
            continue
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        shutil.rmtree(folder, ignore_errors=True)
        logger.info(
            "removed %s (%.0f MB): its GGUF %s is gone or changed", folder, size / 1e6, source
        )
        removed.append(folder)
    return removed


def validate_converted(folder: Path) -> str | None:
    """None when `folder` is a complete conversion, else what is wrong with it."""
    try:
        manifest = json.loads((folder / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return "no readable manifest (an interrupted conversion?)"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not REQUIRED_FILES <= set(files):
        return "the manifest does not list the converted files"
    if manifest.get("converter_version") != CONVERTER_VERSION:
        return "made by another converter version"
    for name, size in files.items():
        file = folder / name
        if not file.is_file() or file.stat().st_size != size:
            return f"{name} is missing or has the wrong size"
        if name.endswith(".safetensors"):
            try:
                with safe_open(file, framework="pt") as f:
                    f.keys()
            except (SafetensorError, OSError) as e:
                return f"{name} is unreadable: {e}"
    return None


def read_gguf(gguf_path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF file: {e}") from e


def gguf_state_dict(reader: Any, progress: bool = False) -> dict[str, torch.Tensor]:
    """Dequantized fp32 tensors under Hugging Face names: llama's q/k un-permuted, Gemma 3's
    norm weights back to w from llama.cpp's 1 + w."""
    from gguf.quants import dequantize

    config = gguf_config(reader)
    arch = _field(reader, "general.architecture")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="converting GGUF", unit="tensor", disable=not progress):
        name = _hf_name(t.name, arch)
        data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        data = data.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            data = _unpermute(data, heads)
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            data = _unpermute(data, kv_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            data -= 1.0
        tensors[name] = torch.from_numpy(np.ascontiguousarray(data))
    return tensors


def gguf_config(reader: Any) -> dict[str, Any]:
    """A Hugging Face config.json for the GGUF's metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError("GGUF with rope_freqs (Llama 3 RoPE scaling) is not supported yet")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError("GGUF has no token_embd.weight tensor (a vocab-only file?)")
    if arch == "gemma3":
        return _gemma3_config(reader, int(embd.shape[1]), "output.weight" not in names)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        },
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        "vocab_size": int(embd.shape[1]),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", None),
        "torch_dtype": "float32",
    }


def _gemma3_config(reader: Any, vocab_size: int, tied: bool) -> dict[str, Any]:
    """config.json (Gemma3TextConfig) for a gemma3 GGUF: what its metadata says, and what
    llama.cpp fixes for the architecture (layer pattern, local RoPE base, attention scale)."""
    arch = "gemma3"
    if _field(reader, f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise ModelLoadError("gemma3 GGUF with RoPE scaling is not supported yet")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    layers = int(_field(reader, f"{arch}.block_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    # llama.cpp scales q·k by head_dim^-0.5, except for the 27B model (62 layers)
    query_pre_attn_scalar = hidden // heads if layers == 62 else head_dim
    full = [(i + 1) % GEMMA3_SLIDING_PATTERN == 0 for i in range(layers)]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "sliding_window": int(_field(reader, f"{arch}.attention.sliding_window")),
        "layer_types": ["full_attention" if f else "sliding_attention" for f in full],
        "rope_parameters": {
            "full_attention": {
                "rope_type": "default",
                "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 1000000.0)),
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_SLIDING_ROPE_THETA},
        },
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", None),
        "torch_dtype": "float32",
    }


def _convert_into(gguf_path: Path, folder: Path, progress: bool) -> None:
    reader = read_gguf(gguf_path)
    config = gguf_config(reader)
    save_file(gguf_state_dict(reader, progress), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    sampling = gguf_sampling(reader)
    if sampling:  # (read by --sampling-defaults model, as a Hugging Face folder's)
        (folder / "generation_config.json").write_text(json.dumps(sampling, indent=2))
    if progress:
        print("building the tokenizer from the GGUF metadata...", file=sys.stderr, flush=True)
    _save_tokenizer(gguf_path, folder)
    folder.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    for file in folder.iterdir():
        file.chmod(0o644)
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    manifest = {"converter_version": CONVERTER_VERSION, "source": str(gguf_path), "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))


def _save_tokenizer(gguf_path: Path, folder: Path) -> None:
    """transformers builds the tokenizer (and chat template) from the GGUF metadata."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot build a tokenizer from {gguf_path}: {e}") from e
    tokenizer.save_pretrained(folder)


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    layer_names = _LAYER_NAMES_OF[arch]
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{kind}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} is not part of the {arch} architecture")


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved RoPE layout of q/k rows (per head: pairs → halves)."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def gguf_sampling(reader: Any) -> dict[str, Any]:
    """The sampling parameters the GGUF's metadata recommends, by generation_config.json's
    names (none: {})."""
    sampling = {}
    for key, name in SAMPLING_KEYS.items():
        value = _field(reader, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            sampling[name] = value
    return sampling


def _field(reader: Any, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ModelLoadError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()


def _cache_key(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    ident = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERTER_VERSION}"
    return f"{gguf_path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"
