"""Messages between the server's processes, grouped by direction, with one encoder.

    main ──GenerateReq/AbortReq/ControlReq──► scheduler
    scheduler ──GenerateReq (accepted), TokenOutBatch──► detokenizer
    detokenizer ──StrOutBatch (text deltas)──► main
    scheduler ──Ready/Failed, Rejected, ControlReply, SchedulerState──► main

Every message is a tagged msgspec Struct; the transport (`ipc`) only moves bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.core.output import ReqOutput, StrOut
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams


class Message(msgspec.Struct, tag=True):
    pass


# -- main → scheduler ---------------------------------------------------------------------
class GenerateReq(Message):
    """One sequence to run (a native call with a batch or `n` > 1 sends several)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    priority: int = 0
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False  # the detokenizer sends partial results only for streams

    @classmethod
    def from_req(cls, req: Req, return_text_in_logprobs: bool, stream: bool) -> GenerateReq:
        return cls(
            req.rid,
            req.input_ids,
            req.params,
            req.seed,
            req.priority,
            req.return_logprob,
            req.logprob_start_len,
            req.top_logprobs_num,
            return_text_in_logprobs,
            stream,
        )

    def to_req(self) -> Req:
        return Req(
            self.rid,
            self.input_ids,
            self.params,
            seed=self.seed,
            priority=self.priority,
            return_logprob=self.return_logprob,
            logprob_start_len=self.logprob_start_len,
            top_logprobs_num=self.top_logprobs_num,
        )


class AbortReq(Message):
    rid: str | None  # None: every request
    message: str = "aborted"


class ControlReq(Message):
    call_id: int
    op: str  # "flush_cache" | "get_state"


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
    info: dict[str, Any]


class Failed(Message):
    role: str
    message: str


class Rejected(Message):
    """The scheduler refused a request: 400 (it can never run) or 503 (queue full)."""

    rid: str
    status: int
    message: str


class ControlReply(Message):
    call_id: int
    result: Any


class SchedulerState(Message):
    """Published after steps (at most a few times a second) for gauges and health."""

    state: dict[str, int | float]


AnyMessage = (
    GenerateReq
    | AbortReq
    | ControlReq
    | TokenOutBatch
    | StrOutBatch
    | Ready
    | Failed
    | Rejected
    | ControlReply
    | SchedulerState
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
