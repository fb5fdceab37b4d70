"""The detokenizer process: turns each request's new token ids into its cumulative native
result (text with stop strings trimmed and partial stops held back, logprob triples)."""

from __future__ import annotations

import logging
from pathlib import Path

import zmq

from radixserve.model.loader import ModelLoadError
from radixserve.model.runner import load_config_and_tokenizer
from radixserve.output import RequestState
from radixserve.server.child import parent_alive, prepare_child
from radixserve.server.ipc import Endpoints, Receiver, Sender
from radixserve.server.messages import (
    Failed,
    GenerateReq,
    Ready,
    StrOut,
    StrOutBatch,
    TokenOutBatch,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500


def run_detokenizer(model_folder: Path, endpoints: Endpoints, log_level: str, parent_pid: int):
    prepare_child("detokenizer", log_level, parent_pid)
    ctx = zmq.Context()
    to_main = Sender(ctx, endpoints.main)
    try:
        inbox = Receiver(ctx, endpoints.detokenizer)
        _, tokenizer = load_config_and_tokenizer(model_folder)
    except (ModelLoadError, OSError, zmq.ZMQError) as e:
        to_main.send(Failed("detokenizer", str(e)))
        ctx.destroy(linger=1000)
        raise SystemExit(1) from e
    to_main.send(Ready("detokenizer"))
    detokenizer = Detokenizer(tokenizer)
    while parent_alive(parent_pid):
        msg = inbox.recv(IDLE_POLL_MS)
        if msg is None:
            continue
        if isinstance(msg, GenerateReq):
            detokenizer.register(msg)
        elif isinstance(msg, TokenOutBatch):
            to_main.send(detokenizer.process(msg))
        else:
            raise TypeError(f"the detokenizer got an unexpected message {type(msg).__name__}")


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, tuple[RequestState, bool]] = {}  # rid → (state, streaming)

    def register(self, req: GenerateReq) -> None:
        state = RequestState(
            req.rid,
            req.params,
            self.tokenizer,
            req.return_logprob,
            req.top_logprobs_num,
            req.return_text_in_logprobs,
        )
        self.states[req.rid] = (state, req.stream)

    def process(self, batch: TokenOutBatch) -> StrOutBatch:
        outs = []
        for out in batch.outputs:
            state, stream = self.states[out.rid]
            state.update(out)
            finished = state.finished
            result = state.result() if stream or finished else None
            outs.append(StrOut(out.rid, out.completion_tokens, finished, result))
            if finished:
                del self.states[out.rid]
        return StrOutBatch(outs)
