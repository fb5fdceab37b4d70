"""The detokenizer process: turns each request's new token ids into what its native result
gains (new text with stop strings trimmed and partial stops held back, logprob triples) and
sends only that to the main process (see radixserve/output.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import zmq

from radixserve.output import Detokenizer, RequestState
from radixserve.server.child import parent_alive, prepare_child
from radixserve.server.ipc import Endpoints, Receiver, Sender
from radixserve.server.messages import (
    Failed,
    GenerateReq,
    Ready,
    StrOutBatch,
    TokenOutBatch,
)
from radixserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500


def run_detokenizer(model_folder: Path, endpoints: Endpoints, log_level: str, parent_pid: int):
    prepare_child("detokenizer", log_level, parent_pid)
    ctx = zmq.Context()
    to_main = Sender(ctx, endpoints.main)
    try:
        inbox = Receiver(ctx, endpoints.detokenizer)
        tokenizer = load_tokenizer(model_folder)
    except (OSError, zmq.ZMQError) as e:
        to_main.send(Failed("detokenizer", str(e)))
        ctx.destroy(linger=1000)
        raise SystemExit(1) from e
    to_main.send(Ready("detokenizer"))
    detokenizer = Detokenizer()
    while parent_alive(parent_pid):
        msg = inbox.recv(IDLE_POLL_MS)
        if msg is None:
            continue
        if isinstance(msg, GenerateReq):
            detokenizer.register(request_state(msg, tokenizer), msg.stream)
        elif isinstance(msg, TokenOutBatch):
            to_main.send(StrOutBatch(detokenizer.process(msg.outputs)))
        else:
            raise TypeError(f"the detokenizer got an unexpected message {type(msg).__name__}")


def request_state(req: GenerateReq, tokenizer) -> RequestState:
    return RequestState(
        req.rid,
        req.params,
        tokenizer,
        req.return_logprob,
        req.top_logprobs_num,
        req.return_text_in_logprobs,
        bool(req.token_ids_logprob),
    )
