"""The in-process Engine API: the same scheduler as the server, driven by a background
thread, for offline batch work and tests.

    with radixserve.Engine() as engine:              # None = the default model
        out = engine.generate("The capital of France is", {"max_new_tokens": 16})

Calls from many threads (or `async_generate` from asyncio) are batched together: every
request goes to one scheduler thread, which runs continuous batching over all of them.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

from radixserve import __version__
from radixserve.config import Config
from radixserve.core.output import ReqOutput
from radixserve.core.req import Req
from radixserve.model.runner import ModelRunner
from radixserve.native import expand_request
from radixserve.output import RequestState
from radixserve.scheduler.scheduler import Scheduler

Sink = Callable[[ReqOutput | BaseException], None]


class EngineDeadError(RuntimeError):
    """The scheduler thread failed; the engine cannot serve more requests."""


class Engine:
    def __init__(self, model_path: str | None = None, progress: bool = True, **config: Any):
        self.config = Config.from_flat(model_path=model_path, **config)
        self.runner = ModelRunner(self.config, progress=progress)
        self.tokenizer = self.runner.tokenizer
        self.scheduler = Scheduler(
            self.runner, self.config.scheduler, page_size=self.config.cache.page_size
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="radixserve-scheduler", daemon=True)
        self._thread.start()

    # -- public API -----------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        priority: int | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """Native-API generation: one prompt gives a dict, a list gives a list (n > 1 gives
        n results per prompt); `stream=True` gives an iterator of cumulative results."""
        reqs, states, single = self._make_requests(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
            rid,
            priority,
            stream,
        )
        queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in reqs]
        for req, q in zip(reqs, queues):
            self._submit(req, q.put)
        if stream:
            return self._stream(states[0], queues[0])
        results = [self._collect(state, q) for state, q in zip(states, queues)]
        return results[0] if single else results

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        priority: int | None = None,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """`generate` for asyncio: awaitable result, or an async iterator when streaming."""
        reqs, states, single = self._make_requests(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
            rid,
            priority,
            stream,
        )
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in reqs]
        for req, q in zip(reqs, queues):
            self._submit(req, lambda item, q=q: loop.call_soon_threadsafe(q.put_nowait, item))
        if stream:
            return self._astream(states[0], queues[0])
        results = [await self._acollect(state, q) for state, q in zip(states, queues)]
        return results[0] if single else results

    def abort(self, rid: str | None = None) -> None:
        """Abort a request by rid, or every request (None)."""
        self._inbox.put(("abort", rid))

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing done) while requests are running."""
        return self._call(self.scheduler.flush_cache)

    def check_kv_accounting(self) -> None:
        self._call(self.scheduler.check_kv_accounting)

    def get_server_info(self) -> dict[str, Any]:
        state = self._call(self.scheduler.state)
        return {
            **self.config.to_flat(),
            **self.runner.info(),
            "version": __version__,
            "internal_states": [state],
        }

    def shutdown(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._inbox.put(("stop",))
            self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- requests -------------------------------------------------------------------------
    def _make_requests(
        self,
        prompt,
        sampling_params,
        input_ids,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        return_text_in_logprobs=False,
        rid=None,
        priority=None,
        stream=False,
    ) -> tuple[list[Req], list[RequestState], bool]:
        """Validated requests (one per prompt and per `n`), their result states, and whether
        the caller gets a single result rather than a list."""
        expanded = expand_request(
            self.tokenizer.encode,
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            rid,
            priority,
        )
        if stream and len(expanded.reqs) != 1:
            raise ValueError("stream=True takes a single prompt with n=1")
        states = [
            RequestState(
                req.rid,
                req.params,
                self.tokenizer,
                return_logprob,
                top_logprobs_num or 0,
                return_text_in_logprobs,
            )
            for req in expanded.reqs
        ]
        return expanded.reqs, states, expanded.single

    def _submit(self, req: Req, sink: Sink) -> None:
        if self._error is not None or self._stopped:
            raise EngineDeadError(f"the engine is not running: {self._error or 'shut down'}")
        self._inbox.put(("add", req, sink))

    @staticmethod
    def _apply(state: RequestState, item: ReqOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            raise item
        state.update(item)

    def _collect(self, state: RequestState, q: queue.SimpleQueue) -> dict:
        while not state.finished:
            self._apply(state, q.get())
        return state.result()

    def _stream(self, state: RequestState, q: queue.SimpleQueue) -> Iterator[dict]:
        while not state.finished:
            self._apply(state, q.get())
            yield state.result()

    async def _acollect(self, state: RequestState, q: asyncio.Queue) -> dict:
        while not state.finished:
            self._apply(state, await q.get())
        return state.result()

    async def _astream(self, state: RequestState, q: asyncio.Queue) -> AsyncIterator[dict]:
        while not state.finished:
            self._apply(state, await q.get())
            yield state.result()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the scheduler thread (the scheduler is not thread-safe)."""
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        future: Future = Future()
        self._inbox.put(("call", fn, future))
        return future.result()

    # -- the scheduler thread -------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                block = not self.scheduler.has_work
                while True:
                    try:
                        msg = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    if msg[0] == "stop":
                        self._fail_all(EngineDeadError("the engine was shut down"))
                        return
                    self._handle(msg)
                    block = False
                if self.scheduler.has_work:
                    for out in self.scheduler.step():
                        sink = self._sinks.get(out.rid)
                        if sink is not None:
                            sink(out)
                        if out.finish_reason is not None:
                            self._sinks.pop(out.rid, None)
        except BaseException as e:  # the thread must never die silently
            self._error = e
            self._fail_all(EngineDeadError(f"the scheduler failed: {e!r}"))
            raise

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            _, req, sink = msg
            try:
                if req.rid in self._sinks:
                    raise ValueError(f"a request with rid {req.rid!r} is already running")
                self.scheduler.add_request(req)
            except ValueError as e:
                sink(e)
                return
            self._sinks[req.rid] = sink
        elif kind == "abort":
            self.scheduler.abort(msg[1])
        elif kind == "call":
            _, fn, future = msg
            try:
                future.set_result(fn())
            except Exception as e:  # handed to the caller, who re-raises it
                future.set_exception(e)

    def _fail_all(self, error: BaseException) -> None:
        for sink in self._sinks.values():
            sink(error)
        self._sinks.clear()
        while True:  # callers blocked on _call must not hang
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "call":
                msg[2].set_exception(error)
            elif msg[0] == "add":
                msg[2](error)
