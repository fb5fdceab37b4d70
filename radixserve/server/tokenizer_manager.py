"""The main process's side of the engine: tokenizes requests, sends them to the scheduler,
and routes the detokenizer's results back to the HTTP handler waiting for each request.

Every request is registered in `pending` until its final result; if the HTTP side goes
away first (client disconnect, error), `Call.close` aborts what is still running so its KV
is freed, and its entry stays, abandoned, until the scheduler's last word on it arrives: so
a new request cannot take its rid while outputs of the old one are still on their way.
When the scheduler or detokenizer dies, `fail_all` ends every waiter with 503.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from radixserve.chat_roles import ChatRoles
from radixserve.core.output import ModelInfo, SchedulerStats, StrOut
from radixserve.core.req import Req, draw_seed
from radixserve.native import InvalidRequest, given_rids, named_by
from radixserve.output import ResultAccumulator, ResultUpdate
from radixserve.sampling_defaults import model_sampling_defaults
from radixserve.server.dispatcher import Dispatcher
from radixserve.server.errors import REJECTION_STATUS, APIError, EngineUnavailable, bad_request
from radixserve.server.ipc import AsyncReceiver
from radixserve.server.messages import (
    AbortReq,
    CacheEvents,
    ControlReply,
    ControlReq,
    Failed,
    GenerateReq,
    ModelFolder,
    Ready,
    Rejected,
    SchedulerState,
    StrOutBatch,
)
from radixserve.server.metrics import Metrics
from radixserve.server.request_log import RequestLog

logger = logging.getLogger(__name__)


@dataclass
class _Track:
    """One running sequence as the main process sees it."""

    call: Call
    index: int
    results: ResultAccumulator
    start: float = field(default_factory=time.perf_counter)
    last: float | None = None  # when its latest tokens arrived
    tokens: int = 0
    abandoned: bool = False  # its call closed; its outputs go nowhere until the last one


class Call:
    """The sequences of one HTTP request; results arrive on one queue as (index, update):
    each update carries its `text_delta` and the cumulative native `result` as of it."""

    def __init__(self, manager: TokenizerManager, reqs: list[Req], names: frozenset[str]) -> None:
        self.manager = manager
        self.reqs = reqs
        self.names = names  # the rids the client gave (its sequences' are derived from them)
        self.queue: asyncio.Queue[tuple[int, ResultUpdate] | APIError] = asyncio.Queue()
        self.unfinished = {req.rid for req in reqs}

    async def stream(self) -> AsyncIterator[tuple[int, ResultUpdate]]:
        """(index, output) as they come, until every sequence has finished. Outputs that
        queued up while the reader was busy (a slow client, a loaded event loop) come as
        one, each sequence's latest (its result is cumulative): a stream that lags catches
        up in fewer, larger chunks rather than falling further behind."""
        while self.unfinished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            for item in _latest_each(items):
                if isinstance(item, APIError):
                    raise item
                index, out = item
                if out.finished:
                    self.unfinished.discard(out.rid)
                yield index, out

    async def results(self) -> list[dict[str, Any]]:
        """The final native result of every sequence, in request order."""
        final: list[dict[str, Any] | None] = [None] * len(self.reqs)
        async for index, out in self.stream():
            if out.finished:
                final[index] = out.result
        return final  # type: ignore[return-value]

    def close(self) -> None:
        """Abort whatever has not finished (the client left or an error ended the call)."""
        for rid in self.unfinished:
            track = self.manager.pending.get(rid)
            if track is not None and not track.abandoned:
                track.abandoned = True
                self.manager.send_abort(rid, "the client disconnected")
        self.unfinished.clear()


def _latest_each(
    items: list[tuple[int, ResultUpdate] | APIError],
) -> list[tuple[int, ResultUpdate] | APIError]:
    """Queued outputs with each sequence's earlier ones dropped for its latest, which takes
    the place of its first; an error stays where it came (nothing after it is read)."""
    merged: list[tuple[int, ResultUpdate] | APIError] = []
    where: dict[int, int] = {}
    for item in items:
        if isinstance(item, APIError):
            merged.append(item)
            break
        if item[0] in where:
            merged[where[item[0]]] = item
        else:
            where[item[0]] = len(merged)
            merged.append(item)
    return merged


@dataclass
class _Gather:
    """A control request's replies, one per scheduler replica."""

    future: asyncio.Future
    expected: int
    replies: list[ControlReply] = field(default_factory=list)


