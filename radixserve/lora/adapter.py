"""A LoRA adapter read from a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`,
what `PeftModel.save_pretrained` writes), checked against the loaded model and laid out
for the forward pass.

A LoRA module adds `scaling * (x @ A.T) @ B.T` to a linear layer's product of x, with A
(r, in), B (out, r) and scaling = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA). Here
the layers that share an input share one product: per decoder layer four *sites*, `qkv`
(q_proj, k_proj and v_proj of the attention input), `o` (o_proj), `gate_up` (gate_proj
and up_proj of the MLP input, laid out as the model's fused gate/up product) and `down`.
A site's A matrices are stacked (R, in), as a linear layer's weight, so that one product
x @ A.T serves all its modules; each module's B (r, out), scaling folded in, then takes its
span of those columns (`torch.addmm` onto the base product). A module the adapter does not
train has no columns and no B.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# site → its modules in output order (PEFT's module names)
SITES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
SITE_OF = {module: site for site, modules in SITES.items() for module in modules}
# PEFT's key of a LoRA matrix: ...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.name].weight
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


MAX_RANK = 1024  # past any trained adapter's rank; a larger one is refused, not allocated


class LoraError(ValueError):
    """The adapter cannot be served on this model (the message says why)."""


@dataclass(frozen=True)
class ModelShape:
    """What an adapter's matrices must fit: per module (in_features, out_features)."""

    num_layers: int
    dims: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, hidden: int, q_size: int, kv_size: int, intermediate: int, layers: int):
        dims = {
            "q_proj": (hidden, q_size),
            "k_proj": (hidden, kv_size),
            "v_proj": (hidden, kv_size),
            "o_proj": (q_size, hidden),
            "gate_proj": (hidden, intermediate),
            "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden),
        }
        return cls(layers, dims)


