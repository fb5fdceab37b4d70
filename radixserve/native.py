"""The native API's generate call, expanded into one `Req` per sequence to run.

One call may carry a single prompt or a batch (text or token ids), one sampling-params dict
or one per prompt, and `n` samples per prompt; the offline Engine and the HTTP server both
expand it here, so both name and seed the sequences the same way.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams


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
) -> Expanded:
    """Validated requests; a ValueError names what is wrong with the call."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of text (prompt) and input_ids")
    if not prompt and not input_ids:
        raise ValueError("the prompt is empty: give a non-empty text or input_ids")
    if prompt is not None:
        single = isinstance(prompt, str)
        id_lists = [tokenize(p) for p in ([prompt] if single else prompt)]
    else:
        single = isinstance(input_ids[0], int)
        id_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
    if isinstance(sampling_params, list):
        if len(sampling_params) != len(id_lists):
            raise ValueError("sampling_params: a list needs one entry per prompt")
        params_list = [SamplingParams.from_dict(p) for p in sampling_params]
    else:
        params_list = [SamplingParams.from_dict(sampling_params)] * len(id_lists)
    rids = rid if isinstance(rid, list) else [rid] * len(id_lists)
    if len(rids) != len(id_lists):
        raise ValueError("rid: a list needs one entry per prompt")
    reqs = []
    for i, (ids, params) in enumerate(zip(id_lists, params_list)):
        base = rids[i] or uuid.uuid4().hex
        if isinstance(rid, str) and len(id_lists) > 1:
            base = f"{rid}_{i}"  # a str rid for a batch names each entry
        for j in range(params.n):
            seed = params.sampling_seed
            reqs.append(
                Req(
                    base if params.n == 1 else f"{base}_{j}",
                    ids,
                    params,
                    seed=-1 if seed is None else seed + j,
                    priority=priority or 0,
                    return_logprob=return_logprob,
                    logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
                    top_logprobs_num=top_logprobs_num or 0,
                )
            )
    return Expanded(reqs, single and len(reqs) == 1)
