"""The scheduler loop, one for both transports: receive messages, admit or refuse new
requests, run a step, send its outputs, publish the state now and then.

The transport is injected: ZMQ sockets in the server's scheduler process
(`server/scheduler_process.py`), in-memory queues on the Engine's thread (`engine.py`).
The rules on incoming requests — the queue bound, unique rids, what can run at all — are
applied here and nowhere else, as typed errors (`core/errors.py`) sent back as `Rejected`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Protocol

from radixserve.cache.radix_cache import CacheEventLog
from radixserve.core.errors import DuplicateRid, InvalidRequest, QueueFull, RequestRejected
from radixserve.core.messages import (
    AbortReq,
    CacheEvents,
    ControlReply,
    ControlReq,
    GenerateReq,
    Message,
    PauseMode,
    Rejected,
    SchedulerState,
    WeightUpdate,
)
from radixserve.core.output import ReqOutput, SchedulerStats
from radixserve.scheduler.profiler import ProfileRefused, StepProfiler
from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle loop waits for a message before checking `alive`
GRAMMAR_POLL_S = 0.002  # how long it waits when its only requests wait for their grammar
LOAD_POLL_S = 0.01  # how long an idle loop waits while a LoRA adapter is read
STATE_INTERVAL_S = 0.2  # most frequent SchedulerState publication


class Transport(Protocol):
    def receive(self, timeout_s: float) -> list[Message]:
        """Every message already queued; when none is, wait up to `timeout_s` for one."""
        ...

    def send_outputs(self, outputs: list[ReqOutput]) -> None: ...

    def accepted(self, msg: GenerateReq) -> None:
        """The request was queued (before any of its outputs is sent)."""
        ...

    def reply(self, msg: Rejected | ControlReply | SchedulerState | CacheEvents) -> None: ...

    def alive(self) -> bool:
        """False once the loop must stop (the parent died, the Engine shut down)."""
        ...


class SchedulerLoop:
    """`dp_rank`: this loop's replica under data parallelism; `report_cache`: send the radix
    tree's inserts and evictions (`CacheEvents`) for the dispatcher's cache-aware view."""

    def __init__(
        self,
        scheduler: Scheduler,
        transport: Transport,
        max_queued: int,
        dp_rank: int = 0,
        report_cache: bool = False,
        decode_log_interval: int = 40,
    ) -> None:
        self.scheduler = scheduler
        self.decode_log_interval = decode_log_interval  # (0: no decode lines)
        self.decode_steps = 0
        self._logged = (time.monotonic(), 0)  # (when, output tokens) of the last decode line
        self.transport = transport
        self.max_queued = max_queued
        self.dp_rank = dp_rank
        self.cache_events: CacheEventLog | None = None
        tree = scheduler.kv.tree
        if report_cache and tree is not None:
            self.cache_events = tree.events = CacheEventLog()
        self.decode_loop_seconds = 0.0  # loop iterations that decoded, receiving + sending too
        self._last_state: SchedulerStats | None = None
        self._last_state_time = 0.0
        self._mapping = True  # KV pool pages may be left to map when idle (map_idle_pages)
        # requests admitted while their grammar compiles: accepted, or refused, once it has
        self._compiling: dict[str, GenerateReq] = {}
        # a weight update waits for the live requests to end; requests that come after it
        # wait for it (they run on the new weights)
        self._update: ControlReq | None = None
        self._after_update: list[GenerateReq] = []
        # pause_generation's mode while generation is paused (nothing steps; requests queue
        # and aborts end them), None while it runs
        self.paused: PauseMode | None = None
        self.profiler = StepProfiler(dp_rank)  # /start_profile's
        self.step_started: float | None = None  # when the running step began (monotonic)

    def run(self) -> None:
        try:
            while self.transport.alive():
                self.run_once()
        finally:
            if self.profiler.active:  # a profile still running is written, not lost
                try:
                    logger.info("stopping: the profile's trace is %s", self.profiler.stop())
                except Exception:
                    logger.exception("the running profile could not be written")
            self.scheduler.close()

    def run_once(self) -> None:
        scheduler = self.scheduler
        if self.stepping or self._mapping:  # (mapping goes on while paused: nothing steps)
            wait = 0.0
        else:  # (while paused, queued requests wait for continue_generation)
            wait = GRAMMAR_POLL_S if scheduler.grammars.compiling else IDLE_WAIT_S
            wait = min(wait, LOAD_POLL_S) if scheduler.adapters.loading else wait
        messages = self.transport.receive(wait)
        start = time.perf_counter()
        for msg in messages:
            self.handle(msg)
        if self._compiling:
            self.settle_compiled()
        if self._update is not None and self.may_update():
            self.update_weights()
        if scheduler.adapters.loading:  # LoRA adapters being read: installed once read
            for reply in scheduler.adapters.finish_loads():
                self.transport.reply(reply)
        if scheduler.adapters.unloading:  # LoRA unloads waiting for their requests to end
            for reply in scheduler.adapters.settle([*scheduler.live(), *self._after_update]):
                self.transport.reply(reply)
        if self._mapping and not messages and not self.stepping:
            self._mapping = scheduler.map_idle_pages()
        if self.paused is not None:  # nothing steps; an abort still ends its request
            self.send(scheduler.settle_aborts())
        elif scheduler.has_work:
            step_start = time.perf_counter()
            self.step_started = time.monotonic()  # (for the watchdog)
            try:
                outputs = scheduler.step()
            finally:
                self.step_started = None
            if self.profiler.active:
                self.profiler.after_step()  # (writes the trace after its num_steps)
            decoded = scheduler.last_step == "decode"
            if decoded:  # where decode time goes, for the benchmarks
                scheduler.stats.decode_step_seconds += time.perf_counter() - step_start
            self.send(outputs)
            if decoded:
                self.decode_loop_seconds += time.perf_counter() - start
            if logger.isEnabledFor(logging.INFO):
                self.log_batch()
        scheduler.keep_alive()
        self.publish_cache_events()
        self.publish_state()

    def log_batch(self) -> None:
        """SGLang's lines: each prefill batch, and one decode step in
        --decode-log-interval (its throughput: output tokens since the previous line)."""
        scheduler = self.scheduler
        kind = scheduler.last_step
        if kind == "decode":
            self.decode_steps += 1
            interval = self.decode_log_interval
            if interval <= 0 or self.decode_steps % interval:
                return
        elif kind not in ("prefill", "mixed"):
            return
        used, total = scheduler.kv.used_slots(), scheduler.info.max_total_num_tokens
        usage = used / max(total, 1)
        running, queued = len(scheduler.running), len(scheduler.waiting)
        if kind == "decode":
            now, tokens = time.monotonic(), scheduler.stats.generated_tokens
            then, before = self._logged
            self._logged = (now, tokens)
            rate = (tokens - before) / (now - then) if now > then else 0.0
            logger.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                "gen throughput (token/s): %.2f, #queue-req: %d",
                running, used, usage, rate, queued,
            )  # fmt: skip
            return
        seqs, tokens, cached = scheduler.last_prefill
        logger.info(
            "Prefill batch%s. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: "
            "%.2f, #running-req: %d, #queue-req: %d",
            " (with the running requests' decode)" if kind == "mixed" else "", seqs, tokens,
            cached, usage, running, queued,
        )  # fmt: skip

    @property
    def stepping(self) -> bool:
        """A forward pass has work: requests may step, and generation is not paused."""
        return self.scheduler.can_step and self.paused is None

    def send(self, outputs: list[ReqOutput]) -> None:
        if not outputs:
            return
        for out in outputs:  # aborted while its grammar compiled: accepted first
            if out.rid in self._compiling:
                self.transport.accepted(self._compiling.pop(out.rid))
        self.transport.send_outputs(outputs)

    def publish_cache_events(self) -> None:
        """The tree's changes, each under the uids of the adapters whose namespace it is in
        (those of an adapter since unloaded are dropped: the dispatcher has dropped its
        mirror of them)."""
        if not self.cache_events:
            return
        uids = self.scheduler.adapters.namespaces()
        changes = [
            (uid, tokens, keep)
            for key, tokens, keep in self.cache_events.take()
            for uid in uids.get(key, ())
        ]
        if changes:
            self.transport.reply(CacheEvents(self.dp_rank, changes))

    def handle(self, msg: Message) -> None:
        if isinstance(msg, GenerateReq):
            if self._update is None:
                self.add(msg)
            elif len(self._after_update) >= self.max_queued:
                error = QueueFull(
                    f"{self.max_queued} requests already wait for a weight update to end "
                    "(--max-queued-requests); retry later"
                )
                self.transport.reply(Rejected(msg.rid, error.kind, str(error)))
            else:
                self._after_update.append(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg)
        elif isinstance(msg, ControlReq) and msg.op == "update_weights":
            self.wait_to_update(msg)
        elif isinstance(msg, ControlReq) and msg.op == "unload_lora_adapter":
            # answered once no live request uses it; a load it undoes, now
            abandoned = self.scheduler.adapters.unload(msg)
            if abandoned is not None:
                self.transport.reply(abandoned)
        elif isinstance(msg, ControlReq) and msg.op == "load_lora_adapter":
            refused = self.scheduler.adapters.load(msg)  # answered once read, or now
            if refused is not None:
                self.transport.reply(refused)
        elif isinstance(msg, ControlReq):
            self.transport.reply(self.control(msg))
        else:
            raise TypeError(f"the scheduler got an unexpected message {type(msg).__name__}")

    def abort(self, msg: AbortReq) -> None:
        waiting = [m for m in self._after_update if msg.rid is None or m.rid == msg.rid]
        for held in waiting:  # queued behind a weight update: admitted, to end at once
            self._after_update.remove(held)
            self.add(held)
        self.scheduler.abort(msg.rid, msg.message)

    def wait_to_update(self, msg: ControlReq) -> None:
        """A weight update runs once no request is live (`update_weights`), or while
        generation is paused once none holds K/V; with abort_all_requests, the live ones
        are aborted for it."""
        message = None
        if self._update is not None:
            message = "another weight update is waiting for the running requests to end"
        elif self.paused == "in_place" and self.scheduler.holds_kv:
            message = (
                "generation is paused in place, its running requests holding K/V of the "
                "current weights; pause with mode retract (or abort) to update them"
            )
        if message is not None:
            self.transport.reply(ControlReply(msg.call_id, update=WeightUpdate(False, message)))
            return
        self._update = msg
        if msg.args.get("abort_all_requests"):
            self.scheduler.abort(None, "aborted for a weight update")

    def may_update(self) -> bool:
        """The waiting weight update may run: no request is live, or generation is paused
        and none holds K/V (the queued ones run on the new weights once it continues)."""
        if self.paused is not None:
            return not self.scheduler.holds_kv
        return not self.scheduler.has_work

    def pause(self, mode: PauseMode) -> None:
        """SGLang's pause_generation: stop stepping until `continue_generation`; `abort`
        ends every live request first, `retract` takes the running ones back to the queue
        (their generated tokens kept; they prefill again on continuing), `in_place` keeps
        them as they are."""
        if mode == "abort":
            self.scheduler.abort(None, "aborted: generation paused")
        elif mode == "retract":
            count = self.scheduler.retract_all()
            logger.info("generation paused: %d running requests back in the queue", count)
        self.paused = mode

    def update_weights(self) -> None:
        """Apply the waiting weight update (no request is live), answer it, then admit the
        requests that came after it."""
        msg, self._update = self._update, None
        assert msg is not None
        after, self._after_update = self._after_update, []
        args = msg.args
        source = "the tensors given" if "named_tensors" in args else args["model_path"]
        try:
            if "named_tensors" in args:  # from the Engine's caller, in this process
                count = self.scheduler.update_weights_from_tensors(
                    args["named_tensors"], args.get("flush_cache", True)
                )
                folder = self.scheduler.info.model_path
                message = f"updated {count} tensors of the weights"
            else:
                folder = self.scheduler.update_weights(args["model_path"])
                message = f"loaded the weights of {folder}"
            version = args.get("weight_version")
            update = WeightUpdate(True, message, len(after), folder, version)
        except Exception as e:  # the old weights stay: say why, keep serving
            logger.warning("the weight update from %s failed: %s", source, e)
            update = WeightUpdate(False, str(e), len(after))
        self.transport.reply(ControlReply(msg.call_id, update=update))
        for queued in after:
            self.add(queued)

    def add(self, msg: GenerateReq) -> None:
        try:
            queued = self.admit(msg)
        except RequestRejected as e:
            self.transport.reply(Rejected(msg.rid, e.kind, str(e), e.param))
            return
        if queued:
            self.transport.accepted(msg)
        else:
            self._compiling[msg.rid] = msg

    def settle_compiled(self) -> None:
        """Accept the requests whose grammar compiled; refuse those whose grammar did not,
        as an invalid request would have been on arrival."""
        for req, error in self.scheduler.compiled():
            msg = self._compiling.pop(req.rid)
            if error is None:
                self.transport.accepted(msg)
            else:
                e = InvalidRequest(str(error), getattr(error, "param", None))
                self.transport.reply(Rejected(msg.rid, e.kind, str(e), e.param))

    def admit(self, msg: GenerateReq) -> bool:
        """Queue the request (False: it waits for its grammar to compile first), or raise
        the typed error that refuses it."""
        scheduler = self.scheduler
        if len(scheduler.waiting) + len(self._compiling) >= self.max_queued:
            raise QueueFull(
                f"the server is overloaded: {self.max_queued} requests are already waiting "
                "(--max-queued-requests); retry later"
            )
        if any(req.rid == msg.rid for req in scheduler.live()):
            raise DuplicateRid.of(msg.rid)
        try:
            return scheduler.add_request(msg.to_req())
        except ValueError as e:  # the request can never run here (GrammarError included)
            raise InvalidRequest(str(e), getattr(e, "param", None)) from e

    def control(self, msg: ControlReq) -> ControlReply:
        if msg.op == "pause_generation":
            self.pause(msg.args.get("mode", "abort"))
            return ControlReply(msg.call_id, True)
        if msg.op == "continue_generation":
            self.paused = None
            return ControlReply(msg.call_id, True)
        if msg.op == "flush_cache":
            return ControlReply(msg.call_id, self.scheduler.flush_cache())
        if msg.op == "get_state":
            return ControlReply(msg.call_id, self.state())
        if msg.op in ("start_profile", "stop_profile"):
            try:
                if msg.op == "start_profile":
                    self.profiler.start(msg.args)
                    return ControlReply(msg.call_id, True)
                return ControlReply(msg.call_id, self.profiler.stop())
            except (ProfileRefused, OSError, ValueError) as e:  # (a path it cannot make)
                return ControlReply(msg.call_id, refused=str(e))
            except Exception as e:  # the scheduler goes on
                logger.exception("%s failed", msg.op)
                return ControlReply(msg.call_id, error=f"{msg.op} failed: {e!r}")
        try:
            self.scheduler.check_kv_accounting()
        except AssertionError as e:
            return ControlReply(msg.call_id, error=str(e))
        return ControlReply(msg.call_id, None)

    def state(self) -> SchedulerStats:
        stats = self.scheduler.state()
        stats.decode_loop_seconds = self.decode_loop_seconds
        stats.pid = os.getpid()
        stats.dp_rank = self.dp_rank
        stats.paused = self.paused
        stats.num_held_for_update = len(self._after_update)
        return stats

    def publish_state(self) -> None:
        now = time.monotonic()
        if now - self._last_state_time < STATE_INTERVAL_S:
            return
        state = self.state()
        if state != self._last_state:
            self.transport.reply(SchedulerState(state))
            self._last_state = state
        self._last_state_time = now
