"""What the scheduler needs of constrained decoding, in one object.

- `attach(req)`: compile (cached) the request's constraint and give it a matcher; an invalid
  spec raises GrammarError before the request is queued.
- `start_masks(reqs)`: the allowed-token masks of the constrained requests, computed on a
  worker thread (llguidance releases the GIL) while the forward pass runs; `.result()`
  returns a (B, V) bool tensor, or None when no request in the batch is constrained.
- `accept(req, token, room)`: consume a sampled token and, with jump-forward on, extend it by
  the text the grammar forces (see `jump_forward`). Returns the tokens to append.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.config import GRAMMAR_BACKENDS
from radixserve.constrained.base import (
    Constraint,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    unpack_bitmask,
)
from radixserve.core.req import Req


@dataclass
class GrammarStats:
    mask_seconds: float = 0.0  # worker time spent computing masks
    mask_rows: int = 0  # constrained rows masked (one per sampled token)
    jumps: int = 0  # times jump-forward appended forced tokens
    jump_tokens: int = 0  # tokens appended by jump-forward (not sampled)
    retokenized: int = 0  # jumps where the sampled token itself was re-tokenized

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class MaskJob:
    """Masks being computed on the worker; `result()` waits for them."""

    def __init__(self, future: Future | None) -> None:
        self.future = future

    def result(self) -> torch.Tensor | None:
        return None if self.future is None else self.future.result()


class Grammars:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        backend: str = "llguidance",
        jump_forward: bool = True,
    ) -> None:
        if backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {backend!r}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.backend_name = backend
        self.jump_forward = jump_forward
        self.stats = GrammarStats()
        self._backend: GrammarBackend | None = None
        self._worker: ThreadPoolExecutor | None = None

    @property
    def backend(self) -> GrammarBackend:
        """Built on first use: wrapping the tokenizer takes about a second."""
        if self._backend is None:
            from radixserve.constrained.llguidance_backend import LLGuidanceBackend

            self._backend = LLGuidanceBackend(self.tokenizer, self.vocab_size)
        return self._backend

    def attach(self, req: Req) -> None:
        constraint = Constraint.of(req.params)
        if constraint is None:
            return
        if self.backend_name == "none":
            raise GrammarError(
                "constrained decoding is disabled on this server (--grammar-backend none)",
                constraint.kind,
            )
        req.grammar = self.backend.matcher(constraint)

    # -- masks ------------------------------------------------------------------------------
    def start_masks(self, reqs: list[Req]) -> MaskJob:
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return MaskJob(None)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        matchers = [reqs[i].grammar for i in rows]
        return MaskJob(self._worker.submit(self._masks, len(reqs), rows, matchers))

    def _masks(self, batch: int, rows: list[int], matchers: list[GrammarMatcher]) -> torch.Tensor:
        start = time.perf_counter()
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        self.backend.fill_masks(matchers, bitmask)
        allowed = torch.ones(batch, self.vocab_size, dtype=torch.bool)
        allowed[rows] = unpack_bitmask(bitmask, self.vocab_size)
        self.stats.mask_seconds += time.perf_counter() - start
        self.stats.mask_rows += len(rows)
        return allowed

    def completes(self, req: Req, text: str) -> bool:
        """Whether `text` alone is a complete document of the request's grammar."""
        constraint = Constraint.of(req.params)
        assert constraint is not None
        matcher = self.backend.matcher(constraint)
        return matcher.accept(self.backend.tokenize_bytes(text.encode())) and matcher.is_accepting

    # -- after sampling -----------------------------------------------------------------------
    def accept(self, req: Req, token: int, room: int) -> list[int] | None:
        """Consume `token` (None if the grammar refuses it); with jump-forward, the returned
        tokens also carry up to `room` - 1 forced ones."""
        matcher = req.grammar
        assert matcher is not None
        if not matcher.accept([token]):
            return None
        if not self.jump_forward or req.return_logprob or room <= 1 or matcher.is_finished:
            return [token]
        tokens = jump_forward(matcher, self.backend, token, room)
        if len(tokens) > 1 or tokens != [token]:
            self.stats.jumps += 1
            self.stats.jump_tokens += len(tokens) - 1
            self.stats.retokenized += tokens[0] != token
        return tokens


def jump_forward(
    matcher: GrammarMatcher, backend: GrammarBackend, token: int, room: int
) -> list[int]:
    """The sampled token plus the text the grammar now forces, as the model's tokenizer
    would write it (the paper's compressed FSM with retokenization); at most `room` tokens.

    The sampled token's bytes and the forced bytes are tokenized together, so a token that
    straddles the boundary (sampled `"`, forced `: ` → `":`, ` `) is the one the tokenizer
    makes. The last token is left for the model unless it ends the document: what follows
    could merge with it. The matcher ends in the state after the returned tokens.
    """
    forced = matcher.forced_bytes()
    if not forced:
        return [token]
    sampled = backend.token_bytes([token])
    tokens = backend.tokenize_bytes(sampled + forced)[:room]
    matcher.rollback(1)  # back to before the sampled token
    tokens = tokens[: matcher.valid_prefix(tokens)]
    if tokens and matcher.accept(tokens):
        if not matcher.is_finished:
            matcher.rollback(1)
            tokens = tokens[:-1]
        if tokens and len(backend.token_bytes(tokens)) > len(sampled):
            return tokens
        matcher.rollback(len(tokens))
    matcher.accept([token])  # nothing gained: keep the sampled token alone
    return [token]
