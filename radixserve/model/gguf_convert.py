"""One-time conversion of a llama-architecture GGUF file into a Hugging Face folder.

The folder (config.json, model.safetensors in fp32, tokenizer files with the GGUF's chat
template, manifest.json) lives in the model cache, keyed by the GGUF's path, size and
modification time, so later starts read safetensors in about a second. The manifest is
written last and the folder is renamed into place atomically: a folder without a valid
manifest, or whose files do not match it, is a partial or corrupt conversion and is rebuilt.
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

CONVERTER_VERSION = 1
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
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
    return target


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
    """Dequantized fp32 tensors under Hugging Face names, q/k un-permuted."""
    from gguf.quants import dequantize

    config = gguf_config(reader)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="converting GGUF", unit="tensor", disable=not progress):
        name = _hf_name(t.name)
        data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        data = data.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if name.endswith("self_attn.q_proj.weight"):
            data = _unpermute(data, heads)
        elif name.endswith("self_attn.k_proj.weight"):
            data = _unpermute(data, kv_heads)
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


def _convert_into(gguf_path: Path, folder: Path, progress: bool) -> None:
    reader = read_gguf(gguf_path)
    config = gguf_config(reader)
    save_file(gguf_state_dict(reader, progress), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
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


def _hf_name(gguf_name: str) -> str:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} is not part of the llama architecture")


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved RoPE layout of q/k rows (per head: pairs → halves)."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


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
