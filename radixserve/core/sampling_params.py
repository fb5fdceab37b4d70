"""Sampling parameters of one request: plain data that validates itself.

Field names and defaults follow SGLang's native API (see the wire contract). A value out of
range raises `ValueError` naming the field; the server turns that into a 400.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgspec
import regex

from radixserve.core.regex_cost import unrolled_size
from radixserve.core.structural_tag import StructuralTag, StructuralTagError

GREEDY_TEMPERATURE = 1e-6  # temperatures below this mean greedy (argmax)
CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")  # at most one per request
MAX_N = 128  # samples per prompt (OpenAI's cap on n)
MAX_LOGIT_BIAS = 100.0  # |bias| at most this (OpenAI's range, [-100, 100])
SEED_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit signed integer, as OpenAI's seed
# Stop strings and regexes are checked against the output every step, so what one request
# may ask bounds what every step costs (OpenAI allows 4 stop strings; SGLang sets no cap):
MAX_STOPS = 1024  # stop strings, each looked for in the output's tail every step
MAX_STOP_LENGTH = 1024  # characters of one: that tail is as many tokens as it has bytes
MAX_STOP_REGEXES = 64  # stop regexes, each searched over the whole output every step
# characters of one: the first search of a pattern holding a long literal builds a table in
# time cubic in its length, beyond the search's time limit (2.7 ms at 256, 9 s at 4096)
MAX_STOP_REGEX_LENGTH = 256
MAX_STOP_REGEX_ITEMS = 4096  # all of them unrolled (core/regex_cost.py): ~1 ms to compile


@dataclass(frozen=True)
class ThinkBlock:
    """A block of reasoning before what a request's constraint describes (SGLang's
    require_reasoning, under --reasoning-parser): the constraint applies after the block's
    end tag, and the reasoning inside it is free text. Without `inside`, the block is
    optional: the output may open it with `start`, or go straight to the constrained text."""

    start: str
    end: str
    inside: bool  # the output starts inside the block (its prompt, or the format, opened it)


class SamplingParamsError(ValueError):
    """A sampling parameter that cannot be honoured; `field` names it (None: several)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _token_key(key: Any) -> Any:
    """A logit_bias key as a token id: JSON object keys arrive as strings."""
    return int(key) if isinstance(key, str) and key.removeprefix("-").isdecimal() else key


