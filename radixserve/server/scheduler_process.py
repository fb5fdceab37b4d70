"""The scheduler process: owns the model runner and the scheduler, receives requests from
the main process, and sends each step's new tokens to the detokenizer."""

from __future__ import annotations

import logging
import os
import time

import zmq

from radixserve.config import Config
from radixserve.model.loader import ModelLoadError
from radixserve.model.runner import ModelRunner
from radixserve.scheduler.scheduler import Scheduler
from radixserve.server.child import keep_freed_memory, parent_alive, prepare_child
from radixserve.server.ipc import Endpoints, Receiver, Sender
from radixserve.server.messages import (
    AbortReq,
    ControlReply,
    ControlReq,
    Failed,
    GenerateReq,
    Ready,
    Rejected,
    SchedulerState,
    TokenOutBatch,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # how often an idle scheduler checks that its parent lives
STATE_INTERVAL_S = 0.2  # most frequent SchedulerState publication


def run_scheduler(config: Config, endpoints: Endpoints, log_level: str, parent_pid: int) -> None:
    prepare_child("scheduler", log_level, parent_pid)
    keep_freed_memory()
    ctx = zmq.Context()
    to_main = Sender(ctx, endpoints.main)
    try:
        inbox = Receiver(ctx, endpoints.scheduler)
        runner = ModelRunner(config, progress=False)
        scheduler = Scheduler(runner, config.scheduler, page_size=config.cache.page_size)
    except (ModelLoadError, ValueError, OSError, zmq.ZMQError) as e:
        to_main.send(Failed("scheduler", str(e)))
        ctx.destroy(linger=1000)
        raise SystemExit(1) from e
    loop = SchedulerLoop(scheduler, inbox, Sender(ctx, endpoints.detokenizer), to_main, config)
    to_main.send(Ready("scheduler", runner.info()))
    loop.run(parent_pid)


class SchedulerLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        inbox: Receiver,
        to_detokenizer: Sender,
        to_main: Sender,
        config: Config,
    ) -> None:
        self.scheduler = scheduler
        self.inbox = inbox
        self.to_detokenizer = to_detokenizer
        self.to_main = to_main
        self.max_queued = config.server.max_queued_requests
        self.last_state: dict[str, int | float] = {}
        self.last_state_time = 0.0
        self.decode_loop_seconds = 0.0  # loop iterations that decoded, receiving + sending too

    def run(self, parent_pid: int) -> None:
        while parent_alive(parent_pid):
            if not self.scheduler.has_work:
                first = self.inbox.recv(IDLE_POLL_MS)
                messages = [first] if first is not None else []
            else:
                messages = []
            start = time.perf_counter()
            for msg in messages + self.inbox.drain():
                self.handle(msg)
            if self.scheduler.has_work:
                outputs = self.scheduler.step()
                if outputs:
                    self.to_detokenizer.send(TokenOutBatch(outputs))
                if self.scheduler.last_step == "decode":
                    self.decode_loop_seconds += time.perf_counter() - start
            self.publish_state()

    def handle(self, msg: object) -> None:
        if isinstance(msg, GenerateReq):
            self.add(msg)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort(msg.rid, msg.message)
        elif isinstance(msg, ControlReq):
            self.to_main.send(ControlReply(msg.call_id, self.control(msg.op)))
        else:
            raise TypeError(f"the scheduler got an unexpected message {type(msg).__name__}")

    def add(self, msg: GenerateReq) -> None:
        if len(self.scheduler.waiting) >= self.max_queued:
            message = (
                f"the server is overloaded: {self.max_queued} requests are already waiting "
                "(--max-queued-requests); retry later"
            )
            self.to_main.send(Rejected(msg.rid, 503, message))
            return
        try:
            self.scheduler.add_request(msg.to_req())
        except ValueError as e:
            self.to_main.send(Rejected(msg.rid, 400, str(e)))
            return
        self.to_detokenizer.send(msg)  # before any of its outputs, on the same queue

    def control(self, op: str) -> object:
        if op == "flush_cache":
            return self.scheduler.flush_cache()
        if op == "get_state":
            return self.state()
        raise ValueError(f"unknown control op {op!r}")

    def state(self) -> dict[str, int | float]:
        state = self.scheduler.state()
        return {**state, "decode_loop_seconds": self.decode_loop_seconds, "pid": os.getpid()}

    def publish_state(self) -> None:
        now = time.monotonic()
        if now - self.last_state_time < STATE_INTERVAL_S:
            return
        state = self.state()
        if state != self.last_state:
            self.to_main.send(SchedulerState(state))
            self.last_state = state
        self.last_state_time = now
