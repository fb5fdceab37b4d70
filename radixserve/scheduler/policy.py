"""Admission order of the waiting queue.

Cache-aware policies (`lpm`, `dfs-weight`) look each waiting request up in the radix tree;
the match is kept on the request (`req.last_node`/prefix) only at admission, so the order is
all a policy returns.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable

from radixserve.cache.radix_cache import RadixCache, TreeNode
from radixserve.core.req import Req

# Beyond this many waiting requests the cache-aware policies cost more than they save.
CACHE_AWARE_QUEUE_LIMIT = 128


def order_waiting(
    policy: str, waiting: list[Req], tree: RadixCache | None, rng: random.Random
) -> list[Req]:
    if policy in ("lpm", "dfs-weight") and (tree is None or len(waiting) > CACHE_AWARE_QUEUE_LIMIT):
        policy = "fcfs"
    if policy == "fcfs":
        return list(waiting)
    if policy == "lof":
        return sorted(waiting, key=lambda r: -r.params.max_new_tokens)
    if policy == "priority":
        return sorted(waiting, key=lambda r: -r.priority)
    if policy == "random":
        shuffled = list(waiting)
        rng.shuffle(shuffled)
        return shuffled
    assert tree is not None
    matches = {id(r): tree.match_prefix(_lookup_key(r), r.extra_key) for r in waiting}
    if policy == "lpm":
        return sorted(waiting, key=lambda r: -matches[id(r)].length)
    return _dfs_weight(waiting, lambda r: matches[id(r)].last_node)


def _lookup_key(req: Req) -> list[int]:
    return req.all_ids[: req.max_cacheable_prefix]


def _dfs_weight(waiting: list[Req], node_of: Callable[[Req], TreeNode]) -> list[Req]:
    """Depth-first over the radix tree, heavier subtrees (more waiting requests) first:
    requests sharing a prefix run back to back while it is cached (the paper's order)."""
    at_node: dict[int, list[Req]] = defaultdict(list)
    nodes: dict[int, TreeNode] = {}
    for req in waiting:
        node = node_of(req)
        at_node[id(node)].append(req)
        nodes[id(node)] = node
    weight: dict[int, int] = defaultdict(int)
    children: dict[int, set[int]] = defaultdict(set)
    roots: set[int] = set()
    for key, reqs in at_node.items():
        node = nodes[key]
        while True:  # add this node's requests to every ancestor's weight
            weight[id(node)] += len(reqs)
            parent = node.parent
            if parent is None:
                roots.add(id(node))
                break
            nodes[id(parent)] = parent
            children[id(parent)].add(id(node))
            node = parent
    order: list[Req] = []

    def visit(key: int) -> None:
        order.extend(at_node.get(key, ()))
        for child in sorted(children[key], key=lambda k: -weight[k]):
            visit(child)

    for root in sorted(roots, key=lambda k: -weight[k]):
        visit(root)
    return order
