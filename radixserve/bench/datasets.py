"""Workloads for the benchmarks: prompts (text or token ids) with the number of tokens to
generate for each, made from a seed so that two runs send the same requests.

Every workload is a list of `Conversation`s. A single-prompt workload is one-turn
conversations; in a multi-turn one, turn k's prompt is turn k-1's prompt, then the answer the
server gave to it, then `questions[k]`, so each turn extends a prefix the server has seen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Prompt = str | list[int]  # text, or token ids sent as they are
FIRST_RANDOM_ID = 100  # random prompts draw ids from here up: the lowest ids are special
SHAREGPT_MAX_TOKENS = 2048  # a ShareGPT entry whose prompt + answer exceed this is skipped
SHAREGPT_MIN_TOKENS = 4  # ... and so is one whose prompt or answer is shorter than this
SYSTEM_PROMPT_SEED_OFFSET = 1_000_003  # multi-turn system prompts: a generator of their own


@dataclass(frozen=True)
class Conversation:
    """Turns sent one after another, each asking for `output_lens[k]` tokens."""

    questions: list[Prompt]
    output_lens: list[int]

    def __post_init__(self) -> None:
        assert self.questions and len(self.questions) == len(self.output_lens)
        assert all(n >= 1 for n in self.output_lens), self.output_lens
        assert len(self.questions) == 1 or all(isinstance(q, str) for q in self.questions), (
            "only text conversations can have several turns"
        )

    @property
    def num_turns(self) -> int:
        return len(self.questions)


@dataclass(frozen=True)
class PrefixGroup:
    """Prompts sharing one system prompt: each is `system` followed by one of `questions`."""

    system: list[int]
    questions: list[list[int]]


def random_ids(gen: torch.Generator, n: int, vocab_size: int) -> list[int]:
    """`n` token ids drawn uniformly from [FIRST_RANDOM_ID, vocab_size)."""
    return torch.randint(FIRST_RANDOM_ID, vocab_size, (n,), generator=gen).tolist()


def shared_prefix_groups(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    vocab_size: int,
    seed: int,
) -> list[PrefixGroup]:
    """Random-token groups: a system prompt of `system_prompt_len` tokens per group and
    `prompts_per_group` questions of `question_len` tokens each."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(num_groups):
        system = random_ids(gen, system_prompt_len, vocab_size)
        questions = [random_ids(gen, question_len, vocab_size) for _ in range(prompts_per_group)]
        groups.append(PrefixGroup(system, questions))
    return groups


def shared_prefix_prompts(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    vocab_size: int,
    seed: int,
) -> list[list[int]]:
    """The groups of `shared_prefix_groups` as token-id prompts, group after group."""
    groups = shared_prefix_groups(
        num_groups, prompts_per_group, system_prompt_len, question_len, vocab_size, seed
    )
    return [g.system + q for g in groups for q in g.questions]


def text_of_len(tokenizer: Any, ids: list[int], n: int) -> str:
    """Text made from `ids` that the tokenizer reads as at most `n` tokens (seldom fewer).

    Decoding random ids and encoding the text again seldom gives the same ids (byte tokens
    decode to replacement characters, neighbours merge), so the text is cut down, by the
    tokens it has too many, until it fits."""
    tokens = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)
    keep = n
    while True:
        text = tokenizer.decode(tokens[:keep])
        excess = len(tokenizer.encode(text, add_special_tokens=False)) - n
        if excess <= 0 or keep <= 1:
            return text
        keep -= excess


def random_lengths(gen: torch.Generator, n: int, length: int, range_ratio: float) -> list[int]:
    """`n` lengths drawn uniformly from [max(1, length * range_ratio), length]."""
    low = max(1, int(length * range_ratio))
    return torch.randint(low, length + 1, (n,), generator=gen).tolist()


