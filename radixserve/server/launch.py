"""The server: it serves HTTP in this (main) process, starts the detokenizer (and the
other replicas and ranks) once scheduler 0 names the model's folder, watches the children,
and stops everything together. Scheduler 0 and the port come from `children.prestart`.

- The port is bound before anything loads, so a busy port fails at once.
- /health answers 503 until both children report Ready, then 200.
- A child that dies (or fails to start) ends every in-flight request with a 503 error,
  turns /health to 503, and makes this process exit non-zero.
- SIGTERM / SIGINT drain: new requests get 503, running ones may finish for up to
  --shutdown-timeout seconds, then the rest are aborted; a second signal stops at once.
- Children die with this process (PR_SET_PDEATHSIG, plus a parent check in their loops).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

import psutil
import uvicorn
import zmq
import zmq.asyncio

from radixserve.chat_roles import derive_chat_roles
from radixserve.config import Config
from radixserve.core.req import seed_draws
from radixserve.sampling_defaults import model_sampling_defaults
from radixserve.server import routes_responses
from radixserve.server.children import (
    CHILD_STOP_TIMEOUT_S,
    Prestarted,
    prestart,
    spawn_child,
    stop_processes,
)
from radixserve.server.dispatcher import Dispatcher
from radixserve.server.http import build_app
from radixserve.server.ipc import AsyncReceiver, Sender
from radixserve.server.metrics import Metrics
from radixserve.server.request_log import RequestLog
from radixserve.server.tokenizer_manager import TokenizerManager
from radixserve.tokenizer import (
    TokenizerLoadError,
    load_tokenizer,
    longest_token_chars,
)

logger = logging.getLogger("radixserve.server")

WATCH_INTERVAL_S = 0.2
BATCH_END_TIMEOUT_S = 10.0  # a draining server waits this long for batches to end


def with_model_path(config: Config, folder: str) -> Config:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, model_path=folder))


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the launcher decides how to stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def launch_server(
    config: Config,
    log_level: str = "info",
    launched: Callable[[Launcher], None] | None = None,
    prestarted: Prestarted | None = None,
) -> int:
    """Run the server until it is stopped; the exit code: 0 after a clean stop, 1 if a
    process died or failed to start. `launched` is given the launcher first (to stop it
    from another thread: `request_stop`). `prestarted`: the port, endpoints and scheduler
    0 that `children.prestart` began before this module was imported (`radixserve serve`);
    begun here otherwise."""
    if config.parallel.node_rank > 0:
        return launch_node(config, log_level)
    if prestarted is None:
        prestarted = prestart(config, log_level)
    try:
        launcher = Launcher(config, prestarted, log_level)
        if launched is not None:
            launched(launcher)
    except BaseException:
        prestarted.undo()
        raise
    try:
        return asyncio.run(launcher.run())
    finally:
        launcher.stop_children()
        prestarted.endpoints.cleanup()
        prestarted.sock.close()


class Launcher:
    def __init__(self, config: Config, prestarted: Prestarted, log_level: str) -> None:
        self.config = config
        # --chat-template's text, in place of the model's
        self.chat_template = prestarted.chat_template
        self.endpoints = prestarted.endpoints
        self.sock = prestarted.sock
        self.replicas = prestarted.replicas
        self.log_level = log_level
        self.exit_code = 0
        self.stopping = False  # a signal asked to stop (draining)
        self.failed = False  # a process died or could not start
        self.children: dict[str, BaseProcess] = {}
        self.roles: dict[str, str] = {}  # child name → its role (children.CHILD_MAINS)
        self.adopt("scheduler0", "scheduler", prestarted.scheduler)
        self._loop: asyncio.AbstractEventLoop | None = None  # while run() runs
        self._loop_lock = threading.Lock()
        self._stop_early = False  # request_stop came before run()

    def request_stop(self) -> None:
        """From another thread: drain and stop, as a first SIGTERM does; nothing if the
        server is stopping or has stopped already."""
        with self._loop_lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._stop_requested)
            else:  # not running yet: it stops as soon as it runs
                self._stop_early = True

    def _stop_requested(self) -> None:
        if not self.stopping:
            self.on_signal(signal.SIGTERM)

    async def run(self) -> int:
        with self._loop_lock:
            self._loop = asyncio.get_running_loop()
            if self._stop_early:
                self._loop.call_soon(self._stop_requested)
        try:
            return await self._run()
        finally:
            with self._loop_lock:
                self._loop = None

    async def _run(self) -> int:
        if self.config.server.random_seed is not None:  # (requests are made here)
            seed_draws(self.config.server.random_seed)
        ctx = zmq.asyncio.Context()
        receiver = AsyncReceiver(ctx, self.endpoints.main)  # bound before children connect
        sync_ctx = zmq.Context()
        senders = [Sender(sync_ctx, address) for address in self.endpoints.schedulers]
        dispatcher = Dispatcher(senders, self.config.parallel.load_balance_method)
        self.manager = TokenizerManager(dispatcher, Metrics())
        app = build_app(self.manager, self.config, self.config.served_model_name)
        self.app = app
        self.loras = app.state.server.loras  # (names for --log-requests)
        self.server = _Server(
            uvicorn.Config(
                app,
                log_level=logging.getLevelName(logger.getEffectiveLevel()).lower(),
                access_log=logger.isEnabledFor(logging.DEBUG),
                timeout_graceful_shutdown=CHILD_STOP_TIMEOUT_S,
            )
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)
        starting = asyncio.create_task(self.start())
        starting.add_done_callback(self._started)
        tasks = [
            asyncio.create_task(self.manager.receive_loop(receiver)),
            starting,
            asyncio.create_task(self.watch()),
        ]
        try:
            await self.server.serve(sockets=[self.sock])  # /health is 503 until ready
        finally:
            for task in tasks:
                task.cancel()
            running = app.state.batches.tasks  # (a resumable batch keeps its work files)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await routes_responses.stop_background(app)
            app.state.files.close()  # (and the folder's lock)
            ctx.destroy(linger=0)
            sync_ctx.destroy(linger=0)
        return self.exit_code

    async def start(self) -> None:
        """Once scheduler 0 (started first: it finds or converts the model, then loads it)
        names the model's folder, start the other data-parallel replicas (on that folder, so
        none converts it again), the detokenizer and the tokenizer; all while HTTP already
        answers (503 "starting")."""
        parallel = self.config.parallel
        folder = await self.manager.model_folder
        for d, replica in enumerate(self.replicas):
            on_folder = with_model_path(replica, str(folder))
            if d:
                self.start_child(f"scheduler{d}", "scheduler", on_folder, d)
            for rank in range(1, parallel.ranks_per_node):  # this node's other TP ranks
                self.start_child(parallel.rank_name(d, rank), "tp", on_folder, rank, d)
        self.start_child("detokenizer", "detokenizer", folder)
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, folder)
        except TokenizerLoadError as e:
            self.fail(f"cannot start: {e}")
            return
        if self.chat_template is not None:
            tokenizer.chat_template = self.chat_template
        server = self.config.server
        if server.log_requests:
            names = self.loras.name_of
            self.manager.request_log = RequestLog(
                server.log_requests_chars, tokenizer.decode, names
            )
        if server.sampling_defaults == "model":
            defaults = await asyncio.to_thread(model_sampling_defaults, folder)
            self.manager.sampling_defaults = defaults
            self.manager.model_sampling_defaults = True
            if defaults:
                said = ", ".join(f"{k}={v}" for k, v in defaults.items())
                logger.info("sampling defaults from the model's generation_config.json: %s", said)
        self.manager.chat_roles = derive_chat_roles(tokenizer)
        self.manager.longest_token = longest_token_chars(tokenizer)
        self.manager.tokenizer = tokenizer

    def _started(self, task: asyncio.Task) -> None:
        """A start that raised (what no check foresaw) stops the server with the reason,
        not a server answering 503 "starting" for good."""
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        logger.error("start-up failed", exc_info=error)
        self.fail(f"cannot start: {type(error).__name__}: {error}")

    def start_child(self, name: str, role: str, first_arg: object, *rest: object) -> None:
        """Start the child `name` running `role`'s entry (children.CHILD_MAINS)."""
        args = (first_arg, self.endpoints, self.log_level, os.getpid(), *rest)
        self.adopt(name, role, spawn_child(name, role, args))

    def adopt(self, name: str, role: str, child: BaseProcess) -> None:
        """Watch and stop `child` as one of this server's."""
        self.children[name] = child
        self.roles[name] = role

    async def watch(self) -> None:
        """Announce readiness once; end everything if a child dies."""
        announced = False
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self.failed:
                continue
            if self.manager.dead is not None:
                self.fail(self.manager.dead)  # a child reported it could not start
            for name, child in self.children.items():
                if not child.is_alive() and not self.failed:  # also while draining
                    self.fail(f"the {name} process exited with code {child.exitcode}")
            if self.manager.ready and not announced and self.manager.dead is None:
                announced = True
                self.app.state.batches.resume(self.app)  # those a stopped server left
                info = self.manager.info
                assert info is not None
                host, port = self.config.server.host, self.config.server.port
                logger.info(
                    "radixserve is ready on http://%s:%d in %.1fs (model %s; %s, KV pool %d "
                    "tokens in %s, %.2f GiB; context %d; up to %d running requests)",
                    host,
                    port,
                    time.time() - psutil.Process().create_time(),
                    info.model_path,
                    info.dtype,
                    info.max_total_num_tokens,
                    info.kv_cache_dtype,
                    info.kv_pool_bytes / 2**30,
                    info.context_length,
                    info.max_running_requests,
                )

    def fail(self, reason: str) -> None:
        logger.error("stopping: %s", reason)
        self.failed = True
        self.stopping = True
        self.exit_code = 1
        self.manager.fail_all(reason)
        self.server.should_exit = True

    def on_signal(self, sig: int) -> None:
        if self.stopping:  # a second signal: stop now
            logger.warning("second %s: stopping at once", signal.Signals(sig).name)
            self.manager.send_abort(None, "the server stopped")
            self.server.should_exit = True
            self.server.force_exit = True
            return
        logger.info("%s: draining (up to %.0fs)", signal.Signals(sig).name,
                    self.config.server.shutdown_timeout)  # fmt: skip
        self.stopping = True
        self.manager.draining = True
        asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        deadline = time.monotonic() + self.config.server.shutdown_timeout
        while self.manager.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.manager.pending:
            logger.warning("aborting %d unfinished requests", len(self.manager.pending))
            self.manager.send_abort(None, "the server is shutting down")
            abort_deadline = time.monotonic() + 2.0
            while self.manager.pending and time.monotonic() < abort_deadline:
                await asyncio.sleep(0.05)
        batches = self.app.state.batches  # they write their files, and stop to resume
        # (a server on the same --file-storage-path) or end failed
        deadline = time.monotonic() + BATCH_END_TIMEOUT_S
        while batches.tasks and time.monotonic() < deadline:
            await asyncio.wait(set(batches.tasks), timeout=deadline - time.monotonic())
        self.server.should_exit = True

    def stop_children(self) -> None:
        """The schedulers first: each releases its tensor-parallel ranks (they leave their
        loop on rank 0's stop, instead of breaking its last collective), then the rest."""
        deadline = time.monotonic() + CHILD_STOP_TIMEOUT_S
        schedulers = [c for name, c in self.children.items() if self.roles[name] == "scheduler"]
        others = [c for name, c in self.children.items() if self.roles[name] != "scheduler"]
        for group in (schedulers, others):
            stop_processes(group, deadline)


