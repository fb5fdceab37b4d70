"""Logprob bookkeeping, in one place: prompt-token logprobs from a prefill's logits, and the
sampled token's logprob (with the top alternatives, and the logprobs of the tokens the
request names in token_ids_logprob) after each step."""

from __future__ import annotations

import torch

from radixserve.core.output import LogprobEntry
from radixserve.core.req import Req
from radixserve.model.sampler import SampleOutput


def wants_prompt_logits(req: Req) -> bool:
    """Whether the prefill must return the logits of every new token of `req`: some of its
    prompt logprobs are still to come (a chunked prompt takes them chunk by chunk)."""
    return req.wants_input_logprobs and _next_target(req) < len(req.input_ids)


def _next_target(req: Req) -> int:
    """The first prompt position whose logprob is not recorded yet: the entries recorded
    are those of positions logprob_start_len, logprob_start_len + 1, ... in order (position
    0's is None)."""
    return req.logprob_start_len + len(req.input_logprobs)


def record_input_logprobs(req: Req, logits: torch.Tensor, start: int) -> None:
    """Logprobs of prompt tokens start+1..start+len(logits) (each from the logits of the
    position before it) not recorded yet; the first prompt token has none."""
    ids = req.input_ids
    lp_all = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    if start == 0 and _next_target(req) == 0:
        req.input_logprobs.append((None, ids[0]))
        req.input_top_logprobs.append([])
        if req.token_ids_logprob:
            req.input_token_ids_logprobs.append([])
    first = _next_target(req)
    targets = [p + 1 for p in range(start, start + len(logits))]
    keep = [(i, t) for i, t in enumerate(targets) if first <= t < len(ids)]
    if not keep:
        return
    rows = torch.tensor([i for i, _ in keep])
    tokens = torch.tensor([ids[t] for _, t in keep])
    chosen = lp_all[rows, tokens].tolist()
    req.input_logprobs += [(lp, ids[t]) for lp, (_, t) in zip(chosen, keep)]
    if req.top_logprobs_num:
        top_lp, top_ids = lp_all[rows].topk(req.top_logprobs_num, dim=-1)
        req.input_top_logprobs += [
            list(zip(lps, tids)) for lps, tids in zip(top_lp.tolist(), top_ids.tolist())
        ]
    if req.token_ids_logprob:
        req.input_token_ids_logprobs += _named(lp_all, rows, req.token_ids_logprob)


def _named(
    logprobs: torch.Tensor, rows: torch.Tensor, token_ids: list[int]
) -> list[list[LogprobEntry]]:
    """The logprobs of `token_ids` (in their order) in each of `rows`: (rows, ids) alone
    gathered, not a copy of whole rows."""
    picked = logprobs[rows[:, None], torch.tensor(token_ids)[None, :]].tolist()
    return [list(zip(row, token_ids)) for row in picked]


StepLogprobs = tuple[list[LogprobEntry], list[list[LogprobEntry]], list[list[LogprobEntry]]]


def record_output_logprobs(req: Req, out: SampleOutput, row: int) -> StepLogprobs:
    """Record the logprob of `req`'s latest sampled token (row `row` of the sampler's
    output), its top alternatives and its token_ids_logprob's; returns the new entries of
    each (a delta for the step's output)."""
    if not req.return_logprob or out.logprobs is None:
        return [], [], []
    entry = (float(out.logprobs[row]), req.output_ids[-1])
    req.output_logprobs.append(entry)
    top: list[list[LogprobEntry]] = []
    if req.top_logprobs_num and out.top_logprobs is not None and out.top_ids is not None:
        k = req.top_logprobs_num
        top = [list(zip(out.top_logprobs[row, :k].tolist(), out.top_ids[row, :k].tolist()))]
        req.output_top_logprobs += top
    named: list[list[LogprobEntry]] = []
    if req.token_ids_logprob and out.all_logprobs is not None:
        named = _named(out.all_logprobs, torch.tensor([row]), req.token_ids_logprob)
        req.output_token_ids_logprobs += named
    return [entry], top, named
