"""--log-requests: one INFO line per sequence when it is sent to the scheduler and one when
it ends (or is refused), as SGLang's and vLLM's flag of that name; with
--log-requests-chars N the first N characters of its prompt and of its output too (texts
are off by default: they may be what the server's clients would keep to themselves)."""

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
    def __init__(self, chars: int, decode: Callable[[list[int]], str]) -> None:
        self.chars = chars
        self.decode = decode

    def sent(self, req: Req) -> None:
        adapter = f", LoRA adapter {req.lora_id}" if req.lora_id else ""
        text = ""
        if self.chars:
            text = f"; prompt {self._cut(self.decode(req.input_ids[: self.chars]))}"
        logger.info(
            "request %s: %d prompt tokens%s; %s%s",
            req.rid, len(req.input_ids), adapter, changed_params(req.params), text,
        )  # fmt: skip

    def ended(self, out: StrOut, seconds: float, pieces: list[str]) -> None:
        """`pieces`: the output's text as it came (joined only when texts are logged)."""
        reason = out.finish_reason
        kind = reason.type if reason is not None else "?"
        text = f"; output {self._cut(''.join(pieces))}" if self.chars else ""
        logger.info(
            "request %s ended (%s) after %.3f s: %d prompt tokens (%d cached), %d generated%s",
            out.rid, kind, seconds, out.prompt_tokens, out.cached_tokens,
            out.completion_tokens, text,
        )  # fmt: skip

    def refused(self, rid: str, message: str) -> None:
        logger.info("request %s refused: %s", rid, message)

    def _cut(self, text: str) -> str:
        return repr(text[: self.chars]) + ("…" if len(text) > self.chars else "")