def _msgspec_field(message: str) -> str | None:
    """The top-level field a msgspec error names ("... - at `$.top_k`")."""
    match = re.search(r"`\$\.([A-Za-z_]+)", message)
    return match.group(1) if match else None


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)  # stop when the output matches one
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None
    n: int = 1
    # constrained decoding: the output must follow one of these
    json_schema: str | None = None  # a JSON schema, as a JSON string
    regex: str | None = None
    ebnf: str | None = None  # a GBNF/EBNF or Lark grammar
    # free text whose tagged parts follow schemas, as JSON (core/structural_tag.py)
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        if isinstance(self.structural_tag, dict):  # as from_dict takes it
            self.structural_tag = json.dumps(self.structural_tag)
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        self.verify()

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        """Build from a request's dict, checking types; null values mean "use the default",
        unknown keys fail. Every failure is a ValueError naming the field."""
        if params is None:
            params = {}
        if not isinstance(params, dict):
            kind = type(params).__name__
            raise SamplingParamsError(f"sampling_params must be an object, got {kind}")
        params = {k: v for k, v in params.items() if v is not None}
        for key in set(CONSTRAINTS) & set(params):  # an empty string means "no constraint"
            if params[key] == "":
                del params[key]
        for key in ("json_schema", "structural_tag"):  # an object: accept it as is
            if isinstance(params.get(key), dict):
                try:
                    params[key] = json.dumps(params[key])
                except RecursionError:
                    raise SamplingParamsError(f"{key} nests too deeply", key) from None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - known, key=str)
        if unknown:
            names = ", ".join(map(str, unknown))
            raise SamplingParamsError(f"unknown sampling parameter(s): {names}", str(unknown[0]))
        for key in ("stop", "stop_regex"):
            if isinstance(params.get(key), str):
                params[key] = [params[key]]
        if isinstance(params.get("logit_bias"), dict):  # JSON object keys are strings
            params["logit_bias"] = {_token_key(k): v for k, v in params["logit_bias"].items()}
        try:
            return msgspec.convert(params, cls)
        except msgspec.ValidationError as e:
            if isinstance(e.__cause__, SamplingParamsError):  # raised by verify()
                raise e.__cause__ from None
            field = _msgspec_field(str(e))
            message = str(e).replace("`$.", "`sampling_params.")
            raise SamplingParamsError(f"invalid sampling parameter: {message}", field) from None

    @cached_property
    def stop_patterns(self) -> list[regex.Pattern]:
        """The stop regexes, compiled once for the request: the `regex` package's own cache
        holds 500 patterns, which the requests running at once may outnumber between them
        (each step would then compile every pattern again, ~0.1 ms apiece)."""
        return [regex.compile(pattern) for pattern in self.stop_regex]

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def verify(self) -> None:
        """Every range the engine can honour; a SamplingParamsError names the field."""
        self._verify_lengths()
        self._verify_sampling()
        self._verify_stops()
        given = [name for name in CONSTRAINTS if getattr(self, name)]
        if len(given) > 1:
            raise SamplingParamsError(
                f"at most one of {', '.join(CONSTRAINTS)} may be given, got {', '.join(given)}",
                given[1],
            )
        if self.structural_tag:
            try:
                StructuralTag.parse(self.structural_tag)
            except StructuralTagError as e:
                message = f"invalid structural_tag: {e}"
                raise SamplingParamsError(message, "structural_tag") from None

    def _check(self, ok: bool, name: str, rule: str) -> None:
        if not ok:
            raise SamplingParamsError(f"{name} {rule}, got {getattr(self, name)!r}", name)

    def _verify_lengths(self) -> None:
        check = self._check
        check(self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0")
        check(0 <= self.min_new_tokens, "min_new_tokens", "must be >= 0")
        check(
            self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            f"must be <= max_new_tokens ({self.max_new_tokens})",
        )
        check(1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]")

    def _verify_sampling(self) -> None:
        check = self._check
        check(0 <= self.temperature < math.inf, "temperature", "must be finite and >= 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (all) or >= 1")
        check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        check(0 < self.repetition_penalty <= 2, "repetition_penalty", "must be in (0, 2]")
        low, high = SEED_RANGE
        seed = self.sampling_seed
        check(seed is None or low <= seed <= high, "sampling_seed", "must be a 64-bit integer")
        check(
            all(-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in self.logit_bias.values()),
            "logit_bias",
            f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
        )

    def _verify_stops(self) -> None:
        """Stop strings and regexes: non-empty, and few and short enough for every step's
        check to stay cheap (the MAX_STOP* limits); the regexes within MAX_STOP_REGEX_ITEMS
        unrolled, then compiled (in that order: compiling is what that limit bounds)."""
        check = self._check
        _check_count(self.stop, MAX_STOPS, "stop", "strings")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check_longest(self.stop, MAX_STOP_LENGTH, "stop")
        _check_count(self.stop_regex, MAX_STOP_REGEXES, "stop_regex", "patterns")
        check(all(self.stop_regex), "stop_regex", "must be non-empty patterns")
        _check_longest(self.stop_regex, MAX_STOP_REGEX_LENGTH, "stop_regex")
        items = sum(map(unrolled_size, self.stop_regex))
        if items > MAX_STOP_REGEX_ITEMS:
            raise SamplingParamsError(
                f"stop_regex: the patterns unroll to {items} items when compiled (x{{m}} is m "
                f"copies of x); at most {MAX_STOP_REGEX_ITEMS} are allowed",
                "stop_regex",
            )
        for pattern in self.stop_regex:
            try:
                regex.compile(pattern)  # the engine the stop check searches with
            except (regex.error, TypeError) as e:
                raise SamplingParamsError(
                    f"stop_regex {pattern!r} is not a valid regex: {e}", "stop_regex"
                ) from None
        check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative token ids",
        )

    def verify_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist in its vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamsError(
                    f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}",
                    name,
                )


def _check_count(values: list[str], limit: int, name: str, kind: str) -> None:
    if len(values) > limit:
        message = f"{name} has {len(values)} {kind}; at most {limit} are allowed"
        raise SamplingParamsError(message, name)


def _check_longest(values: list[str], limit: int, name: str) -> None:
    longest = max(values, key=len, default="")
    if len(longest) > limit:
        message = f"{name}: {longest[:24]!r}... has {len(longest)} characters; at most {limit}"
        raise SamplingParamsError(message + " are allowed", name)