def launch_node(config: Config, log_level: str = "info") -> int:
    """A machine other than node 0 of --nnodes: its share of the tensor-parallel ranks and
    no HTTP. Runs until a rank exits (rank 0 stopped, or the group broke: then the exit code
    is 1) or a signal stops it."""
    parallel = config.parallel
    first = parallel.node_rank * parallel.ranks_per_node
    ranks = range(first, first + parallel.ranks_per_node)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    logger.info(
        "node %d of %d: tensor-parallel ranks %d..%d of %d, meeting at %s (no HTTP here)",
        parallel.node_rank, parallel.nnodes, ranks[0], ranks[-1], parallel.tp_size,
        parallel.dist_init_addr,
    )  # fmt: skip
    children = {
        rank: spawn_child(f"tp{rank}", "tp", (config, None, log_level, os.getpid(), rank))
        for rank in ranks
    }
    exit_code = 0
    while not stop:
        ended = [(rank, c.exitcode) for rank, c in children.items() if not c.is_alive()]
        if ended:
            rank, code = ended[0]
            exit_code = 0 if code == 0 else 1
            log = logger.info if code == 0 else logger.error
            log("stopping: tensor-parallel rank %d exited with code %s", rank, code)
            break
        time.sleep(WATCH_INTERVAL_S)
    stop_processes(children.values(), time.monotonic() + CHILD_STOP_TIMEOUT_S)
    return exit_code
