"""The scheduler process: finds (or converts) the model, owns the model runner and the
scheduler, and runs the scheduler loop (`scheduler/loop.py`) over ZMQ: requests from the
main process, each step's outputs to the detokenizer, replies and state to main."""

from __future__ import annotations

import dataclasses
import gc
import logging
import signal

import zmq

from radixserve.config import Config
from radixserve.core.messages import ControlReply, GenerateReq, Message, Rejected, SchedulerState
from radixserve.core.output import ReqOutput
from radixserve.hardware import place_process
from radixserve.model.loader import ModelLoadError, resolve_model_folder
from radixserve.model.parallel import TensorParallelError
from radixserve.model.runner import ModelRunner, run_follower
from radixserve.scheduler.loop import SchedulerLoop
from radixserve.scheduler.scheduler import Scheduler
from radixserve.scheduler.watchdog import Watchdog, resolve_timeout
from radixserve.server.child import keep_freed_memory, parent_alive, prepare_child
from radixserve.server.ipc import Endpoints, Receiver, Sender
from radixserve.server.messages import Failed, ModelFolder, Ready, TokenOutBatch

logger = logging.getLogger(__name__)

# how long a scheduler that cannot start waits for main to take the reason: scheduler 0
# starts before main binds its end of the queue (children.prestart), and a bad model path
# can fail before main has imported the HTTP side (~5 s); main stops it sooner if it fails
FAILED_LINGER_MS = 30_000


class ZmqTransport:
    """The scheduler loop's transport in the server: one PULL socket in, PUSH sockets to
    the detokenizer (accepted requests, then their outputs, in order) and to main."""

    def __init__(
        self, inbox: Receiver, to_detokenizer: Sender, to_main: Sender, parent_pid: int
    ) -> None:
        self.inbox = inbox
        self.to_detokenizer = to_detokenizer
        self.to_main = to_main
        self.parent_pid = parent_pid
        self.stopping = False  # SIGTERM: end the loop, so the scheduler closes cleanly

    def stop(self, *_: object) -> None:
        self.stopping = True

    def receive(self, timeout_s: float) -> list[Message]:
        first = self.inbox.recv(int(timeout_s * 1000)) if timeout_s > 0 else None
        return ([first] if first is not None else []) + self.inbox.drain()

    def send_outputs(self, outputs: list[ReqOutput]) -> None:
        self.to_detokenizer.send(TokenOutBatch(outputs))

    def accepted(self, msg: GenerateReq) -> None:
        self.to_detokenizer.send(msg)  # before any of its outputs, on the same queue

    def reply(self, msg: Rejected | ControlReply | SchedulerState) -> None:
        self.to_main.send(msg)

    def alive(self) -> bool:
        return not self.stopping and parent_alive(self.parent_pid)


def _stopped_while_starting(*_: object) -> None:
    raise SystemExit(1)


def run_scheduler(
    config: Config, endpoints: Endpoints, log_level: str, parent_pid: int, dp_rank: int = 0
) -> None:
    prepare_child("scheduler" if config.parallel.dp_size == 1 else f"scheduler{dp_rank}",
                  log_level, parent_pid)  # fmt: skip
    keep_freed_memory()
    placed = place_process(config.parallel, dp_rank * config.parallel.ranks_per_node)
    logger.info("scheduler %d: %s", dp_rank, placed)
    # stopped while it starts (main failed or was stopped meanwhile): unwind, so that a GGUF
    # conversion under way removes its partial folder
    signal.signal(signal.SIGTERM, _stopped_while_starting)
    ctx = zmq.Context()
    to_main = Sender(ctx, endpoints.main)
    try:
        inbox = Receiver(ctx, endpoints.schedulers[dp_rank])
        folder = resolve_model_folder(config.model.model_path, config.model.cache_dir)
        to_main.send(ModelFolder(str(folder)))
        model = dataclasses.replace(config.model, model_path=str(folder))
        runner = ModelRunner(dataclasses.replace(config, model=model), progress=False)
        scheduler = Scheduler.from_config(runner, config)
    except (ModelLoadError, ValueError, OSError, zmq.ZMQError, TensorParallelError) as e:
        to_main.send(Failed("scheduler", str(e)))
        ctx.destroy(linger=FAILED_LINGER_MS)
        raise SystemExit(1) from e
    transport = ZmqTransport(inbox, Sender(ctx, endpoints.detokenizer), to_main, parent_pid)
    loop = SchedulerLoop(
        scheduler,
        transport,
        config.server.max_queued_requests,
        dp_rank=dp_rank,
        report_cache=config.parallel.dp_size > 1,
        decode_log_interval=config.server.decode_log_interval,
    )
    watchdog_s = resolve_timeout(config.server.watchdog_timeout, runner.device.type)
    if watchdog_s > 0:
        Watchdog(loop, watchdog_s).start()
    # the launcher stops its children with SIGTERM: the loop ends and the scheduler closes
    # (the disk tier's queued page writes land) instead of dying mid-write
    signal.signal(signal.SIGTERM, transport.stop)
    to_main.send(Ready(f"scheduler{dp_rank}", scheduler.info))
    # what start-up built (the model's modules, the tokenizer's tables) lives as long as the
    # process: out of the collector's generations, so that its full collections during
    # serving do not walk it again each time
    gc.freeze()
    try:
        loop.run()
    except TensorParallelError as e:  # another rank died or hung: this replica is over
        logger.error("%s", e)
        to_main.send(Failed(f"scheduler{dp_rank}", str(e), started=True))
        ctx.destroy(linger=1000)
        raise SystemExit(1) from e


def run_tp_rank(
    config: Config,
    endpoints: Endpoints | None,
    log_level: str,
    parent_pid: int,
    tp_rank: int,
    dp_rank: int = 0,
) -> None:
    """A tensor-parallel rank other than 0: its slice of the model, the steps rank 0 sends.
    A failure is logged and, on node 0, reported to main (`endpoints`; None on the other
    nodes); the process then exits 1."""
    name = config.parallel.rank_name(dp_rank, tp_rank)
    prepare_child(name, log_level, parent_pid)
    keep_freed_memory()
    started = []  # the model loaded: a failure after it is one while running
    try:
        run_follower(config, tp_rank, on_loaded=lambda: started.append(True), dp_rank=dp_rank)
    except (TensorParallelError, ModelLoadError, ValueError, OSError) as e:
        logger.error("%s", e)
        if endpoints is not None:
            ctx = zmq.Context()
            Sender(ctx, endpoints.main).send(Failed(name, str(e), started=bool(started)))
            ctx.destroy(linger=1000)
        raise SystemExit(1) from e
