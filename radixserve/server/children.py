"""The server's child processes, and the start of the first one before the HTTP process
loads its own modules.

Each child's entry imports its own code when it runs: a spawned child imports the module
of its entry, so entries kept here (with no heavy import) spare the scheduler and the
detokenizer the HTTP side's modules (FastAPI, uvicorn, the OpenAI routes, llguidance's
tokenizer tables), and the HTTP process never loads the model's.

`prestart` binds the port, makes the queues' endpoints and starts scheduler 0 at once:
`radixserve serve` calls it before it imports `launch.py`, so that the model loads while
this process imports the HTTP side (~5 s of a cached start on a 2-core AMD EPYC, where the
scheduler used to start only after it: `benchmarks/server_ready.py`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from radixserve.config import Config, rank_addr
from radixserve.lora.registry import check_names
from radixserve.server.ipc import Endpoints


def _scheduler_main(*args: object) -> None:
    from radixserve.server.scheduler_process import run_scheduler

    run_scheduler(*args)  # type: ignore[arg-type]


def _tp_main(*args: object) -> None:
    """A tensor-parallel rank other than 0."""
    from radixserve.server.scheduler_process import run_tp_rank

    run_tp_rank(*args)  # type: ignore[arg-type]


def _detokenizer_main(*args: object) -> None:
    from radixserve.server.detokenizer import run_detokenizer

    run_detokenizer(*args)  # type: ignore[arg-type]


CHILD_MAINS = {"scheduler": _scheduler_main, "tp": _tp_main, "detokenizer": _detokenizer_main}
CHILD_STOP_TIMEOUT_S = 5.0  # how long stopped children may take to exit before SIGKILL


def spawn_child(name: str, role: str, args: tuple) -> BaseProcess:
    """Start the child `name` (a daemon) running `role`'s entry (CHILD_MAINS) on `args`."""
    child = multiprocessing.get_context("spawn").Process(
        target=CHILD_MAINS[role], args=args, name=f"radixserve-{name}", daemon=True
    )
    child.start()
    return child


def stop_processes(processes: Iterable[BaseProcess], deadline: float) -> None:
    """SIGTERM each process, wait for them until `deadline` (time.monotonic()), then
    SIGKILL what is left."""
    processes = list(processes)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0.1))
        if process.is_alive():
            process.kill()
            process.join(1.0)


def replica_config(config: Config, dp_rank: int) -> Config:
    """Replica `dp_rank`'s config: under tensor parallelism, where its ranks meet."""
    if config.parallel.tp_size == 1:
        return config
    parallel = dataclasses.replace(
        config.parallel, dist_init_addr=rank_addr(config.parallel, dp_rank)
    )
    return dataclasses.replace(config, parallel=parallel)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@dataclass
class Prestarted:
    """What `prestart` made: the bound port, the endpoints, scheduler 0's process,
    --chat-template's text, and each data-parallel replica's config (where its
    tensor-parallel ranks meet: a free port is picked once, for scheduler 0 and for the
    ranks started later alike)."""

    sock: socket.socket
    endpoints: Endpoints
    scheduler: BaseProcess
    chat_template: str | None
    replicas: list[Config]

    def undo(self) -> None:
        """Stop the scheduler and free what was made, where the server does not go on."""
        stop_processes([self.scheduler], time.monotonic() + CHILD_STOP_TIMEOUT_S)
        self.endpoints.cleanup()
        self.sock.close()


def prestart(config: Config, log_level: str) -> Prestarted:
    """Check the flags the main process reads (--chat-template, the LoRA adapters' names)
    and bind the port: each fails here, before anything loads. Then start scheduler 0,
    which finds (or converts) the model and loads it; its messages to this process wait in
    its queue until the launcher binds its own end."""
    chat_template = None
    if config.server.chat_template is not None:
        from radixserve.tokenizer import read_chat_template  # (transformers: only for it)

        chat_template = read_chat_template(config.server.chat_template)
    check_names(config.lora, reserved=(config.served_model_name,))
    sock = bind_socket(config.server.host, config.server.port)
    try:
        endpoints = Endpoints.fresh(config.parallel.dp_size)
    except OSError:
        sock.close()
        raise
    try:
        replicas = [replica_config(config, d) for d in range(config.parallel.dp_size)]
        args = (replicas[0], endpoints, log_level, os.getpid(), 0)
        scheduler = spawn_child("scheduler0", "scheduler", args)
    except BaseException:
        endpoints.cleanup()
        sock.close()
        raise
    return Prestarted(sock, endpoints, scheduler, chat_template, replicas)
