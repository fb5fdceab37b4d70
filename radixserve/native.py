"""The native API's generate (and encode) call, expanded into one `Req` per sequence to run.

One call may carry a single prompt or a batch (text or token ids), one sampling-params dict
or one per prompt, and `n` samples per prompt; the offline Engine and the HTTP server both
expand it here, so both name and seed the sequences the same way.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixserve.core.embedding import EmbedParams
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams

SEED_MASK = 2**63 - 1  # sample j of a seeded prompt draws with seed + j, kept non-negative


class InvalidRequest(ValueError):
    """A call that cannot run; `param` names the field at fault (text, input_ids, rid...),
    `code` the kind of fault where an API has a code for it (context_length_exceeded)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class Expanded:
    reqs: list[Req]  # one per (prompt, sample), prompt-major
    single: bool  # the caller gets one result rather than a list


def expand_request(
    tokenize: Callable[[str], list[int]],
    prompt: str | list[str] | None,
    sampling_params: dict | list[dict] | None,
    input_ids: list[int] | list[list[int]] | None = None,
    return_logprob: bool = False,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    rid: str | list[str] | None = None,
    priority: int | None = None,
    max_sequences: int | None = None,
    embed: EmbedParams | None = None,
    token_ids_logprob: list[int] | list[list[int]] | None = None,
    lora_ids: int | Sequence[int] = 0,
    return_hidden_states: bool | Sequence[bool] = False,
) -> Expanded:
    """Validated requests; a ValueError names what is wrong with the call. With
    `max_sequences`, a call of more sequences (prompts × n) than that is refused before any
    prompt is tokenized. With `embed`, embedding requests (see `expand_embedding`).
    `token_ids_logprob`: tokens whose logprobs to report at every position (with
    return_logprob), one list for all prompts or one per prompt. `lora_ids`: the uid of the
    LoRA adapter to run with (0: none), one for all prompts or one per prompt.
    `return_hidden_states`: the requests report their final-norm hidden states (one flag for
    all prompts, or one per prompt)."""
    if (prompt is None) == (input_ids is None):
        raise InvalidRequest("give exactly one of text (prompt) and input_ids", "text")
    field = "text" if prompt is not None else "input_ids"
    if not prompt and not input_ids:
        raise InvalidRequest("the prompt is empty: give a non-empty text or input_ids", field)
    _check_logprob_args(logprob_start_len, top_logprobs_num)
    single = isinstance(prompt, str) if prompt is not None else isinstance(input_ids[0], int)
    count = 1 if single else len(prompt if prompt is not None else input_ids)
    params_list = _params_per_prompt(sampling_params, count)
    _check_count(params_list, max_sequences, field)
    rids = _rids(rid, count)
    named = _token_ids_per_prompt(token_ids_logprob, count)
    adapters = [lora_ids] * count if isinstance(lora_ids, int) else list(lora_ids)
    if len(adapters) != count:
        raise InvalidRequest(f"lora_path: a list needs one entry per prompt ({count})", "lora_path")
    hidden = (
        [return_hidden_states] * count
        if isinstance(return_hidden_states, bool)
        else list(return_hidden_states)
    )
    if len(hidden) != count:
        raise InvalidRequest(
            f"return_hidden_states: a list needs one entry per prompt ({count})",
            "return_hidden_states",
        )
    if prompt is not None:
        id_lists = [tokenize(p) for p in ([prompt] if single else prompt)]
    else:
        id_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
    reqs = []
    for ids, params, base, token_ids, lora_id, wants_hidden in zip(
        id_lists, params_list, rids, named, adapters, hidden, strict=True
    ):
        if not ids:
            raise InvalidRequest("a prompt of the batch is empty", field)
        for j in range(params.n):
            seed = params.sampling_seed
            reqs.append(
                Req(
                    base if params.n == 1 else f"{base}_{j}",
                    ids,
                    params,
                    seed=-1 if seed is None else (seed + j) & SEED_MASK,
                    priority=priority or 0,
                    return_logprob=return_logprob,
                    logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
                    top_logprobs_num=top_logprobs_num or 0,
                    token_ids_logprob=token_ids,
                    embed=embed,
                    lora_id=lora_id,
                    return_hidden_states=wants_hidden,
                )
            )
    _check_unique([req.rid for req in reqs])
    return Expanded(reqs, single and len(reqs) == 1)


