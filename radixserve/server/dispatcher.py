"""Data parallelism's front: the main process sends each request to one of `--dp-size`
scheduler replicas, by `--load-balance-method`:

- `round_robin`: in turn;
- `shortest_queue`: the replica with the fewest requests in flight (ties in turn);
- `cache_aware`: the replica that holds the longest prefix of the prompt. The view is
  exact, not a guess: every replica reports each sequence its radix tree inserts and each
  leaf it evicts (`CacheEvents`), and the dispatcher mirrors each tree's token paths in a
  `TokenTrie` (a prompt dispatched but not yet cached counts too, from the requests in
  flight). Each namespace of the trees is mirrored apart, as requests name it (the uid of
  their LoRA adapter; 0: the base model): a prefix cached under one adapter is no hit for
  another's request nor the base model's, and an unloaded adapter's mirror is dropped. It
  is balanced against load: when the busiest replica has more than
  `BALANCE_ABS` requests beyond the idlest and `BALANCE_REL` times as many, and a replica
  has been starved (its share of recent dispatches, decayed by `SHARE_DECAY` a dispatch,
  fell under `STARVED_SHARE` of its fair share), the least loaded starved one gets the
  request. A burst of one group's arrivals passes before its replica's share grows that
  far, and moving one of a busy replica's prefixes onto a full replica would only evict
  another there; a hot prefix or a lopsided split does not pass, and copying its prefix to
  the idle replica spreads its traffic for good. Counting load alone fails both ways: a
  low bar moves prefixes on every burst, and the in-flight count of a replica that runs a
  hot prefix drops every time a batch finishes, so a bar on it never holds long. And a
  miss (no replica holds `MIN_HIT_TOKENS` of the prompt) goes to the replica with the most
  room (`Replica.footprint`: fewest tokens cached or to be added by its prompts in flight)
  among those not overloaded, ties to the least loaded, then in turn, so misses spread over
  the replicas instead of piling on the first one (the failure of a router that breaks ties
  by index) and prefix groups split evenly over the pools.

Aborts go to the replica running the request (all of them for abort-all); control
requests (flush, state, checks) go to every replica, and the tokenizer manager gathers one
reply from each.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from radixserve.core.messages import AbortReq, ControlReq, GenerateReq, Message

BALANCE_ABS = 4  # requests in flight beyond the idlest replica before load wins over hits
BALANCE_REL = 1.5  # ... and this many times its load
SHARE_DECAY = 1 / 16  # each dispatch's weight in a replica's recent share of them
STARVED_SHARE = 0.5  # ... under this fraction of its fair share, a replica is starved
MIN_HIT_TOKENS = 16  # a shorter cached prefix is a miss: load decides


class Sends(Protocol):
    def send(self, msg: Message) -> None: ...


class _Node:
    __slots__ = ("children",)

    def __init__(self) -> None:
        # first token of an edge → (the edge's tokens, the node below it)
        self.children: dict[int, tuple[tuple[int, ...], _Node]] = {}


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of a and b, by slice comparisons (run in C:
    the prompts of a prefix group share ~1k tokens, and a loop over them in Python per
    request in flight would cost milliseconds a dispatch)."""
    n = min(len(a), len(b))
    a, b = tuple(a[:n]), tuple(b[:n])
    if a == b:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _held(node: _Node) -> int:
    """Tokens on the edges below `node`."""
    total, stack = 0, [node]
    while stack:
        for edge, child in stack.pop().children.values():
            total += len(edge)
            stack.append(child)
    return total


