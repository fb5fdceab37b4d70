"""Messages to and from the scheduler loop, the same for both transports (ZMQ between the
server's processes, in-memory queues for the Engine): tagged msgspec Structs, grouped by
direction. The transport moves them and knows nothing of their content.

    edge ──GenerateReq / AbortReq / ControlReq──► scheduler loop
    scheduler loop ──ReqOutput batches, Rejected, ControlReply, SchedulerState──► edge
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from radixserve.core.embedding import EmbedParams
from radixserve.core.errors import RejectionKind
from radixserve.core.output import SchedulerStats
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams, ThinkBlock


class Message(msgspec.Struct, tag=True):
    pass


# -- edge → scheduler ---------------------------------------------------------------------
class GenerateReq(Message):
    """One sequence to run (a native call with a batch or `n` > 1 sends several)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    priority: int = 0
    deferred: bool = False  # the flex tier (core/req.py)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False  # the detokenizer sends partial results only for streams
    embed: EmbedParams | None = None  # an embedding request (core/embedding.py)
    think: ThinkBlock | None = None  # reasoning before the constrained text (core/req.py)
    lora_id: int = 0  # the uid of its LoRA adapter (0: the base model)
    return_hidden_states: bool = False

    @classmethod
    def from_req(
        cls, req: Req, return_text_in_logprobs: bool = False, stream: bool = False
    ) -> GenerateReq:
        return cls(
            req.rid,
            req.input_ids,
            req.params,
            req.seed,
            req.priority,
            req.deferred,
            req.return_logprob,
            req.logprob_start_len,
            req.top_logprobs_num,
            req.token_ids_logprob,
            return_text_in_logprobs,
            stream,
            req.embed,
            req.think,
            req.lora_id,
            req.return_hidden_states,
        )

    def to_req(self) -> Req:
        return Req(
            self.rid,
            self.input_ids,
            self.params,
            seed=self.seed,
            priority=self.priority,
            deferred=self.deferred,
            return_logprob=self.return_logprob,
            logprob_start_len=self.logprob_start_len,
            top_logprobs_num=self.top_logprobs_num,
            token_ids_logprob=self.token_ids_logprob,
            embed=self.embed,
            think=self.think,
            lora_id=self.lora_id,
            return_hidden_states=self.return_hidden_states,
        )


class AbortReq(Message):
    rid: str | None  # None: every request
    message: str = "aborted"


ControlOp = Literal[
    "flush_cache",
    "get_state",
    "check_kv_accounting",
    "update_weights",
    "pause_generation",
    "continue_generation",
    "start_profile",
    "stop_profile",
    "load_lora_adapter",
    "unload_lora_adapter",
]
# how pause_generation treats the live requests (SGLang's modes): end them, take the running
# ones back to the queue, or keep them where they are
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "retract", "in_place")


class ControlReq(Message):
    call_id: int
    op: ControlOp
    # update_weights: {"model_path": str, "abort_all_requests": bool, "weight_version":
    # str | None}, or in place of the path (in-process only: the Engine's)
    # {"named_tensors": [(name, tensor)...], "flush_cache": bool};
    # pause_generation: {"mode": PauseMode};
    # load_lora_adapter: {"uid": int, "name": str, "path": str}; unload_lora_adapter:
    # {"uid": int} (answered once no live request uses it); start_profile: ProfileArgs
    # fields (scheduler/profiler.py)
    args: dict[str, Any] = msgspec.field(default_factory=dict)


# -- scheduler → edge ---------------------------------------------------------------------
class Rejected(Message):
    """The scheduler refused a request (see core/errors.py for the kinds)."""

    rid: str
    kind: RejectionKind
    message: str
    param: str | None = None  # the field at fault, where one is


class WeightUpdate(msgspec.Struct):
    """How an update_weights op ended (SGLang's answer, and the folder read)."""

    success: bool
    message: str
    num_paused_requests: int = 0  # requests that waited for it
    model_path: str | None = None
    weight_version: str | None = None  # the update's name for the weights, if it gave one

    def answer(self) -> dict[str, Any]:
        return {
            "success": self.success,
            "message": self.message,
            "num_paused_requests": self.num_paused_requests,
        }


class LoraUpdate(msgspec.Struct):
    """How a load_lora_adapter or unload_lora_adapter op ended."""

    success: bool
    message: str


class ControlReply(Message):
    call_id: int
    result: bool | str | SchedulerStats | None = None  # stop_profile: the trace's path
    update: WeightUpdate | None = None  # the answer to update_weights
    lora: LoraUpdate | None = None  # the answer to load/unload_lora_adapter
    error: str | None = None  # the op failed (e.g. the KV accounting check)
    refused: str | None = None  # the op's arguments or timing were wrong (a 400)


class SchedulerState(Message):
    """Published after steps (at most a few times a second) for gauges and health."""

    stats: SchedulerStats


class CacheEvents(Message):
    """A data-parallel replica's radix tree changes since its last CacheEvents (sent after
    each step that changed it), in order: (namespace, a sequence inserted, -1), or
    (namespace, the path from the root to an evicted node's end, how many of those tokens
    stay cached). The namespace is as requests name it: the uid of their LoRA adapter (0:
    none)."""

    replica: int
    changes: list[tuple[int, list[int], int]]
