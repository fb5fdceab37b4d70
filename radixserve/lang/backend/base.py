"""The one interface the interpreter uses to reach a model.

A backend reads the program's text (`s.text_`) and, for chat-only APIs, its messages
(`s.messages_`) from the executor it is given; it never changes them. Every method may
raise: the interpreter turns the error into the program's error.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from radixserve.lang.choices import ChoiceScores, ChoicesDecision, ChoicesSamplingMethod
from radixserve.lang.global_config import global_config

if TYPE_CHECKING:
    from radixserve.lang.chat_template import ChatTemplate
    from radixserve.lang.interpreter import Executor
    from radixserve.lang.ir import SamplingParams


def native_completion(
    out: dict[str, Any] | list[dict[str, Any]],
) -> tuple[str | list[str], dict[str, Any] | list[dict[str, Any]]]:
    """A native-API result as (text, meta_info), or lists of both for n > 1."""
    if isinstance(out, list):
        return [o["text"] for o in out], [o["meta_info"] for o in out]
    return out["text"], out["meta_info"]


def native_deltas(results: Iterator[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Streamed native results (cumulative text) as (new text, meta_info) pairs."""
    pos = 0
    for out in results:
        text = out["text"]
        yield text[pos:], out["meta_info"]
        pos = len(text)


class BackendError(RuntimeError):
    """The server refused or failed a call; `status` is its HTTP status (None in-process)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message if status is None else f"{status}: {message}")
        self.status = status


class PrefixReuse(enum.Enum):
    """What a runtime does with a prefix that several requests share.

    BATCH: it computes the prefix once for requests that arrive together (radixserve's
    in-batch prefix caching) and keeps it (radix cache): a fork's prefix hint is sent
    without waiting for it, a select's continuations go in one call as they are.
    CACHE: it keeps prefixes once computed, but requests arriving together each compute
    theirs (`--disable-in-batch-prefix-caching`; SGLang's server under its default fcfs
    policy; any server that does not say): the branches of a fork start once the hint has
    cached their prefix, and a select caches its context before scoring its choices.
    NONE: it keeps nothing (`--disable-radix-cache`): no hint, no prefix call."""

    BATCH = "batch"
    CACHE = "cache"
    NONE = "none"

    @classmethod
    def of(cls, server_info: dict[str, Any]) -> PrefixReuse:
        if server_info.get("disable_radix_cache", False):
            return cls.NONE
        if server_info.get("disable_in_batch_prefix_caching") is False:
            return cls.BATCH
        return cls.CACHE


class Backend(ABC):
    is_chat_model: bool = False
    _prefix_reuse: PrefixReuse | None = None  # prefix_reuse's answer, once known

    @abstractmethod
    def get_chat_template(self) -> ChatTemplate: ...

    @abstractmethod
    def generate(
        self, s: Executor, params: SamplingParams
    ) -> tuple[str | list[str], dict[str, Any] | list[dict[str, Any]]]:
        """Continue `s.text_`: the completion (a list of n with n > 1) and its meta_info."""

    @abstractmethod
    def generate_stream(
        self, s: Executor, params: SamplingParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Continue `s.text_`, yielding (new text, meta_info so far) as it is generated."""

    @abstractmethod
    def score_choices(
        self, prefix: str, choices: list[str], unconditional: bool
    ) -> list[ChoiceScores]:
        """Each choice's own tokens after `prefix` and their logprobs (token healing
        included); with `unconditional`, also their logprobs without the prefix."""

    @abstractmethod
    def cache_prefix(self, prefix: str) -> int:
        """Compute and cache the prefix's KV; its token count."""

    def select(
        self,
        s: Executor,
        choices: list[str],
        temperature: float,
        choices_method: ChoicesSamplingMethod,
    ) -> ChoicesDecision:
        """Score every choice after the program's text and let the method decide; all in one
        call, or one call per choice with the co-design switched off."""
        unconditional = choices_method.requires_unconditional_logprobs
        if global_config.enable_batched_select:
            scores = self.score_choices(s.text_, choices, unconditional)
        else:
            scores = [self.score_choices(s.text_, [c], unconditional)[0] for c in choices]
        return choices_method(choices, scores)

    def prefix_reuse(self) -> PrefixReuse:
        """How the runtime reuses a prefix, read once from `get_server_info`: what the
        co-design does for a fork's prefix hint and a select's context depends on it."""
        if self._prefix_reuse is None:
            try:
                info = self.get_server_info()
            except Exception:  # asked again next time
                return PrefixReuse.CACHE
            self._prefix_reuse = PrefixReuse.of(info)
        return self._prefix_reuse

    def cache_context_first(self, prefix: str, choices: list[str]) -> None:
        """Before one scoring call over several choices: cache their shared context where
        the runtime would otherwise compute it once per choice (PrefixReuse.CACHE)."""
        if len(choices) > 1 and self.prefix_reuse() is PrefixReuse.CACHE:
            self.cache_prefix(prefix)

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:  # noqa: B027 (most backends hold nothing)
        """Release what the backend holds (connections; a process it started)."""