class TokenTrie:
    """A set of token sequences closed under prefixes (a radix tree without KV): `match`
    is the longest prefix of a query that it holds."""

    def __init__(self) -> None:
        self.root = _Node()
        self.tokens = 0  # tokens held (the sum of the edges' lengths)

    def insert(self, tokens: Sequence[int]) -> None:
        node, i = self.root, 0
        while i < len(tokens):
            entry = node.children.get(tokens[i])
            if entry is None:
                node.children[tokens[i]] = (tuple(tokens[i:]), _Node())
                self.tokens += len(tokens) - i
                return
            edge, child = entry
            n = _common(edge, tokens[i:])
            if n < len(edge):  # split the edge where the new sequence leaves it
                middle = _Node()
                middle.children[edge[n]] = (edge[n:], child)
                node.children[tokens[i]] = (edge[:n], middle)
                child = middle
            node, i = child, i + n

    def match(self, tokens: Sequence[int]) -> int:
        node, i = self.root, 0
        while i < len(tokens):
            entry = node.children.get(tokens[i])
            if entry is None:
                return i
            edge, child = entry
            n = _common(edge, tokens[i:])
            if n < len(edge):
                return i + n
            node, i = child, i + n
        return i

    def truncate(self, tokens: Sequence[int], keep: int) -> None:
        """Forget the branch of `tokens` below depth `keep` (a replica evicted the node that
        held tokens[keep:] and whatever lay below it). The trie branches by token where the
        tree branches by page, so another cached sequence may share the path's first tokens
        past `keep`: the cut is then where that sequence leaves the path. A path the trie
        does not hold whole is left alone (nothing known to cut)."""
        if keep >= len(tokens):
            return
        path = []  # (node, depth where its edge starts, the edge, the child) down the path
        node, i = self.root, 0
        while i < len(tokens):
            entry = node.children.get(tokens[i])
            if entry is None:
                return
            edge, child = entry
            if _common(edge, tokens[i:]) < min(len(edge), len(tokens) - i):
                return
            path.append((node, i, edge, child))
            node, i = child, i + len(edge)
        for node, i, edge, child in reversed(path):  # the deepest branching past `keep`
            if i < keep:
                break
            if len(node.children) > 1:
                self.tokens -= len(edge) + _held(child)
                del node.children[edge[0]]
                return
        for node, i, edge, child in path:  # else: at depth `keep`
            if i <= keep < i + len(edge):
                self.tokens -= len(edge) - (keep - i) + _held(child)
                if keep == i:
                    del node.children[edge[0]]
                else:  # the cut falls inside the edge: keep its head, drop the rest
                    node.children[edge[0]] = (edge[: keep - i], _Node())
                return

    def __bool__(self) -> bool:
        return bool(self.root.children)


@dataclass
class InFlight:
    prompt: list[int]
    new_tokens: int  # what it adds to its replica: its prompt past the longest prefix held
    lora_id: int = 0  # its namespace


@dataclass
class Replica:
    sender: Sends
    cached: dict[int, TokenTrie] = field(default_factory=dict)  # by namespace (a lora uid)
    in_flight: dict[str, InFlight] = field(default_factory=dict)  # by rid

    def match(self, ids: Sequence[int], lora_id: int) -> int:
        """The longest prefix of `ids` its tree holds in namespace `lora_id`."""
        trie = self.cached.get(lora_id)
        return trie.match(ids) if trie is not None else 0

    @property
    def load(self) -> int:
        return len(self.in_flight)

    @property
    def footprint(self) -> int:
        """Tokens its tree holds, and those the prompts in flight will add: a prefix that
        several prompts in flight share counts once (each counts what it added when it was
        dispatched), and none once the tree holds it, so a replica running many requests of
        one group is not taken for one that holds many groups."""
        return sum(trie.tokens for trie in self.cached.values()) + sum(
            min(r.new_tokens, len(r.prompt) - self.match(r.prompt, r.lora_id))
            for r in self.in_flight.values()
        )

    def hit(self, ids: Sequence[int], lora_id: int = 0) -> int:
        """The longest prefix of `ids` this replica holds or is computing, in namespace
        `lora_id`."""
        best = self.match(ids, lora_id)
        for other in self.in_flight.values():
            if best == len(ids):
                break
            if other.lora_id == lora_id:
                best = max(best, _common(other.prompt, ids))
        return best