def random_workload(
    tokenizer: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    as_ids: bool,
) -> list[Conversation]:
    """Prompts of random tokens, as token ids (`as_ids`) or as the text they decode to."""
    gen = torch.Generator().manual_seed(seed)
    input_lens = random_lengths(gen, num_prompts, input_len, range_ratio)
    output_lens = random_lengths(gen, num_prompts, output_len, range_ratio)
    workload = []
    for n_in, n_out in zip(input_lens, output_lens):
        ids = random_ids(gen, n_in, len(tokenizer))
        prompt: Prompt = ids if as_ids else text_of_len(tokenizer, ids, n_in)
        workload.append(Conversation([prompt], [n_out]))
    return workload


def shared_prefix_workload(
    tokenizer: Any,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[Conversation]:
    """SGLang's generated-shared-prefix: each prompt is its group's system prompt, a blank
    line, then its own question; all prompts shuffled together."""
    groups = shared_prefix_groups(
        num_groups, prompts_per_group, system_prompt_len, question_len, len(tokenizer), seed
    )
    prompts = []
    for group in groups:
        system = text_of_len(tokenizer, group.system, system_prompt_len)
        prompts += [
            system + "\n\n" + text_of_len(tokenizer, q, question_len) for q in group.questions
        ]
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed))
    return [Conversation([prompts[i]], [output_len]) for i in order.tolist()]


def multi_turn_workload(
    tokenizer: Any,
    num_conversations: int,
    num_turns: int,
    question_len: int,
    output_len: int,
    seed: int,
    system_prompt_len: int = 0,
    conversations_per_system: int = 1,
) -> list[Conversation]:
    """Conversations of `num_turns` random-text questions of `question_len` tokens.

    With `system_prompt_len` > 0, consecutive conversations in groups of
    `conversations_per_system` share a random-text system prompt of that many tokens, put
    before the first question of each (then a blank line), so every later turn extends it.
    The questions are the same with or without system prompts: those are drawn apart."""
    assert conversations_per_system >= 1, conversations_per_system
    gen = torch.Generator().manual_seed(seed)
    system_gen = torch.Generator().manual_seed(seed + SYSTEM_PROMPT_SEED_OFFSET)

    def text(n: int, g: torch.Generator) -> str:
        return text_of_len(tokenizer, random_ids(g, n, len(tokenizer)), n)

    workload = []
    system = ""
    for i in range(num_conversations):
        questions = [text(question_len, gen) for _ in range(num_turns)]
        if system_prompt_len > 0:
            if i % conversations_per_system == 0:
                system = text(system_prompt_len, system_gen)
            questions[0] = system + "\n\n" + questions[0]
        workload.append(Conversation(questions, [output_len] * num_turns))
    return workload


def sharegpt_workload(
    tokenizer: Any,
    path: str | Path,
    num_prompts: int,
    output_len: int | None,
    seed: int,
) -> list[Conversation]:
    """Up to `num_prompts` entries of a ShareGPT file, in an order drawn from `seed`: the
    first human turn is the prompt, and the gpt answer after it gives the output length
    (its token count) unless `output_len` is set. Entries too short or too long are skipped."""
    entries = json.loads(Path(path).read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path}: a ShareGPT file holds a JSON list of conversations")
    order = torch.randperm(len(entries), generator=torch.Generator().manual_seed(seed))
    workload = []
    for i in order.tolist():
        pair = first_exchange(entries[i])
        if pair is None:
            continue
        prompt, answer = pair
        n_in = len(tokenizer.encode(prompt, add_special_tokens=False))
        n_out = output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        if _sharegpt_fits(n_in, n_out, fixed_output=output_len is not None):
            workload.append(Conversation([prompt], [n_out]))
        if len(workload) == num_prompts:
            break
    return workload


def first_exchange(entry: Any) -> tuple[str, str] | None:
    """(first human message, the gpt answer that follows it) of a ShareGPT entry."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for question, answer in zip(turns, turns[1:]):
        if question.get("from") == "human" and answer.get("from") == "gpt":
            return str(question.get("value", "")), str(answer.get("value", ""))
    return None


def _sharegpt_fits(n_in: int, n_out: int, fixed_output: bool) -> bool:
    if n_in < SHAREGPT_MIN_TOKENS or (n_out < SHAREGPT_MIN_TOKENS and not fixed_output):
        return False
    return n_in + n_out <= SHAREGPT_MAX_TOKENS