@dataclass(frozen=True)
class SiteWeights:
    a: torch.Tensor  # (R, in): the site's A matrices, one on top of the other
    # per module of the site (SITES order): its columns of x @ a.T, and its B transposed and
    # scaled (r, out); None where the module is not trained
    spans: tuple[tuple[int, int], ...]
    bs: tuple[torch.Tensor | None, ...]
    owners: torch.Tensor | None = None  # (R,): each column's adapter in a stack (state.py)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + sum(b.nbytes for b in self.bs if b is not None)

    def to(self, device, dtype) -> SiteWeights:
        bs = tuple(None if b is None else b.to(device, dtype) for b in self.bs)
        return SiteWeights(self.a.to(device, dtype), self.spans, bs, self.owners)


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest of its modules' ranks
    modules: tuple[str, ...]  # the PEFT module names it trains, sorted
    sites: dict[tuple[int, str], SiteWeights]  # (layer, site) → weights
    digest: str  # of its weights and scaling: what the prefix cache is namespaced by

    @property
    def cache_key(self) -> str:
        return f"lora:{self.digest}"

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.sites.values())

    def to(self, device) -> LoraAdapter:
        """The adapter with its matrices on `device`."""
        sites = {k: w.to(device, w.a.dtype) for k, w in self.sites.items()}
        return dataclasses.replace(self, sites=sites)

    @classmethod
    def load(
        cls, name: str, path: str | Path, shape: ModelShape, dtype: torch.dtype, device
    ) -> LoraAdapter:
        folder = Path(path).expanduser()
        config = _read_config(folder)
        scaling_of = _scaling(config)
        weights = folder / WEIGHTS_FILE
        if not weights.is_file():
            found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
            raise LoraError(
                f"{folder} has no {WEIGHTS_FILE} (found: {found}); only safetensors adapter "
                "weights are read (a pickled adapter_model.bin is not loaded)"
            )
        try:
            data = weights.read_bytes()  # once: the digest is of the bytes the matrices are
        except OSError as e:
            raise LoraError(f"{weights} cannot be read: {e}") from None
        pairs = _read_pairs(data, weights, shape)
        sites: dict[tuple[int, str], SiteWeights] = {}
        for layer in sorted({layer for layer, _ in pairs}):
            for site, modules in SITES.items():
                trained = [(m, pairs[layer, m]) for m in modules if (layer, m) in pairs]
                if trained:
                    sites[layer, site] = _site(modules, dict(trained), scaling_of)
        sites = {k: w.to(device, dtype) for k, w in sites.items()}
        digest = hashlib.blake2b(data, digest_size=16)
        digest.update(json.dumps(sorted(scaling_of(r) for r in _ranks(pairs))).encode())
        return cls(
            name=name,
            path=str(folder),
            rank=max(_ranks(pairs)),
            modules=tuple(sorted({m for _, m in pairs})),
            sites=sites,
            digest=digest.hexdigest(),
        )


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise LoraError(f"LoRA adapter folder {folder} does not exist")
    for name in (CONFIG_FILE, WEIGHTS_FILE):  # (a pipe would block the scheduler's read)
        if (folder / name).exists() and not (folder / name).is_file():
            raise LoraError(f"{folder / name} is not a regular file")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoraError(f"{folder} has no {CONFIG_FILE}: not a PEFT adapter folder") from None
    except json.JSONDecodeError as e:
        raise LoraError(f"{folder / CONFIG_FILE} is not valid JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise LoraError(f"{folder / CONFIG_FILE} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise LoraError(f"{folder / CONFIG_FILE} is not a JSON object")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not _finite(alpha):
        raise LoraError(f"{folder / CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraError(f"the adapter in {folder} is {peft_type}, not LORA")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "fan_in_fan_out": "fan_in_fan_out adapters (Conv1D layers) are not supported",
        "modules_to_save": "modules_to_save (fully trained layers) are not supported",
        "alpha_pattern": "per-module alpha_pattern is not supported",
    }
    for key, why in refused.items():
        if config.get(key):
            raise LoraError(f"{folder}: {why} ({key}={config[key]!r})")
    if config.get("bias", "none") != "none":
        raise LoraError(f"{folder}: trained biases are not supported (bias={config['bias']!r})")
    return config


def _finite(x: int | float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int past any float
        return False


def _scaling(config: dict):
    """rank → the factor on B @ A (rank_pattern's ranks come from the matrices' shapes)."""
    alpha = float(config.get("lora_alpha", 8))
    if config.get("use_rslora"):
        return lambda r: alpha / math.sqrt(r)
    return lambda r: alpha / r


def _read_pairs(data: bytes, weights: Path, shape: ModelShape) -> dict[tuple[int, str], tuple]:
    """(layer, module) → (A (r, in), B (out, r)) in fp32, each checked against the model
    (`data`: the bytes of `weights`)."""
    try:
        tensors = safetensors.torch.load(data)
    except SafetensorError as e:
        raise LoraError(f"{weights} is not a readable safetensors file: {e}") from None
    return _pairs(_read_matrices(tensors, weights, shape), weights, shape)


def _read_matrices(
    tensors: dict[str, torch.Tensor], weights: Path, shape: ModelShape
) -> dict[tuple[int, str, str], torch.Tensor]:
    """(layer, module, "A" | "B") → the matrix in fp32."""
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise LoraError(
                f"{weights}: tensor {key} is not a LoRA matrix (lora_A / lora_B weight) "
                f"of an attention or MLP projection ({', '.join(SITE_OF)}); embedding, "
                "LM-head and bias adapters are not supported"
            )
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in SITE_OF:
            raise LoraError(
                f"{weights}: tensor {key} adapts {module}, not one of {', '.join(SITE_OF)}"
            )
        if layer >= shape.num_layers:
            raise LoraError(
                f"{weights}: tensor {key} is for layer {layer}; the model has {shape.num_layers}"
            )
        if (layer, module, which) in found:
            raise LoraError(
                f"{weights}: two lora_{which} tensors for layer {layer} {module} (the "
                f"second: {key}); one adapter per folder, of a text model"
            )
        if not tensor.is_floating_point():
            raise LoraError(f"{weights}: tensor {key} is {tensor.dtype}, not floating point")
        found[layer, module, which] = tensor.float()
    if not found:
        raise LoraError(f"{weights} holds no LoRA matrices")
    return found


def _pairs(found: dict, weights: Path, shape: ModelShape) -> dict[tuple[int, str], tuple]:
    pairs = {}
    for layer, module, which in found:
        if which == "B":
            continue
        a, b = found[layer, module, "A"], found.get((layer, module, "B"))
        if b is None:
            raise LoraError(f"{weights}: layer {layer} {module} has lora_A but no lora_B")
        fan_in, fan_out = shape.dims[module]
        if a.dim() == 2 and not 1 <= a.shape[0] <= MAX_RANK:
            raise LoraError(
                f"{weights}: layer {layer} {module} has rank {a.shape[0]}; ranks of 1 to "
                f"{MAX_RANK} are served"
            )
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[0] != b.shape[1]
            or (a.shape[1], b.shape[0]) != (fan_in, fan_out)
        ):
            raise LoraError(
                f"{weights}: layer {layer} {module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}; this model needs A (r, {fan_in}) and B ({fan_out}, r): "
                "the adapter was trained for another model"
            )
        pairs[layer, module] = (a, b)
    unpaired = {(layer, m) for layer, m, w in found if w == "B"} - set(pairs)
    if unpaired:
        layer, module = min(unpaired)
        raise LoraError(f"{weights}: layer {layer} {module} has lora_B but no lora_A")
    return pairs


def _ranks(pairs: dict) -> list[int]:
    return [a.shape[0] for a, _ in pairs.values()]


def _site(modules, trained: dict, scaling_of) -> SiteWeights:
    """One site's (R, in) A and per-module B (see the module's doc)."""
    a_parts, spans, bs = [], [], []
    start = 0
    for module in modules:
        if module not in trained:
            spans.append((start, start))
            bs.append(None)
            continue
        lora_a, lora_b = trained[module]
        r = lora_a.shape[0]
        a_parts.append(lora_a)
        spans.append((start, start + r))
        bs.append((lora_b.t() * scaling_of(r)).contiguous())
        start += r
    return SiteWeights(torch.cat(a_parts).contiguous(), tuple(spans), tuple(bs))
