"""The edge's names of the loaded LoRA adapters (the server's tokenizer process, the
Engine's caller thread): requests name an adapter, the scheduler knows it by a uid.

Uids are handed out here, once each: the adapters of --lora-paths get 1..n in order (the
runner loads them at start with the same numbers), each later load the next one. A name
leaves the registry before its unload is sent, so no request can name it after; the
scheduler unloads it once the requests already sent have ended.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.config import LoraConfig
from radixserve.native import InvalidRequest

# how long the edge waits for an adapter's folder to be read (a load waits for no request);
# past it the load is undone: the scheduler abandons a read still going (a hung file system)
LOAD_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class LoraRef:
    name: str
    path: str
    uid: int


class LoraNotFound(InvalidRequest):
    """`model` names an adapter that is not loaded (an OpenAI route's 404)."""


def check_names(config: LoraConfig, reserved: tuple[str, ...]) -> None:
    """ValueError where --lora-paths names an adapter as the served model is named."""
    taken = sorted(name for name, _ in config.adapters if name in reserved)
    if taken:
        raise ValueError(
            f"--lora-paths names an adapter {taken[0]!r}, the served model's name; give it "
            "another (--lora-paths NAME=PATH)"
        )


class LoraRegistry:
    """`reserved`: names an adapter may not take (the served model's: `model` picks it)."""

    def __init__(self, config: LoraConfig, reserved: tuple[str, ...] = ()) -> None:
        self.enabled = config.enabled
        self.reserved = reserved
        check_names(config, reserved)
        self.retired: set[str] = set()  # names unloaded (and not loaded again)
        self.refs: dict[str, LoraRef] = {
            name: LoraRef(name, path, uid)
            for uid, (name, path) in enumerate(config.adapters, start=1)
        }
        self._uids = itertools.count(len(self.refs) + 1)
        self.pending: set[str] = set()  # names being loaded or unloaded right now

    def new_ref(self, name: str, path: str) -> LoraRef:
        """A uid for a load of `name` (InvalidRequest if the name is taken or busy)."""
        if not self.enabled:
            raise InvalidRequest(
                "LoRA adapters are not served: start the server with --enable-lora", "lora_name"
            )
        if not name:
            raise InvalidRequest("lora_name is empty", "lora_name")
        if name in self.reserved:
            raise InvalidRequest(
                f"lora_name {name!r} is the served model's name; give the adapter another",
                "lora_name",
            )
        if name in self.pending:
            raise InvalidRequest(
                f"LoRA adapter {name!r} is being loaded or unloaded; retry once that ends",
                "lora_name",
            )
        if name in self.refs:
            raise InvalidRequest(
                f"a LoRA adapter named {name!r} is already loaded (unload it first)", "lora_name"
            )
        return LoraRef(name, path, next(self._uids))

    def uid(self, name: str | None, param: str = "lora_path") -> int:
        """The uid of the adapter called `name` (0 for None: the base model)."""
        if name is None:
            return 0
        ref = self.refs.get(name)
        if ref is None:
            loaded = ", ".join(sorted(self.refs)) or "none"
            raise InvalidRequest(
                f"LoRA adapter {name!r} is not loaded (loaded: {loaded})",
                param,
                code="lora_not_found",
            )
        return ref.uid

    def uids(self, names: str | Sequence[str | None] | None) -> int | list[int]:
        """/generate's `lora_path`: one name for every prompt, or one per prompt (a list,
        whose length `expand_request` checks)."""
        if names is None or isinstance(names, str):
            return self.uid(names)
        if not isinstance(names, list | tuple):
            raise InvalidRequest(
                "lora_path must be a name, or a list of one per prompt", "lora_path"
            )
        return [self.uid(name) for name in names]

    def add(self, ref: LoraRef) -> None:
        self.refs[ref.name] = ref
        self.retired.discard(ref.name)

    def remove(self, name: str) -> int:
        """Drop a loaded name (`uid` checks it first); its uid."""
        self.retired.add(name)
        return self.refs.pop(name).uid

    def model_uid(self, model: str | None) -> int:
        """The OpenAI routes' `model`: an adapter's name, or BASE:NAME (SGLang's form, BASE
        the served model), names an adapter; LoraNotFound where it names one that is not
        loaded (BASE:NAME, or the name of an adapter since unloaded); anything else is the
        base model (any `model` is taken, as the wire contract has it)."""
        if not model or model in self.reserved:
            return 0
        if model in self.refs:
            return self.refs[model].uid
        base, sep, name = model.rpartition(":")
        if sep and name in self.refs:
            return self.refs[name].uid
        served = bool(sep) and base in self.reserved  # SERVED:NAME
        if model in self.pending or (served and name in self.pending):
            raise LoraNotFound(f"LoRA adapter {model!r} is being loaded or unloaded", "model")
        if model in self.retired or (served and name in self.retired):
            raise LoraNotFound(f"LoRA adapter {name if served else model!r} was unloaded", "model")
        if served and self.enabled:
            loaded = ", ".join(sorted(self.refs)) or "none"
            raise LoraNotFound(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})", "model")
        return 0

    def name_of(self, uid: int) -> str | None:
        """The name of the loaded adapter `uid` (None: none is)."""
        return next((ref.name for ref in self.refs.values() if ref.uid == uid), None)

    def loaded(self) -> dict[str, str]:
        """name → path of every loaded adapter (SGLang's `loaded_adapters`)."""
        return {ref.name: ref.path for ref in self.refs.values()}
