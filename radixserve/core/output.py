"""What the engine reports, as plain typed data every process can import: why a request
finished, what one step changed for it (its new ids, then its new text), what the loaded
model allows, and the scheduler's counters. msgspec Structs, so they cross processes as
they are (no string-keyed dicts)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

LogprobEntry = tuple[float | None, int]  # (logprob or None, token id)


class FinishReason(msgspec.Struct, frozen=True, omit_defaults=True):
    """Why a request ended: a stop token or string (`matched`), its length limit, an abort
    (`message`), or an error confined to it (`message`; the engine goes on serving)."""

    type: Literal["stop", "length", "abort", "error"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    @classmethod
    def stop(cls, matched: int | str | None) -> FinishReason:
        return cls("stop", matched=matched)

    @classmethod
    def of_length(cls, length: int) -> FinishReason:
        return cls("length", length=length)

    @classmethod
    def abort(cls, message: str) -> FinishReason:
        return cls("abort", message=message)

    @classmethod
    def error(cls, message: str) -> FinishReason:
        return cls("error", message=message)

    def to_dict(self) -> dict[str, Any]:
        """The native API's shape: `{"type": "stop", "matched": ...}`, `{"type": "length",
        "length": n}`, `{"type": "abort", "message": ...}`."""
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": self.type, "message": self.message}


class ReqOutput(msgspec.Struct):
    """What changed for one request in one step (new tokens and logprobs are deltas)."""

    rid: str
    new_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    new_logprobs: list[LogprobEntry] = msgspec.field(default_factory=list)
    new_top_logprobs: list[list[LogprobEntry]] = msgspec.field(default_factory=list)
    # the logprobs of the request's token_ids_logprob, per new position
    new_token_ids_logprobs: list[list[LogprobEntry]] = msgspec.field(default_factory=list)
    input_logprobs: list[LogprobEntry] | None = None  # once, with the first output
    input_top_logprobs: list[list[LogprobEntry]] | None = None
    input_token_ids_logprobs: list[list[LogprobEntry]] | None = None
    spec: SpecCounts | None = None  # with speculative decoding on: the request's counts so far
    cached_tiers: CachedTiers | None = None  # with the hierarchical cache on
    embedding: list[float] | None = None  # an embedding request's vector, on its last output
    # with return_hidden_states, on its last output: the hidden state of every position run
    # (the prompt's, then each output token's but the last, which never ran)
    hidden_states: list[list[float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class CachedTiers(msgspec.Struct, array_like=True):
    """With the hierarchical cache: how many of a request's cached prompt tokens were
    loaded back from the host tier and read from the disk tier (the rest were on the
    device)."""

    host: int = 0
    disk: int = 0

    def details(self, cached_tokens: int) -> dict[str, int]:
        """`cached_tokens_details` of meta_info, as SGLang names it."""
        device = cached_tokens - self.host - self.disk
        return {"device": device, "host": self.host, "disk": self.disk}


class SpecCounts(msgspec.Struct, array_like=True):
    """One request's speculative decoding so far: decode steps that verified a draft, the
    drafted tokens verified, and those accepted."""

    verify_ct: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def accept_length(self) -> float:
        """Tokens committed per verified step (accepted drafts plus the step's own token)."""
        return (self.accepted_tokens + self.verify_ct) / self.verify_ct if self.verify_ct else 0.0

    def meta_info(self) -> dict[str, Any]:
        """The keys SGLang reports per request, and the counts behind them."""
        return {
            "spec_verify_ct": self.verify_ct,
            "spec_accept_length": self.accept_length,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
        }


LogprobTriple = tuple[float | None, int, str | None]  # (logprob, token id, its text or None)


class StrOut(msgspec.Struct, tag=True, array_like=True):
    """What one request's native result gained since the previous StrOut for it: its new
    text (stops trimmed; what a stop could still cut and incomplete characters held back, so
    the text only grows), new token ids and logprob triples, the counts so far, and on the
    last one the finish reason. Sent once per stream and step, so encoded as an array: no
    field names on the wire."""

    rid: str
    text_delta: str
    new_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    new_logprobs: list[LogprobTriple] = msgspec.field(default_factory=list)
    new_top_logprobs: list[list[LogprobTriple]] = msgspec.field(default_factory=list)
    new_token_ids_logprobs: list[list[LogprobTriple]] = msgspec.field(default_factory=list)
    input_logprobs: list[LogprobTriple] | None = None  # once, with the first delta
    input_top_logprobs: list[list[LogprobTriple]] | None = None
    input_token_ids_logprobs: list[list[LogprobTriple]] | None = None
    spec: SpecCounts | None = None
    cached_tiers: CachedTiers | None = None
    embedding: list[float] | None = None  # an embedding request's vector, on its last one
    hidden_states: list[list[float]] | None = None  # as ReqOutput's, on the last one

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class ModelInfo(msgspec.Struct, frozen=True):
    """The loaded model and the limits derived from it once, after load; every process
    receives this one object (the scheduler's Ready message carries it)."""

    model_path: str
    max_total_num_tokens: int  # KV pool slots
    max_running_requests: int
    context_length: int  # --context-length, else the model's own (max_position_embeddings)
    vocab_size: int
    dtype: str
    kv_cache_dtype: str
    kv_pool_bytes: int
    chunked_prefill_size: int = 0  # most new tokens a step takes (0: prompts are never cut)
    hidden_size: int = 0  # the length of an embedding (0: not reported)
    kernel_plan: dict[str, Any] = msgspec.field(default_factory=dict)
    cpu: dict[str, Any] = msgspec.field(default_factory=dict)
    # tensor parallelism: the ranks of a replica, and the bytes of weights each one holds
    tp_size: int = 1
    weight_bytes: list[int] = msgspec.field(default_factory=list)
    tp_pids: list[int] = msgspec.field(default_factory=list)  # the ranks' processes

    @property
    def max_seq_len(self) -> int:
        """The longest sequence (prompt + output) one request may have."""
        return min(self.context_length, self.max_total_num_tokens)

    @property
    def max_req_input_len(self) -> int:
        return self.max_seq_len - 1

    def as_dict(self) -> dict[str, Any]:
        return {**msgspec.structs.asdict(self), "max_req_input_len": self.max_req_input_len}


class SchedulerStats(msgspec.Struct):
    """The scheduler's counters and where every KV slot is (reported by /get_server_info,
    read by the benchmarks, turned into gauges by the HTTP process)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    retractions: int = 0
    preemptions: int = 0  # deferred (flex) requests taken back for requests that are not
    prefill_batches: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0  # prefill chunks that carried the running requests' decode step
    request_errors: int = 0  # requests ended by an error confined to them
    # where decode time goes: the forward pass vs the whole step (batch building, sampling,
    # stop checks, grammar, outputs) vs the loop iteration (receiving and sending too)
    decode_step_seconds: float = 0.0
    decode_forward_seconds: float = 0.0
    decode_loop_seconds: float = 0.0
    # prefill batches (mixed ones too, their decode rows included): the forward pass's
    # seconds and the prompt tokens they extended by
    prefill_forward_seconds: float = 0.0
    prefill_forward_tokens: int = 0
    kv_total: int = 0
    kv_free: int = 0
    kv_tree_evictable: int = 0
    kv_tree_protected: int = 0
    kv_held_by_requests: int = 0
    # the KV pool's pages still to be mapped when idle (cache/kv_pool.py; 0 once all are)
    kv_unmapped_bytes: int = 0
    # hybrid sliding-window memory (0 without it): the window layers' pool and its free slots
    swa_total: int = 0
    swa_free: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_grammar_queue: int = 0  # waiting for their grammar to compile (not in num_waiting)
    num_waiting_tokens: int = 0  # the tokens of those and the waiting ones, not in KV yet
    num_retracted_waiting: int = 0  # waiting ones retracted from running (output kept)
    num_held_for_update: int = 0  # requests that came after a weight update and wait for it
    lora_adapters_running: int = 0  # distinct LoRA adapters the running requests use
    gen_throughput: float = 0.0  # output tokens a second over the last RATE_WINDOW_S or so
    paused: str | None = None  # the mode of pause_generation while paused (None: running)
    grammar: dict[str, float] = msgspec.field(default_factory=dict)
    hicache: dict[str, float] = msgspec.field(default_factory=dict)  # tiers, when on
    # speculative decoding: request-steps that verified a draft, drafted tokens verified and
    # accepted, and both by draft position (index 0: the first drafted token)
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafted_by_position: list[int] = msgspec.field(default_factory=list)
    spec_accepted_by_position: list[int] = msgspec.field(default_factory=list)
    spec_cost_model: list[float] = msgspec.field(default_factory=list)  # [a, b] seconds
    pid: int = 0
    dp_rank: int = 0  # the data-parallel replica reporting (0 without data parallelism)

    @property
    def avg_spec_accept_length(self) -> float:
        """Tokens committed per request-step that verified a draft (SGLang's key)."""
        steps = self.spec_verify_steps
        return (self.spec_accepted_tokens + steps) / steps if steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Flat, as reported: grammar counters as `grammar_<name>`."""
        flat = msgspec.structs.asdict(self)
        grammar = flat.pop("grammar")
        hicache = flat.pop("hicache")
        flat["avg_spec_accept_length"] = self.avg_spec_accept_length
        return {
            **flat,
            **{f"grammar_{k}": v for k, v in grammar.items()},
            **{f"hicache_{k}": v for k, v in hicache.items()},
        }
