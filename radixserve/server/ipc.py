"""Typed one-way queues over ZMQ PUSH/PULL sockets (ipc:// endpoints in a private folder).

Each process binds one PULL socket for what it receives and connects PUSH sockets to the
others'. The queues know nothing of message content beyond `messages.encode/decode`.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import zmq
import zmq.asyncio

from radixserve.server.messages import Message, decode, encode


@dataclass(frozen=True)
class Endpoints:
    schedulers: tuple[str, ...]  # what each scheduler (one per data-parallel replica) receives
    detokenizer: str
    main: str

    @classmethod
    def fresh(cls, dp_size: int = 1) -> Endpoints:
        folder = tempfile.mkdtemp(prefix=f"radixserve-{os.getpid()}-")
        schedulers = tuple(f"ipc://{folder}/scheduler{i}" for i in range(dp_size))
        return cls(schedulers, f"ipc://{folder}/detokenizer", f"ipc://{folder}/main")

    def cleanup(self) -> None:
        for address in (*self.schedulers, self.detokenizer, self.main):
            path = address.removeprefix("ipc://")
            if os.path.exists(path):
                os.unlink(path)
        folder = os.path.dirname(self.main.removeprefix("ipc://"))
        if os.path.isdir(folder):
            os.rmdir(folder)


class Sender:
    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never block: a dead peer must not hang us
        self.socket.connect(address)

    def send(self, msg: Message) -> None:
        self.socket.send(encode(msg), copy=False)


class Receiver:
    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.bind(address)

    def recv(self, timeout_ms: int | None = None) -> Message | None:
        """The next message; None if none came within `timeout_ms` (0: don't wait)."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        return decode(self.socket.recv(copy=False).buffer)

    def drain(self) -> list[Message]:
        """Every message already queued, without waiting."""
        out = []
        while (msg := self.recv(0)) is not None:
            out.append(msg)
        return out


class AsyncReceiver:
    """The main process's PULL socket, for its asyncio loop."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.bind(address)

    async def recv(self) -> Message:
        return decode(await self.socket.recv())
