"""Messages between the server's processes, grouped by direction, with one encoder.

    main ──GenerateReq/AbortReq/ControlReq──► scheduler
    scheduler ──GenerateReq (accepted), TokenOutBatch──► detokenizer
    detokenizer ──StrOutBatch (text deltas)──► main
    scheduler ──ModelFolder, Ready/Failed, Rejected, ControlReply, SchedulerState,
                CacheEvents (data parallelism)──► main

Every message is a tagged msgspec Struct; the transport (`ipc`) only moves bytes. The
messages of the scheduler loop itself live in `core/messages.py` (the Engine uses them
too); the ones below are the server's own.
"""

from __future__ import annotations

import msgspec

from radixserve.core.messages import (
    AbortReq,
    CacheEvents,
    ControlReply,
    ControlReq,
    GenerateReq,
    Message,
    Rejected,
    SchedulerState,
)
from radixserve.core.output import ModelInfo, ReqOutput, StrOut


# -- scheduler → detokenizer ----------------------------------------------------------------
class TokenOutBatch(Message):
    outputs: list[ReqOutput]


# -- detokenizer → main ---------------------------------------------------------------------
class StrOutBatch(Message):
    """Per request, only what is new since its previous StrOut (`StrOut` lives beside
    `ReqOutput` in core/output.py): a stream's step costs the same bytes at any length."""

    outputs: list[StrOut]


# -- scheduler/detokenizer → main -----------------------------------------------------------
class Ready(Message):
    role: str
    info: ModelInfo | None = None  # the scheduler's: the model and its derived limits


class ModelFolder(Message):
    """The scheduler found (or converted) the model's folder and now loads it; the main
    process starts the detokenizer and loads the tokenizer from it meanwhile."""

    folder: str


class Failed(Message):
    role: str
    message: str
    started: bool = False  # it failed while running (else: it could not start)


AnyMessage = (
    GenerateReq
    | AbortReq
    | ControlReq
    | TokenOutBatch
    | StrOutBatch
    | Ready
    | ModelFolder
    | Failed
    | Rejected
    | ControlReply
    | SchedulerState
    | CacheEvents
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