class TokenizerManager:
    """`to_scheduler` routes requests to the scheduler replicas (one without data
    parallelism) and mirrors their caches (`Dispatcher`)."""

    def __init__(self, to_scheduler: Dispatcher, metrics: Metrics) -> None:
        self.tokenizer: Any = None  # loaded by the launcher while the children start
        self.chat_roles: ChatRoles | None = None  # read off its chat template, with it
        self.request_log: RequestLog | None = None  # --log-requests (set with the tokenizer)
        # the most characters one token stands for (set with the tokenizer; None: not known)
        self.longest_token: int | None = None
        # what the OpenAI routes take for the sampling a request leaves unset
        # (--sampling-defaults model: the model folder's generation_config.json, read with
        # the tokenizer and again when the weights come from another folder)
        self.sampling_defaults: dict[str, Any] = {}
        self.model_sampling_defaults = False  # --sampling-defaults model
        # where the scheduler found the model, before it loads it (the launcher waits on it)
        self.model_folder: asyncio.Future[Path] = asyncio.get_running_loop().create_future()
        self.info: ModelInfo | None = None  # from the scheduler's Ready
        self.weight_version = "default"  # as the latest weight update named it (SGLang's)
        self.paused: str | None = None  # the mode of /pause_generation until it continues
        replicas = {f"scheduler{i}" for i in range(to_scheduler.size)}
        self.starting = {"detokenizer", *replicas}  # processes not ready yet
        self.to_scheduler = to_scheduler
        self.metrics = metrics
        self.pending: dict[str, _Track] = {}
        self.controls: dict[int, _Gather] = {}
        self.call_ids = itertools.count()
        self.dead: str | None = None  # why the engine is gone
        self.draining = False

    @property
    def ready(self) -> bool:
        return not self.starting and self.tokenizer is not None

    @property
    def context_len(self) -> int:
        """The longest sequence (prompt + output) a request may have."""
        assert self.info is not None, "the scheduler has not reported ready"
        return self.info.max_seq_len

    def on_ready(self, msg: Ready) -> None:
        if msg.role.startswith("scheduler") and msg.info is not None:
            self.info = msg.info
        self.starting.discard(msg.role)

    def weights_updated(self, folder: str | None, version: str | None) -> None:
        """The schedulers serve the weights of `folder` now (named `version`, if given)."""
        assert self.info is not None
        if folder is not None:
            self.info = msgspec.structs.replace(self.info, model_path=folder)
            if self.model_sampling_defaults:  # (a small file: read on the event loop)
                self.sampling_defaults = model_sampling_defaults(Path(folder))
        if version is not None:
            self.weight_version = version

    # -- requests -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s tokens; a text with more characters than the context's tokens could stand
        for is refused before it is tokenized (which takes ~0.5-1 us a character): an
        InvalidRequest about the field `text`, whatever the API calls it."""
        # twice the bound: a normalizer may merge characters (NFC composes accents)
        longest = self.longest_token
        if longest is not None and len(text) > self.context_len * longest * 2:
            raise InvalidRequest(
                f"This model's maximum context length is {self.context_len} tokens. However, "
                f"a text of {len(text)} characters is more than that many tokens of at most "
                f"{longest} characters can hold. Please reduce the prompt.",
                "text",
                code="context_length_exceeded",
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_context(self, req: Req) -> None:
        prompt, new = len(req.input_ids), req.params.max_new_tokens
        if prompt + new > self.context_len:
            raise bad_request(
                f"This model's maximum context length is {self.context_len} tokens. However, "
                f"you requested {prompt + new} tokens ({prompt} in the prompt, {new} for the "
                "completion). Please reduce the prompt or the completion length.",
                code="context_length_exceeded",
            )

    def submit(
        self,
        reqs: list[Req],
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        service_tier: str | None = None,
    ) -> Call:
        """Send the sequences to the scheduler; the caller must `close()` the call. `rid`:
        what the client named the request (n > 1 and a batch name their sequences
        `{rid}_{i}`), for `abort_request`. `service_tier` "flex" defers them (core/req.py)."""
        self.check_available()
        for req in reqs:
            self.check_context(req)
            draw_seed(req)
            req.deferred = service_tier == "flex"
            track = self.pending.get(req.rid)
            if track is not None:
                state = "still being aborted" if track.abandoned else "already running"
                raise bad_request(f"a request with rid {req.rid!r} is {state}", "rid")
        call = Call(self, reqs, given_rids(rid))
        for index, req in enumerate(reqs):
            results = ResultAccumulator(
                req.rid, req.return_logprob, req.top_logprobs_num, bool(req.token_ids_logprob)
            )
            self.pending[req.rid] = _Track(call, index, results)
            self.to_scheduler.send(GenerateReq.from_req(req, return_text_in_logprobs, stream))
            if self.request_log is not None:
                self.request_log.sent(req)
        return call

    def check_available(self) -> None:
        if not self.ready:
            raise EngineUnavailable("the server is starting: the model is still loading")
        if self.dead is not None:
            raise EngineUnavailable(f"the engine is not running: {self.dead}")
        if self.draining:
            raise EngineUnavailable("the server is shutting down and takes no new requests")

    def abort_request(self, rid: str) -> None:
        """Abort what the client named `rid`: the sequence of that rid, or every sequence of
        the request it gave that rid (`{rid}_{i}`, as SGLang aborts them)."""
        named = [seq for seq, track in self.pending.items() if named_by(seq, rid, track.call.names)]
        for seq in named or [rid]:  # not here (yet): the scheduler drops it if it comes
            self.send_abort(seq)

    def send_abort(self, rid: str | None, message: str = "aborted by the client") -> None:
        if self.dead is None:
            self.to_scheduler.send(AbortReq(rid, message))

    def send_control(self, op: str, args: dict[str, Any]) -> None:
        """A control request whose answers nobody waits for (undoing a load that failed)."""
        if self.dead is None:
            self.to_scheduler.send(ControlReq(next(self.call_ids), op, args))

    async def control(
        self,
        op: str,
        timeout: float = 30.0,
        args: dict[str, Any] | None = None,
        late: str = "a long step is running; retry later",
    ) -> list[Any]:
        """Every replica's answer to a control request, in replica order; after `timeout`
        seconds a 503 (`late` says why, and what to do)."""
        self.check_available()
        call_id = next(self.call_ids)
        future = asyncio.get_running_loop().create_future()
        self.controls[call_id] = _Gather(future, self.to_scheduler.size)
        self.to_scheduler.send(ControlReq(call_id, op, args or {}))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise EngineUnavailable(
                f"the scheduler did not answer {op} within {timeout:g} s ({late})"
            ) from None
        finally:
            self.controls.pop(call_id, None)

    # -- results --------------------------------------------------------------------------
    async def receive_loop(self, receiver: AsyncReceiver) -> None:
        while True:
            try:
                msg = await receiver.recv()
            except msgspec.DecodeError as e:  # a bug in a peer: say so, keep serving
                logger.error("dropping a message that does not decode: %s", e)
                continue
            if isinstance(msg, StrOutBatch):
                for out in msg.outputs:
                    self._on_output(out)
            elif isinstance(msg, Rejected):
                self._on_rejected(msg)
            elif isinstance(msg, ControlReply):
                self._on_control_reply(msg)
            elif isinstance(msg, Ready):
                self.on_ready(msg)
            elif isinstance(msg, ModelFolder):
                if not self.model_folder.done():  # every replica names the same folder
                    self.model_folder.set_result(Path(msg.folder))
            elif isinstance(msg, CacheEvents):
                self.to_scheduler.on_cache_events(msg.replica, msg.changes)
            elif isinstance(msg, Failed):
                when = "failed" if msg.started else "failed to start"
                self.fail_all(f"the {msg.role} {when}: {msg.message}")
            elif isinstance(msg, SchedulerState):
                self.metrics.set_scheduler_state(msg.stats)
            else:
                logger.warning("ignoring an unexpected %s", type(msg).__name__)

    def _on_output(self, out: StrOut) -> None:
        track = self.pending.get(out.rid)
        if track is None:
            return
        if track.abandoned:  # its client left: nothing to deliver, the last output frees the rid
            if out.finish_reason is not None:
                del self.pending[out.rid]
                self.to_scheduler.done(out.rid)
                if self.request_log is not None:
                    seconds = time.perf_counter() - track.start
                    self.request_log.ended(out, seconds, track.results.pieces, "its client left")
            return
        now = time.perf_counter()
        self._observe_tokens(track, out.completion_tokens, now)
        if out.finish_reason is None:
            track.call.queue.put_nowait((track.index, track.results.add(out)))
            return
        del self.pending[out.rid]
        self.to_scheduler.done(out.rid)
        self.metrics.requests.labels(out.finish_reason.type).inc()
        if out.finish_reason.type == "error":
            self._on_error(out.rid, track, out.finish_reason.message or "internal error")
            return
        self.metrics.e2e.observe(now - track.start)
        self.metrics.prompt_tokens.inc(out.prompt_tokens)
        self.metrics.cached_tokens.inc(out.cached_tokens)
        track.call.queue.put_nowait((track.index, track.results.add(out, now - track.start)))
        if self.request_log is not None:
            self.request_log.ended(out, now - track.start, track.results.pieces)

    def _observe_tokens(self, track: _Track, completion_tokens: int, now: float) -> None:
        new = completion_tokens - track.tokens
        if new <= 0:
            return
        if track.last is None:
            self.metrics.ttft.observe(now - track.start)
        else:
            for _ in range(new):
                self.metrics.itl.observe((now - track.last) / new)
        self.metrics.generated_tokens.inc(new)
        track.tokens, track.last = completion_tokens, now

    def _on_error(self, rid: str, track: _Track, message: str) -> None:
        """An error confined to one request (its detokenization failed): its call ends with
        a 500; the abort frees its KV if the scheduler still runs it (a no-op otherwise)."""
        logger.error("request %s failed: %s", rid, message)
        if self.request_log is not None:
            self.request_log.failed(rid, message)
        self.send_abort(rid, message)
        track.call.queue.put_nowait(APIError(500, message))

    def _on_rejected(self, msg: Rejected) -> None:
        track = self.pending.pop(msg.rid, None)
        self.to_scheduler.done(msg.rid)
        if self.request_log is not None:
            self.request_log.refused(msg.rid, msg.message)
        if track is not None:
            status = REJECTION_STATUS[msg.kind]
            track.call.queue.put_nowait(APIError(status, msg.message, param=msg.param))

    def _on_control_reply(self, msg: ControlReply) -> None:
        gather = self.controls.get(msg.call_id)
        if gather is None or gather.future.done():
            if msg.update is not None and msg.update.success:  # its route gave up waiting
                # (timed out): what the scheduler serves now, all the same
                self.weights_updated(msg.update.model_path, msg.update.weight_version)
            return
        gather.replies.append(msg)
        if len(gather.replies) < gather.expected:
            return
        errors = [r.error for r in gather.replies if r.error is not None]
        if errors:
            gather.future.set_exception(APIError(500, "; ".join(errors)))
            return
        refused = list(dict.fromkeys(r.refused for r in gather.replies if r.refused))
        if refused:
            gather.future.set_exception(bad_request("; ".join(refused)))
            return
        results = [r.update or r.lora or r.result for r in gather.replies]
        if all(isinstance(r, SchedulerStats) for r in results):
            results = [r.as_dict() for r in sorted(results, key=lambda r: r.dp_rank)]
        gather.future.set_result(results)

    def fail_all(self, reason: str) -> None:
        """The engine is gone: every waiter ends with a 503 naming why."""
        self.dead = reason
        for rid, track in self.pending.items():
            track.call.queue.put_nowait(EngineUnavailable(f"the engine stopped: {reason}"))
            if self.request_log is not None:
                self.request_log.failed(rid, f"the engine stopped: {reason}")
        self.pending.clear()
        for gather in self.controls.values():
            if not gather.future.done():
                gather.future.set_exception(EngineUnavailable(f"the engine stopped: {reason}"))
