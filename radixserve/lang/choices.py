"""How `select` turns per-token scores of each choice into a decision.

Each method gets, per choice, the logprobs of the choice's own tokens given the prompt
(after token healing: a token the choice shares with the end of the prompt is scored as part
of the choice), and for `unconditional_likelihood_normalized` the same tokens' logprobs
without the prompt. The three methods are SGLang's; their arithmetic is ours.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ChoiceScores:
    """One choice as scored by a backend: its token ids and their logprobs (a logprob may
    be None where the model has no context to score it, e.g. the first token of a text)."""

    token_ids: list[int]
    logprobs: list[float | None]
    unconditional_logprobs: list[float | None] | None = None
    healed_tokens: int = 0  # prompt tokens re-scored as part of the choice
    token_texts: list[str] | None = None  # each token's text, where the backend gives it

    def normalized(self) -> float:
        """Mean logprob over the scored tokens (-inf for a choice with none scored)."""
        values = [x for x in self.logprobs if x is not None]
        return sum(values) / len(values) if values else -math.inf


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def _triples(scores: ChoiceScores) -> list[list[Any]]:
    """SGLang's meta_info shape: [logprob, token id, token text] per token (the text None
    where the backend gives none)."""
    texts = scores.token_texts or [None] * len(scores.token_ids)
    return [list(entry) for entry in zip(scores.logprobs, scores.token_ids, texts)]


class ChoicesSamplingMethod(ABC):
    requires_unconditional_logprobs: bool = False

    @abstractmethod
    def __call__(self, choices: list[str], scores: list[ChoiceScores]) -> ChoicesDecision: ...

    @staticmethod
    def meta_info(scores: list[ChoiceScores]) -> dict[str, Any]:
        return {
            "normalized_prompt_logprobs": [s.normalized() for s in scores],
            "input_token_logprobs": [_triples(s) for s in scores],
            "output_token_logprobs": [[] for _ in scores],
        }

    def __repr__(self) -> str:
        return type(self).__name__


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob."""

    def __call__(self, choices: list[str], scores: list[ChoiceScores]) -> ChoicesDecision:
        best = _argmax([s.normalized() for s in scores])
        return ChoicesDecision(choices[best], self.meta_info(scores))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token by token, keep the choices whose token has the highest logprob at that
    position, until one is left. A choice shorter than the others is extended with its own
    mean logprob, so a choice that is a prefix of another still competes."""

    def __call__(self, choices: list[str], scores: list[ChoiceScores]) -> ChoicesDecision:
        width = max(len(s.logprobs) for s in scores)
        matrix = [self._row(s, width) for s in scores]
        remaining = list(range(len(choices)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        meta = self.meta_info(scores) | {"greedy_logprob_matrix": matrix}
        return ChoicesDecision(choices[remaining[0]], meta)

    @staticmethod
    def _row(scores: ChoiceScores, width: int) -> list[float]:
        mean = scores.normalized()
        row = [mean if x is None else x for x in scores.logprobs]
        return row + [mean] * (width - len(row))


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice whose tokens gain most from the prompt: the mean over its tokens of
    logprob(token | prompt) - logprob(token | the choice's own earlier tokens). A token
    without an unconditional logprob (the first) counts its unconditional logprob as 0."""

    requires_unconditional_logprobs = True

    def __call__(self, choices: list[str], scores: list[ChoiceScores]) -> ChoicesDecision:
        values = [self._gain(s) for s in scores]
        meta = self.meta_info(scores) | {
            "unconditional_token_logprobs": [s.unconditional_logprobs for s in scores],
            "normalized_unconditional_prompt_logprobs": values,
        }
        return ChoicesDecision(choices[_argmax(values)], meta)

    @staticmethod
    def _gain(scores: ChoiceScores) -> float:
        if scores.unconditional_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        if len(scores.unconditional_logprobs) != len(scores.logprobs):
            raise ValueError("conditional and unconditional logprobs differ in length")
        gains = [
            c - (u or 0.0)
            for c, u in zip(scores.logprobs, scores.unconditional_logprobs)
            if c is not None
        ]
        return sum(gains) / len(gains) if gains else -math.inf


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
