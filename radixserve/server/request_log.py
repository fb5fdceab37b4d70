"""--log-requests: one INFO line per sequence when it is sent to the scheduler and one when
it ends (its client gone too), is refused by the scheduler, or fails, as SGLang's and
vLLM's flag of that name; with --log-requests-chars N the first N characters of its prompt
and of its output too (prompt and output texts are off by default: they may be what the
server's clients would keep to themselves; sampling parameters such as stop strings are
logged, cut at PARAM_CHARS)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from radixserve.core.output import StrOut
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams

logger = logging.getLogger("radixserve.requests")

_DEFAULTS = SamplingParams()
PARAM_CHARS = 80  # a parameter's value is cut to this many characters (a schema, a grammar)


def changed_params(params: SamplingParams) -> str:
    """The sampling parameters that differ from the defaults, as `name=value` pairs."""
    pairs = []
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if value != getattr(_DEFAULTS, f.name):
            text = repr(value)
            pairs.append(f"{f.name}={text[:PARAM_CHARS]}{'…' if len(text) > PARAM_CHARS else ''}")
    return " ".join(pairs) or "defaults"


class RequestLog:
    """`adapter_name`: a LoRA adapter's name by its uid (None once unloaded)."""

    def __init__(
        self,
        chars: int,
        decode: Callable[[list[int]], str],
        adapter_name: Callable[[int], str | None] = lambda uid: None,
    ) -> None:
        self.chars = chars
        self.decode = decode
        self.adapter_name = adapter_name

    def sent(self, req: Req) -> None:
        adapter = ""
        if req.lora_id:
            adapter = f", LoRA adapter {self.adapter_name(req.lora_id) or req.lora_id}"
        what = "embedding" if req.embed is not None else changed_params(req.params)
        text = ""
        if self.chars:
            text = f"; prompt {self._cut(self.decode(req.input_ids[: self.chars]))}"
        logger.info(
            "request %s: %d prompt tokens%s; %s%s",
            req.rid, len(req.input_ids), adapter, what, text,
        )  # fmt: skip

    def ended(self, out: StrOut, seconds: float, pieces: list[str], note: str = "") -> None:
        """`pieces`: the output's text as it came (joined only when texts are logged)."""
        reason = out.finish_reason
        kind = "embedding" if out.embedding is not None else reason.type if reason else "?"
        text = f"; output {self._cut(''.join(pieces))}" if self.chars else ""
        logger.info(
            "request %s ended (%s%s) after %.3f s: %d prompt tokens (%d cached), %d generated%s",
            out.rid, kind, f", {note}" if note else "", seconds, out.prompt_tokens,
            out.cached_tokens, out.completion_tokens, text,
        )  # fmt: skip

    def refused(self, rid: str, message: str) -> None:
        logger.info("request %s refused: %s", rid, message)

    def failed(self, rid: str, message: str) -> None:
        logger.info("request %s failed: %s", rid, message)

    def _cut(self, text: str) -> str:
        return repr(text[: self.chars]) + ("…" if len(text) > self.chars else "")
