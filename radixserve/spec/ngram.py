"""N-gram drafts: continue a request's last tokens the way they continued before.

`NgramIndex` maps every short n-gram (`key_len` tokens) of some token sequences to where it
was followed by something, most recent first. A lookup takes a request's last tokens, finds
the occurrences of their last `key_len` tokens, measures how far back each occurrence keeps
matching (up to `max_match` tokens) and proposes what followed the longest match.

Two indexes feed each request's drafts (`NgramDrafter`):
  - its own: the request's prompt and output so far (prompt lookup), grown by the tokens
    each step adds;
  - a shared one: every finished request's whole sequence (prompt and output), the same
    sequences the radix tree is given, kept up to `capacity` tokens, oldest dropped first
    (so it holds what the tree holds and also what the tree has since evicted).

Cost per step and request: one dict lookup per index and a backward comparison of at most
`max_match` tokens per candidate (`CANDIDATES` per key); adding a sequence costs one dict
insert per token. A hash collision only yields a draft that verification rejects: drafts
never change what is generated, only how many tokens one forward pass commits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

CANDIDATES = 4  # occurrences kept per n-gram key (the most recent)


@dataclass(frozen=True)
class Draft:
    tokens: list[int]  # proposed continuation, in order
    match_len: int  # how many of the request's last tokens matched where it was found
    source: str  # "self" (its own tokens) or "shared" (another request's)


class NgramIndex:
    def __init__(self, key_len: int, max_match: int) -> None:
        assert 1 <= key_len <= max_match
        self.key_len = key_len
        self.max_match = max_match
        # key → [(sequence, position after the n-gram)], most recent last
        self._where: dict[int, list[tuple[Sequence[int], int]]] = {}

    def add(self, seq: Sequence[int], start: int, end: int) -> None:
        """Index the n-grams of `seq` followed by a token at positions [start, end)."""
        n = self.key_len
        for pos in range(max(start, n), min(end, len(seq))):
            hits = self._where.setdefault(hash(tuple(seq[pos - n : pos])), [])
            hits.append((seq, pos))
            if len(hits) > CANDIDATES:
                del hits[0]

    def remove(self, seq: Sequence[int]) -> None:
        """Forget every occurrence in `seq` (by identity)."""
        n = self.key_len
        for pos in range(n, len(seq)):
            key = hash(tuple(seq[pos - n : pos]))
            hits = self._where.get(key)
            if hits is None:
                continue
            hits[:] = [h for h in hits if h[0] is not seq]
            if not hits:
                del self._where[key]

    def lookup(self, suffix: Sequence[int], max_tokens: int, source: str) -> Draft | None:
        """What followed the longest earlier match of `suffix`'s last tokens."""
        n = self.key_len
        if len(suffix) < n or max_tokens < 1:
            return None
        hits = self._where.get(hash(tuple(suffix[-n:])))
        if not hits:
            return None
        best: tuple[int, Sequence[int], int] | None = None
        limit = min(self.max_match, len(suffix))
        for seq, pos in reversed(hits):  # most recent first: it wins ties
            m = 0
            while m < limit and m < pos and seq[pos - 1 - m] == suffix[-1 - m]:
                m += 1
            if m >= n and (best is None or m > best[0]):
                best = (m, seq, pos)
        if best is None:
            return None
        m, seq, pos = best
        tokens = list(seq[pos : pos + max_tokens])
        return Draft(tokens, m, source) if tokens else None


@dataclass
class OwnTokens:
    """A request's own tokens as its drafts see them, and their index."""

    index: NgramIndex
    tokens: list[int] = field(default_factory=list)

    def sync(self, input_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Append what the request gained since the last sync (its tokens only ever grow)
        and index it."""
        done = len(self.tokens)
        if done < len(input_ids):
            self.tokens.extend(input_ids[done:])
            self.tokens.extend(output_ids)
        else:
            self.tokens.extend(output_ids[done - len(input_ids) :])
        self.index.add(self.tokens, done, len(self.tokens))


class SharedIndex:
    """The n-gram index over finished requests' sequences, bounded to `capacity` tokens."""

    def __init__(self, key_len: int, max_match: int, capacity: int) -> None:
        self.index = NgramIndex(key_len, max_match)
        self.capacity = capacity
        self._seqs: deque[tuple[int, ...]] = deque()
        self.num_tokens = 0

    def add(self, tokens: Sequence[int]) -> None:
        if self.capacity <= 0 or len(tokens) <= self.index.key_len:
            return
        seq = tuple(tokens[-self.capacity :])
        self._seqs.append(seq)
        self.num_tokens += len(seq)
        self.index.add(seq, 0, len(seq))
        while self.num_tokens > self.capacity:
            old = self._seqs.popleft()
            self.num_tokens -= len(old)
            self.index.remove(old)

    def lookup(self, suffix: Sequence[int], max_tokens: int) -> Draft | None:
        return self.index.lookup(suffix, max_tokens, "shared")


class NgramDrafter:
    """Drafts for running requests from their own tokens and the shared index."""

    def __init__(self, min_match: int, max_match: int, capacity: int) -> None:
        self.min_match = min_match
        self.max_match = max_match
        self.shared = SharedIndex(min_match, max_match, capacity)

    def own_tokens(self) -> OwnTokens:
        return OwnTokens(NgramIndex(self.min_match, self.max_match))

    def propose(
        self, own: OwnTokens, input_ids: Sequence[int], output_ids: Sequence[int], max_tokens: int
    ) -> Draft | None:
        """The longer-matching of the request's own draft and the shared one (own on ties)."""
        own.sync(input_ids, output_ids)
        suffix = own.tokens
        mine = own.index.lookup(suffix, max_tokens, "self")
        theirs = self.shared.lookup(suffix, max_tokens)
        if theirs is not None and (mine is None or theirs.match_len > mine.match_len):
            return theirs
        return mine

    def finished(self, all_ids: Sequence[int]) -> None:
        self.shared.add(all_ids)
