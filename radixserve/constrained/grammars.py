"""What the scheduler needs of constrained decoding, in one object.

- `attach(req)`: give the request the matcher of its constraint, at once when the constraint
  is compiled already (an invalid one it refused raises GrammarError before the request is
  queued); else the request waits while its grammar compiles on a thread of its own, and
  `compiled()` hands it back, with its matcher or the error that refuses it. Compiling
  (0.3 s for a pathological regex, a second for the first grammar, which wraps the
  tokenizer) so never stalls the running requests' steps; llguidance releases the GIL.
- `start_masks(reqs)`: the allowed-token masks of the constrained requests, computed on a
  worker thread (llguidance releases the GIL) while the forward pass runs; `.result()`
  returns a (B, V) bool tensor, or None when no request in the batch is constrained.
- `accept(req, token, room)`: consume a sampled token and, with jump-forward on, extend it by
  the text the grammar forces (see `jump_forward`). Returns the tokens to append.
"""

from __future__ import annotations

import logging
import os
import threading
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

logger = logging.getLogger(__name__)

COMPILE_NICENESS = 10  # added to the compile thread's nice value


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
        self._backend_lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None  # computes masks
        self._compiling: dict[str, tuple[Req, Future[GrammarMatcher]]] = {}
        self._compiler: ThreadPoolExecutor | None = None  # compiles grammars
        if backend != "none":  # and first builds the backend, before any request needs it
            self._compiler = ThreadPoolExecutor(
                1, thread_name_prefix="grammar-compile", initializer=_yield_to_the_model
            )
            self._compiler.submit(lambda: self.backend)

    @property
    def backend(self) -> GrammarBackend:
        """Built once, on the compile thread from the start (wrapping the tokenizer takes
        0.3 s for a 49k vocabulary, mostly holding the GIL)."""
        with self._backend_lock:
            if self._backend is None:
                from radixserve.constrained.llguidance_backend import LLGuidanceBackend

                self._backend = LLGuidanceBackend(self.tokenizer, self.vocab_size)
            return self._backend

    def attach(self, req: Req) -> bool:
        """Give `req` its matcher: True once it has one (or needs none); False while its
        grammar compiles (see `compiled`). Raises GrammarError for a refused constraint."""
        constraint = Constraint.of(req.params, req.think)
        if constraint is None:
            return True
        if self.backend_name == "none":
            raise GrammarError(
                "constrained decoding is disabled on this server (--grammar-backend none)",
                constraint.kind,
            )
        if self._backend is not None:
            req.grammar = self._backend.ready_matcher(constraint)
            if req.grammar is not None:
                return True
        assert self._compiler is not None
        self._compiling[req.rid] = (req, self._compiler.submit(self._compile, constraint))
        return False

    def _compile(self, constraint: Constraint) -> GrammarMatcher:
        try:
            return self.backend.matcher(constraint)
        except GrammarError:
            raise
        except Exception as e:  # a fault of the backend on this one grammar: refuse it alone
            logger.exception("compiling a %s failed", constraint.kind)
            message = f"invalid {constraint.kind}: the grammar backend failed on it: {e}"
            raise GrammarError(message, constraint.kind) from e

    def compiled(self) -> list[tuple[Req, GrammarError | None]]:
        """The requests whose grammar finished compiling, each with the error that refuses
        it, or None and its matcher attached."""
        done = []
        for rid, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            error = future.exception()
            if error is None:
                req.grammar = future.result()
            done.append((req, error))
        return done

    @property
    def compiling(self) -> list[Req]:
        """The requests waiting for their grammar, in arrival order."""
        return [req for req, _ in self._compiling.values()]

    def forget(self, req: Req) -> None:
        """Stop waiting for the request's grammar (it was aborted); the compile goes on, and
        its result is cached for the next request that needs it."""
        self._compiling.pop(req.rid, None)

    def close(self) -> None:
        for worker in (self._compiler, self._worker):
            if worker is not None:
                worker.shutdown(wait=False, cancel_futures=True)

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
        constraint = Constraint.of(req.params, req.think)
        assert constraint is not None
        matcher = self.backend.matcher(constraint)
        return matcher.accept(self.backend.tokenize_bytes(text.encode())) and matcher.is_accepting

    # -- after sampling -----------------------------------------------------------------------
    def accept(self, req: Req, token: int, room: int) -> list[int] | None:
        """Consume `token` (None if the grammar refuses it); with jump-forward, the returned
        tokens also carry up to `room` - 1 forced ones (not for a request that reports each
        token's logprobs or each position's hidden state: forced tokens that end it would
        never run)."""
        matcher = req.grammar
        assert matcher is not None
        if not matcher.accept([token]):
            return None
        reports = req.return_logprob or req.return_hidden_states
        if not self.jump_forward or reports or room <= 1 or matcher.is_finished:
            return [token]
        tokens = jump_forward(matcher, self.backend, token, room)
        if len(tokens) > 1 or tokens != [token]:
            self.stats.jumps += 1
            self.stats.jump_tokens += len(tokens) - 1
            self.stats.retokenized += tokens[0] != token
        return tokens


def _yield_to_the_model() -> None:
    """The compile thread runs at a lower priority (Linux nice +10 on this thread alone):
    on a machine with as many cores as the model's threads (2 here), a compile competing
    for a core would slow every step of the running batch (a parallel matmul waits for its
    slowest thread); this way it mostly takes the time the forward leaves."""
    try:
        thread = threading.get_native_id()
        niceness = os.getpriority(os.PRIO_PROCESS, thread) + COMPILE_NICENESS
        os.setpriority(os.PRIO_PROCESS, thread, min(niceness, 19))
    except (AttributeError, OSError):  # not Linux, or not allowed: run at the usual priority
        pass


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
