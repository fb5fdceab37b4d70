"""What a pattern costs the `regex` package to compile, told from its text alone, so that a
request's stop regexes can be refused before any process compiles them.

Measured (regex 2026.11, one core): compiling unrolls each counted repeat to as many
copies of what it repeats as its minimum count, at ~0.3 us a copy: `a{1000000}` takes
0.4 s, `(?:a{1000}){1000}` the same in 17 characters, and `a{4294967294}` grows past 18 GB
of memory. A repeat's upper bound costs nothing (`a{0,1000000}` compiles at once).
"""

from __future__ import annotations

import re

_COUNTED = re.compile(r"\{(\d*)(?:,\d*)?\}")  # {m}, {m,n}, {m,}, {,n}
_QUANTIFIERS = frozenset("*+?")


def unrolled_size(pattern: str) -> int:
    """How many items `pattern` holds once its counted repeats are unrolled to their minimum
    counts: each character or escape is one, a group the sum of its own, and `{m}` after an
    item makes it m of them (a minimum of 0 counts as 1). An upper bound of the real count:
    text that is no quantifier (a class's, a comment's, `\\x{41}`) may be counted as one."""
    frames = [_Frame()]  # the group being read, innermost last
    i = 0
    while i < len(pattern):
        char, frame = pattern[i], frames[-1]
        counted = _COUNTED.match(pattern, i) if char == "{" else None
        if counted is not None:
            frame.repeat(max(int(counted.group(1) or 0), 1))
            i = counted.end()
            continue
        if char == "(":
            frames.append(_Frame())
        elif char == ")" and len(frames) > 1:
            frames.pop()
            frames[-1].add(frame.total)
        elif char in _QUANTIFIERS:
            pass  # repeats the last item any number of times: no copy is unrolled
        elif char == "[":
            i = _class_end(pattern, i)
            frame.add(1)
            continue
        else:
            frame.add(1)
            i += char == "\\"  # an escape and the character it escapes are one item
        i += 1
    while len(frames) > 1:  # unbalanced: compiling will refuse it
        inner = frames.pop()
        frames[-1].add(inner.total)
    return frames[0].total


class _Frame:
    """A group's items so far, and the size of the last one (which a quantifier repeats)."""

    def __init__(self) -> None:
        self.total = 0
        self.last = 0

    def add(self, size: int) -> None:
        self.total += size
        self.last = size

    def repeat(self, count: int) -> None:
        self.total += self.last * (count - 1)
        self.last *= count


def _class_end(pattern: str, start: int) -> int:
    """The index after the `]` that closes the character class opened at `start` (a `]`
    first in it, after an optional `^`, is a member); the pattern's end if none does."""
    i = start + 1
    if pattern[i : i + 1] == "^":
        i += 1
    if pattern[i : i + 1] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1
