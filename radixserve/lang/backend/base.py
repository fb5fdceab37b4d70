"""The one interface the interpreter uses to reach a model.

A backend reads the program's text (`s.text_`) and, for chat-only APIs, its messages
(`s.messages_`) from the executor it is given; it never changes them. Every method may
raise: the interpreter turns the error into the program's error.
"""

from __future__ import annotations

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


class Backend(ABC):
    is_chat_model: bool = False
    _shares_prefixes: bool | None = None  # shares_batch_prefixes' answer, once known

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

    def shares_batch_prefixes(self) -> bool:
        """Whether the runtime computes a prefix that requests arriving together share once
        (radixserve's in-batch prefix caching), so that a fork's branches or a select's
        continuations need not find their context cached beforehand: then the prefix hint
        is not waited for and a select sends no prefix call first. Read once from
        `get_server_info`; False for a server that does not say (SGLang's, under its
        default fcfs policy, computes such a prefix once per request)."""
        if self._shares_prefixes is None:
            try:
                info = self.get_server_info()
            except Exception:  # asked again next time
                return False
            self._shares_prefixes = info.get("disable_in_batch_prefix_caching") is False and (
                not info.get("disable_radix_cache", False)
            )
        return self._shares_prefixes

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:  # noqa: B027 (most backends hold nothing)
        """Release what the backend holds (connections; a process it started)."""