class Dispatcher:
    """Stands where the single scheduler's sender stood: `send` routes each message."""

    def __init__(self, senders: Sequence[Sends], method: str = "cache_aware") -> None:
        if method not in ("cache_aware", "round_robin", "shortest_queue"):
            raise ValueError(f"unknown load balance method {method!r}")
        self.replicas = [Replica(s) for s in senders]
        self.method = method
        self.owner: dict[str, int] = {}  # rid → the replica running it
        self._turn = itertools.count()
        self.recent = [1 / self.size] * self.size  # each one's share of recent dispatches
        self.sent = [0] * len(self.replicas)  # requests sent to each, cumulative
        # the uids of unloaded adapters: their namespaces are mirrored no more (events still
        # on their way, or of their last requests, are dropped; uids are never reused)
        self.unloaded: set[int] = set()

    @property
    def size(self) -> int:
        return len(self.replicas)

    def send(self, msg: Message) -> None:
        if isinstance(msg, GenerateReq):
            index, held = self.pick(msg.input_ids, msg.lora_id)
            replica = self.replicas[index]
            self.owner[msg.rid] = index
            new = len(msg.input_ids) - held
            replica.in_flight[msg.rid] = InFlight(msg.input_ids, new, msg.lora_id)
            self.sent[index] += 1
            self.recent = [(1 - SHARE_DECAY) * r for r in self.recent]
            self.recent[index] += SHARE_DECAY
            replica.sender.send(msg)
        elif isinstance(msg, AbortReq) and msg.rid in self.owner:
            self.replicas[self.owner[msg.rid]].sender.send(msg)
        elif isinstance(msg, AbortReq | ControlReq):
            if isinstance(msg, ControlReq) and msg.op == "unload_lora_adapter":
                self.unloaded.add(msg.args["uid"])  # no request names it again
            for replica in self.replicas:
                if isinstance(msg, ControlReq) and msg.op == "unload_lora_adapter":
                    replica.cached.pop(msg.args["uid"], None)
                replica.sender.send(msg)
        else:
            raise TypeError(f"cannot dispatch a {type(msg).__name__}")

    def done(self, rid: str) -> None:
        """The request finished (or was refused): it no longer loads its replica."""
        index = self.owner.pop(rid, None)
        if index is not None:
            self.replicas[index].in_flight.pop(rid, None)

    def on_cache_events(self, replica: int, changes: Sequence[tuple[int, list[int], int]]) -> None:
        """A replica's tree changes (`CacheEvents`), in order, each under its namespace:
        a sequence inserted (keep -1), or a path cut after `keep` tokens."""
        cached = self.replicas[replica].cached
        for lora_id, tokens, keep in changes:
            if lora_id in self.unloaded:
                continue
            trie = cached.get(lora_id)
            if keep >= 0:
                if trie is not None:
                    trie.truncate(tokens, keep)
                continue
            if trie is None:
                trie = cached[lora_id] = TokenTrie()
            trie.insert(tokens)

    # -- the policies -----------------------------------------------------------------------
    def pick(self, ids: Sequence[int], lora_id: int = 0) -> tuple[int, int]:
        """The replica for a prompt (of namespace `lora_id`), and how long a prefix of it
        that replica holds (known to cache_aware only: 0 otherwise)."""
        if self.size == 1:
            return 0, 0
        if self.method == "round_robin":
            return next(self._turn) % self.size, 0
        if self.method == "shortest_queue":
            return self._least_loaded(range(self.size)), 0
        hits = [r.hit(ids, lora_id) for r in self.replicas]
        best = max(hits)
        starved = [i for i, share in enumerate(self.recent) if share < STARVED_SHARE / self.size]
        if starved and self._unbalanced():
            index = self._least_loaded(starved)
        elif best < min(MIN_HIT_TOKENS, len(ids)):
            index = self._roomiest()
        else:
            index = self._least_loaded([i for i, h in enumerate(hits) if h == best])
        return index, hits[index]

    def _roomiest(self) -> int:
        """Where a miss goes: a new prefix starts a new working set, so the replica whose
        tree (and prompts in flight) holds the fewest tokens, among those within
        BALANCE_ABS requests of the least loaded; ties to the least loaded, then in turn.
        Spreading misses by load alone lets one replica collect more prefix groups than its
        pool holds while the other has room (they then evict each other's hits)."""
        least = min(r.load for r in self.replicas)
        footprints = {
            i: r.footprint for i, r in enumerate(self.replicas) if r.load <= least + BALANCE_ABS
        }  # each walks its replica's prompts in flight: once per miss
        room = min(footprints.values())
        return self._least_loaded([i for i, f in footprints.items() if f == room])

    def _unbalanced(self) -> bool:
        loads = [r.load for r in self.replicas]
        return max(loads) - min(loads) > BALANCE_ABS and max(loads) > BALANCE_REL * min(loads)

    def _least_loaded(self, candidates: Sequence[int] | range) -> int:
        """The least loaded candidate; among equals, the next in turn (so ties spread)."""
        least = min(self.replicas[i].load for i in candidates)
        tied = [i for i in candidates if self.replicas[i].load == least]
        return tied[next(self._turn) % len(tied)]
