"""The grammar backend interface.

A backend compiles a `Constraint` (JSON schema, regex or EBNF) once per distinct spec and
makes one `GrammarMatcher` per request. A matcher is the request's position in its grammar:
it fills the request's row of a token bitmask (bit t of word t // 32 set = token t allowed),
consumes the tokens appended to the output, can be rolled back, and reports the bytes the
grammar forces next (what jump-forward appends without decoding).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.core.sampling_params import CONSTRAINTS, SamplingParams, ThinkBlock


class GrammarError(ValueError):
    """A constraint the backend cannot honour (invalid or unsupported); a 400 at the edge,
    naming the constraint's field (regex, json_schema or ebnf)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of core.sampling_params.CONSTRAINTS
    spec: str  # the JSON schema as a JSON string, the regex, or the grammar text
    think: ThinkBlock | None = None  # a block of free reasoning first, then the spec

    @classmethod
    def of(cls, params: SamplingParams, think: ThinkBlock | None = None) -> Constraint | None:
        """The constraint a request's sampling parameters carry, if any (`SamplingParams`
        already refuses more than one), after a block of reasoning where `think` says so."""
        given = [(k, getattr(params, k)) for k in CONSTRAINTS if getattr(params, k)]
        if not given:
            return None
        kind, spec = given[0]
        if kind == "json_schema" and not isinstance(spec, str):
            spec = json.dumps(spec)
        return cls(kind, spec, think)


class GrammarMatcher(ABC):
    """One request's state in its grammar."""

    @abstractmethod
    def accept(self, tokens: Sequence[int]) -> bool:
        """Consume tokens; False (and nothing consumed) if the grammar refuses any of them."""

    @abstractmethod
    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens the grammar would accept now (nothing is consumed)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens consumed."""

    @abstractmethod
    def forced_bytes(self) -> bytes:
        """The bytes every continuation must start with (empty if there is a choice)."""

    @property
    @abstractmethod
    def is_finished(self) -> bool:
        """The document is complete and nothing but end-of-sequence may follow."""

    @property
    @abstractmethod
    def is_accepting(self) -> bool:
        """The output so far is a complete document (it may still be extended)."""

    @property
    def error(self) -> str:
        """What the backend says went wrong in this matcher, or "" (nothing, or not said)."""
        return ""


class GrammarBackend(ABC):
    """Compiles constraints and computes masks for a batch of matchers."""

    vocab_size: int

    @abstractmethod
    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher, compiling the constraint unless it is cached; raises GrammarError
        naming the problem if the spec is invalid."""

    @abstractmethod
    def ready_matcher(self, constraint: Constraint) -> GrammarMatcher | None:
        """A fresh matcher if the constraint is compiled already (no compiling here), else
        None; raises GrammarError if it was refused."""

    @abstractmethod
    def fill_masks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Row i of bitmask (B, ceil(V / 32)) int32 := the tokens matchers[i] allows now."""

    @abstractmethod
    def token_bytes(self, tokens: Sequence[int]) -> bytes:
        """The bytes these tokens stand for."""

    @abstractmethod
    def tokenize_bytes(self, data: bytes) -> list[int]:
        """The model tokenizer's tokens for these bytes."""


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, W) int32 words → (B, vocab_size) bool, True where the token is allowed.

    Little-endian bytes of word w hold tokens 32w..32w+31 in order, so one lookup of each
    byte in a 256 × 8 table unpacks the whole mask."""
    rows = bitmask.shape[0]
    table = _BYTE_BITS.to(bitmask.device)
    return table[bitmask.contiguous().view(torch.uint8).long()].view(rows, -1)[:, :vocab_size]


_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # (256, 8)