def expand_embedding(
    tokenize: Callable[[str], list[int]],
    prompt: str | list[str] | None,
    input_ids: list[int] | list[list[int]] | None,
    embed: EmbedParams,
    rid: str | list[str] | None = None,
    max_sequences: int | None = None,
    lora_ids: int | Sequence[int] = 0,
) -> Expanded:
    """An embedding call (/encode, /v1/embeddings, Engine.encode): one prefill-only request
    per prompt (max_new_tokens 0), pooled as `embed` says; rids as for generation."""
    return expand_request(
        tokenize,
        prompt,
        {"max_new_tokens": 0},
        input_ids,
        rid=rid,
        max_sequences=max_sequences,
        embed=embed,
        lora_ids=lora_ids,
    )


def _check_logprob_args(logprob_start_len: int | None, top_logprobs_num: int | None) -> None:
    if logprob_start_len is not None and logprob_start_len < -1:
        message = f"logprob_start_len must be >= -1 (-1: output only), got {logprob_start_len}"
        raise InvalidRequest(message, "logprob_start_len")
    if top_logprobs_num is not None and top_logprobs_num < 0:
        message = f"top_logprobs_num must be >= 0, got {top_logprobs_num}"
        raise InvalidRequest(message, "top_logprobs_num")


def _token_ids_per_prompt(
    token_ids: list[int] | list[list[int]] | None, count: int
) -> list[list[int] | None]:
    if not token_ids:
        return [None] * count
    if all(isinstance(t, int) for t in token_ids):
        return [list(token_ids)] * count  # type: ignore[arg-type]
    if not all(isinstance(t, list) for t in token_ids) or len(token_ids) != count:
        raise InvalidRequest(
            "token_ids_logprob: give a list of token ids, or a list of them per prompt",
            "token_ids_logprob",
        )
    return [list(t) or None for t in token_ids]  # type: ignore[arg-type]


def _params_per_prompt(sampling_params: dict | list[dict] | None, count: int) -> list:
    if isinstance(sampling_params, list):
        if len(sampling_params) != count:
            raise InvalidRequest(
                "sampling_params: a list needs one entry per prompt", "sampling_params"
            )
        return [SamplingParams.from_dict(p) for p in sampling_params]
    return [SamplingParams.from_dict(sampling_params)] * count


def _check_count(params_list: list[SamplingParams], limit: int | None, field: str) -> None:
    total = sum(p.n for p in params_list)
    if limit is None or total <= limit:
        return
    prompts = len(params_list)
    raise InvalidRequest(
        f"this request asks for {total} sequences ({prompts} prompt(s) × n); at most "
        f"{limit} may be sent at once: send fewer prompts or a smaller n",
        "n" if prompts == 1 else field,
    )


def _rids(rid: str | list[str] | None, count: int) -> list[str]:
    """One base rid per prompt: given, or `{rid}_{i}` for a str rid of a batch, or new."""
    if isinstance(rid, list):
        if len(rid) != count:
            raise InvalidRequest("rid: a list needs one entry per prompt", "rid")
        return [r or uuid.uuid4().hex for r in rid]
    if isinstance(rid, str) and rid and count > 1:
        return [f"{rid}_{i}" for i in range(count)]  # a str rid for a batch names each entry
    return [rid or uuid.uuid4().hex for _ in range(count)]


def given_rids(rid: str | list[str] | None) -> frozenset[str]:
    """The rids a caller gave a call, by which `named_by` finds its sequences."""
    return frozenset([rid] if isinstance(rid, str) else rid or ())


def named_by(seq: str, rid: str, given: frozenset[str]) -> bool:
    """Whether the sequence `seq`, of a call given the rids `given`, is what a caller means
    by `rid` (to abort it): that very sequence, or one of the call's `{rid}_{i}` (see
    `_rids` and n > 1)."""
    return seq == rid or (rid in given and seq.startswith(rid + "_"))


def _check_unique(rids: list[str]) -> None:
    counts = Counter(rids)
    if len(counts) != len(rids):
        duplicate = next(r for r, c in counts.items() if c > 1)
        raise InvalidRequest(f"rid {duplicate!r} names two sequences of this request", "rid")
