"""A request as the scheduler sees it: its tokens, its sampling parameters, its KV state."""

from __future__ import annotations

import random
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve.core.embedding import EmbedParams
from radixserve.core.sampling_params import SamplingParams, ThinkBlock

if TYPE_CHECKING:  # annotations only: the runner level (Req, BatchBuilder) needs no msgspec
    from radixserve.core.output import FinishReason, LogprobEntry, ModelInfo


# where the draw seeds of sampled requests that give none come from, as they are sent
# (`draw_seed`; --random-seed starts it: `seed_draws`); one for the process
_SEEDS = random.Random()


def seed_draws(seed: int) -> None:
    """Start the seeds of requests that give none from `seed` (--random-seed)."""
    _SEEDS.seed(seed)


def draw_seed(req: Req) -> None:
    """Give `req` the next seed of the process's sequence if it samples and gives no seed
    of its own: called once a request is sent, in the order requests are, so that a run
    that sends the same requests in the same order samples the same tokens whatever else
    (greedy requests, embeddings, refused ones, probes) came between."""
    params = req.params
    samples = not params.is_greedy and params.max_new_tokens > 0 and req.embed is None
    if samples and params.sampling_seed is None:
        req.seed = _SEEDS.getrandbits(32)


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int = -1  # the draw seed: params.sampling_seed, else a random one
    priority: int = 0  # larger runs first under the "priority" policy
    # OpenAI's flex tier (a batch's lines by default): admitted after every waiting request
    # that is not deferred, and the first taken back to the queue to make room for one
    deferred: bool = False
    extra_key: Hashable = None  # namespaces the prefix cache (cache salt, adapter id)
    lora_id: int = 0  # the uid of the LoRA adapter it runs with (0: the base model)
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output logprobs only
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None  # these tokens' logprobs at every position
    # report the final-norm hidden state of every position run (SGLang's return_hidden_states)
    return_hidden_states: bool = False
    output_ids: list[int] = field(default_factory=list)
    grammar: Any = None  # a constrained.GrammarMatcher when the output follows a grammar
    think: ThinkBlock | None = None  # reasoning first, then the constraint (require_reasoning)
    spec: Any = None  # the speculator's state for this request (scheduler/speculative.py)
    embed: EmbedParams | None = None  # an embedding request: prefilled, pooled, never decoded
    pooled: Any = None  # its pooling so far across prefill chunks (scheduler/embedding.py)
    stop_text: Any = None  # its output's text for stop regexes (scheduler/stop.py OutputText)

    # KV state, owned by the scheduler
    row: int | None = None  # request→token table row while it holds KV
    kv_len: int = 0  # leading tokens of all_ids whose K/V are in the pool
    tree_len: int = 0  # leading tokens whose slots belong to the radix tree (locked)
    last_node: Any = None  # the radix node locked for those tokens
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (reported)
    # with the hierarchical cache: how many of those came from the host and the disk tier
    cached_lower: tuple[int, int] | None = None
    loaded_back: int = 0  # tokens the last admission loaded back onto the device
    disk_pending: int = 0  # tokens its disk prefetch put in the host tier, not yet loaded
    prefetch: Any = None  # its disk tier read in flight (cache/storage_tier.py)
    retractions: int = 0

    # results
    finish_reason: FinishReason | None = None
    output_logprobs: list[LogprobEntry] = field(default_factory=list)
    output_top_logprobs: list[list[LogprobEntry]] = field(default_factory=list)
    output_token_ids_logprobs: list[list[LogprobEntry]] = field(default_factory=list)
    input_logprobs: list[LogprobEntry] = field(default_factory=list)
    input_top_logprobs: list[list[LogprobEntry]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[LogprobEntry]] = field(default_factory=list)
    embedding: list[float] | None = None  # an embedding request's vector, once finished
    # with return_hidden_states: its rows so far (postprocess.HiddenChunks; rows past the KV
    # it keeps, a rejected draft's, are replaced later)
    hidden: Any = None
    created: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError("the prompt is empty: a request needs at least one input token")
        if self.embed is not None and self.params.max_new_tokens != 0:
            raise ValueError("an embedding request generates nothing: max_new_tokens must be 0")
        if self.seed < 0:
            seed = self.params.sampling_seed
            self.seed = random.getrandbits(32) if seed is None else seed
        self.check()

    def check(self) -> None:
        assert 0 <= self.tree_len <= self.kv_len <= len(self.input_ids) + len(self.output_ids)

    def check_fits(self, info: ModelInfo) -> None:
        """Raise ValueError unless this request can ever run on the loaded model: token ids
        in its vocabulary, prompt + max_new_tokens within its context and its KV pool."""
        vocab = info.vocab_size
        bad = [t for t in self.input_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"input_ids must be token ids in [0, {vocab}), got {bad[:5]}")
        self.params.verify_vocab(vocab)
        named = self.token_ids_logprob or []
        bad = [t for t in named if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"token_ids_logprob must be token ids in [0, {vocab}), got {bad[:5]}")
        need = len(self.input_ids) + self.params.max_new_tokens
        if need > info.context_length:
            raise ValueError(
                f"prompt ({len(self.input_ids)} tokens) + max_new_tokens "
                f"({self.params.max_new_tokens}) = {need} exceeds the context length "
                f"{info.context_length}"
            )
        if need > info.max_total_num_tokens:
            raise ValueError(
                f"the request needs {need} KV tokens but the KV pool holds only "
                f"{info.max_total_num_tokens}"
            )

    def tokens_left(self, context_len: int) -> int:
        """Tokens the request may still gain: within max_new_tokens and the context."""
        done = len(self.input_ids) + len(self.output_ids)
        return min(self.params.max_new_tokens - len(self.output_ids), context_len - done)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def stop_ids(self, eos_ids: set[int]) -> set[int]:
        """Token ids that end this request: its stop_token_ids, plus eos unless ignored."""
        ids = set(self.params.stop_token_ids)
        return ids if self.params.ignore_eos else ids | eos_ids

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.input_ids)

    @property
    def max_cacheable_prefix(self) -> int:
        """Prompt tokens that may come from the cache: input logprobs need the logits of the
        positions from logprob_start_len - 1 on, so those must be computed; mean pooling
        and return_hidden_states need every prompt position's hidden state, which the cache
        does not keep."""
        if (self.embed is not None and self.embed.needs_every_position) or (
            self.return_hidden_states
        ):
            return 0
        if self.wants_input_logprobs:
            return max(self.logprob_start_len - 1, 0)
        return len(self.input_ids) + len(self.output_ids) - 1
