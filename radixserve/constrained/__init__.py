"""Constrained decoding: grammar backends (llguidance by default), per-step token masks and
jump-forward. The scheduler talks to it only through `Grammars`."""

from radixserve.constrained.base import Constraint, GrammarBackend, GrammarError, GrammarMatcher
from radixserve.constrained.grammars import Grammars

__all__ = ["Constraint", "GrammarBackend", "GrammarError", "GrammarMatcher", "Grammars"]
