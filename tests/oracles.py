"""Slow, obvious oracles the tests compare the library against."""

from __future__ import annotations

import itertools
import math



def brute_force_tree(lp, tok, anchor, budget, max_depth, top1_spine=False, min_prob=None):
    """The tree by definition: every prefix, sorted by (-logw, depth, rank tuple), first B.

    lp, tok: python lists [D][K] (log-probs, token ids) of one request.
    Returns a list of (ranks tuple, token, logw) in tree order, root excluded.
    """
    k = len(lp[0])
    nodes = []
    for d in range(1, max_depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            logw = 0.0
            for i, r in enumerate(ranks):
                logw += lp[i][r]
            if logw == -math.inf:
                continue
            nodes.append((ranks, logw))
    key = lambda item: (-item[1], len(item[0]), item[0])
    spine_depth = min(max_depth, budget) if top1_spine else 0
    is_spine = lambda ranks: len(ranks) <= spine_depth and not any(ranks)
    spine = [n for n in nodes if is_spine(n[0])]
    rest = sorted((n for n in nodes if not is_spine(n[0])), key=key)
    if min_prob is not None:
        rest = [n for n in rest if n[1] >= math.log(min_prob)]
    chosen = sorted(spine + rest[: budget - len(spine)], key=key)
    return [(r, tok[len(r) - 1][r[-1]], w) for r, w in chosen]


def tree_as_tuples(tree, b):
    """Request b of a DDTreeBuildResult as [(ranks tuple, token, logw)] in row order."""
    n = int(tree.num_nodes[b])
    parents = tree.parents[b].tolist()
    ranks = tree.ranks[b].tolist()
    tuples = {0: ()}
    out = []
    for i in range(1, n):
        tuples[i] = tuples[parents[i]] + (ranks[i],)
        out.append((tuples[i], int(tree.node_token_ids[b, i]), float(tree.node_logws[b, i])))
    return out


def tree_paths(parents, n):
    """Root-to-leaf paths (lists of node indices) of one request."""
    children = {i: [] for i in range(n)}
    for i in range(1, n):
        children[parents[i]].append(i)
    paths, stack = [], [[0]]
    while stack:
        p = stack.pop()
        if children[p[-1]]:
            stack.extend(p + [c] for c in children[p[-1]])
        else:
            paths.append(p)
    return paths


def exact_law(parents, tokens, probs, n):
    """Law of the emitted token sequence when each step samples from the target.

    probs: [N, V] float64 rows. Returns {tuple(tokens): probability}.
    """
    children = {i: [] for i in range(n)}
    for i in range(1, n):
        children[parents[i]].append(i)
    law = {}

    def walk(node, prefix, weight):
        child_of = {tokens[c]: c for c in children[node]}
        for v, p in enumerate(probs[node]):
            if p <= 0:
                continue
            if v in child_of:
                walk(child_of[v], prefix + (v,), weight * p)
            else:
                law[prefix + (v,)] = law.get(prefix + (v,), 0.0) + weight * p

    walk(0, (), 1.0)
    return law
