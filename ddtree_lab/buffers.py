"""Buffers stage: tree -> DDTreeVerifyInput (SGLang's retrieve encoding), and the buffers' validator.

Retrieve encoding: the flat tree buffers a serving engine verifies from.

The layout is SGLang's ``retrive_*`` layout (sgl-project/sglang,
``srt/speculative/eagle_utils.py`` / ``sgl-kernel`` ``verify_tree_greedy`` and
``tree_speculative_sampling_target_only``), under full names:

* ``retrieve_index[b, i] = b * N + i`` -- the node's row in the flattened ``[bs * N]`` batch
  (``-1`` for padding rows);
* ``retrieve_next_token[b, i]`` -- local index of node ``i``'s first child (its child with
  the highest log-weight), ``-1`` for a leaf;
* ``retrieve_next_sibling[b, i]`` -- local index of the next sibling (the sibling with the
  next lower log-weight), ``-1`` for the last one.

A verifier walks from node 0: ``retrieve_next_token`` to go down, ``retrieve_next_sibling``
to try the next candidate at the same depth. Because :func:`ddtree_lab.build_tree` emits
nodes in tree order (descending log-weight, ties by depth then rank tuple), children in
ascending index order *are* children in descending log-weight order.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ._arguments import check_shape, check_tensor
from .build import DDTreeBuildResult, TreeBatch
from .problems import Problem
from .hostsync import to_device

__all__ = [
    "DDTreeVerifyInput",
    "RetrieveError",
    "compile_retrieve",
    "encode_retrieve",
    "decode_retrieve",
    "tree_attention_mask",
    "find_retrieve_problem",
    "find_retrieve_problems",
    "check_retrieve",
    "check_verify_buffers",
]


class RetrieveError(ValueError):
    """A broken retrieve-buffer invariant; ``request`` and ``node`` say where (``problem``: the
    :class:`~ddtree_lab.problems.Problem` when it came from :func:`find_retrieve_problems`)."""

    def __init__(self, message: str, request: int, node: int, problem: Problem | None = None):
        super().__init__(f"request {request}, node {node}: {message}")
        self.request = request
        self.node = node
        self.problem = problem


def _error(problem: Problem) -> RetrieveError:
    # only problems from find_retrieve_problems come here, and each of those names its request and node
    assert problem.request is not None and problem.node is not None
    return RetrieveError(problem.message, problem.request, problem.node, problem)


@dataclass(frozen=True)
class DDTreeVerifyInput(TreeBatch):
    """Everything a verifier and the target's tree forward need for one batch.

    Attributes (``N`` rows per request, padding rows past ``num_nodes``):
        node_token_ids: ``[bs, N]`` int64, token of each node (root = anchor; padding -1).
        retrieve_index: ``[bs, N]`` int64, ``b * N + i`` (padding -1).
        retrieve_next_token: ``[bs, N]`` int64, first child or -1.
        retrieve_next_sibling: ``[bs, N]`` int64, next sibling or -1.
        tree_mask: ``[bs, N, N]`` bool, row ``i`` may attend column ``j`` iff ``j`` is ``i``
            or an ancestor of ``i``. A padding row attends only to itself (keeps a forward
            finite) and no real row attends to a padding row.
        positions: ``[bs, N]`` int64, ``prefix_len + depth`` (padding: ``prefix_len``).
        depths: ``[bs, N]`` int64 (padding -1).
        num_nodes: ``[bs]`` int64.
    """

    node_token_ids: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    tree_mask: torch.Tensor
    positions: torch.Tensor
    depths: torch.Tensor
    num_nodes: torch.Tensor

    def request(self, b: int) -> "DDTreeVerifyInput":
        """Request ``b`` as a batch of one; ``retrieve_index`` is re-based to row 0."""
        parts = {f.name: getattr(self, f.name)[b : b + 1] for f in fields(self)}
        ri = parts["retrieve_index"]
        parts["retrieve_index"] = torch.where(ri >= 0, ri - b * self.num_rows, ri)
        return DDTreeVerifyInput(**parts)

    def compact(self) -> "DDTreeVerifyInput":
        """The same buffers with the padding rows past the largest ``num_nodes`` dropped
        (``N = max(num_nodes)``; ``tree_mask`` cut to ``[bs, N, N]``), on the CPU, detached.
        Only for a batch of one or request-local indices: ``retrieve_index`` is kept as it is."""
        n = int(self.num_nodes.max()) if self.num_nodes.numel() else 0
        parts = {}
        for f in fields(self):
            v = getattr(self, f.name)
            v = v if f.name == "num_nodes" else v[:, :n, :n] if f.name == "tree_mask" else v[:, :n]
            parts[f.name] = v.detach().cpu().clone()
        return DDTreeVerifyInput(**parts)


def encode_retrieve(parents: torch.Tensor, num_nodes: torch.Tensor, *, validate: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Retrieve buffers from parent indices; children are linked in ascending index order.

    For trees in tree order (as :func:`ddtree_lab.build_tree` returns them) ascending index
    is descending log-weight, which is the order SGLang's verifiers expect.

    Args:
        parents: ``[bs, N]`` int64, parent of each node (root -1, padding -1); every parent
            index is smaller than its child's.
        num_nodes: ``[bs]`` int64.

    Returns:
        ``(retrieve_index, retrieve_next_token, retrieve_next_sibling)``, each ``[bs, N]`` int64.

        validate: check the parents (one host read); ``False`` for trees the lab's builders
            made (the live step: no host read here).

    Raises:
        ValueError: a parent index not smaller than its child's, or outside the request's nodes.
    """
    check_tensor("parents", parents, dtype=torch.int64, ndim=2)
    check_tensor("num_nodes", num_nodes, dtype=torch.int64, ndim=1)
    bs, n = parents.shape
    check_shape("num_nodes", num_nodes, (bs,))
    device = parents.device
    idx = torch.arange(n, device=device).expand(bs, n)
    real = idx < num_nodes[:, None]
    child = real & (idx > 0)
    bad = child & ((parents < 0) | (parents >= idx))
    if validate and bad.any():
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"request {b}, node {i}: parent {int(parents[b, i])} must be in [0, {i}) (parents precede children)"
        )
    retrieve_index = torch.where(real, torch.arange(bs, device=device)[:, None] * n + idx, -1)
    # Group children by parent, ascending index inside a group (stable sort on parent).
    key = torch.where(child, parents, n)  # non-children sort last
    order = torch.sort(key, dim=1, stable=True).indices
    sorted_parent = key.gather(1, order)
    same_next = torch.zeros_like(child)
    same_next[:, :-1] = (sorted_parent[:, 1:] == sorted_parent[:, :-1]) & (sorted_parent[:, :-1] < n)
    next_in_order = torch.full_like(order, -1)
    next_in_order[:, :-1] = order[:, 1:]
    retrieve_next_sibling = torch.full_like(parents, -1)
    retrieve_next_sibling.scatter_(1, order, torch.where(same_next, next_in_order, -1))
    # First child: the first of each group.
    first = torch.ones_like(child)
    first[:, 1:] = sorted_parent[:, 1:] != sorted_parent[:, :-1]
    first &= sorted_parent < n
    retrieve_next_token = torch.full((bs, n + 1), -1, dtype=torch.int64, device=device)
    retrieve_next_token.scatter_(1, torch.where(first, sorted_parent, n), torch.where(first, order, -1))
    return retrieve_index, retrieve_next_token[:, :n].contiguous(), retrieve_next_sibling


def tree_attention_mask(parents: torch.Tensor, num_nodes: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """Ancestor-or-self mask ``[bs, N, N]`` bool from parents ``[bs, N]`` int64.

    Row ``i`` is True at ``i`` and at each ancestor of ``i``. Padding rows are True only on
    the diagonal. ``max_depth`` bounds the ancestor walk; given, the walk runs exactly that
    many steps and reads nothing on the host; None (default): up to ``N - 1`` steps, stopping
    (one host read per step) when every node has reached the root.
    """
    bs, n = parents.shape
    device = parents.device
    real = torch.arange(n, device=device)[None, :] < num_nodes[:, None]
    mask = torch.eye(n, dtype=torch.bool, device=device).expand(bs, n, n).clone()
    cur = torch.where(real, parents, -1)
    rows = torch.arange(n, device=device).expand(bs, n)
    for _ in range(n - 1 if max_depth is None else max_depth):
        has = cur >= 0
        if max_depth is None and not has.any():
            break
        mask.scatter_(2, torch.where(has, cur, rows)[..., None], True)  # no ancestor: its own diagonal
        cur = torch.where(has, parents.gather(1, cur.clamp(min=0)), -1)
    return mask


def compile_retrieve(tree: DDTreeBuildResult, prefix_len: int | torch.Tensor, *, max_depth: int | None = None,
                     validate: bool = True) -> DDTreeVerifyInput:
    """Compile a built tree into the verify buffers (DESIGN.md, "Retrieve encoding").

    Args:
        tree: the result of :func:`ddtree_lab.build_tree` (nodes in tree order).
        prefix_len: tokens already in the target's KV cache before the root, an int or
            ``[bs]`` int64 (any device; the positions come out on the tree's); the root sits
            at position ``prefix_len``, a node at depth ``d`` at ``prefix_len + d``.
        max_depth: the trees' depth or a bound on it (the draft's ``L - 1``); None: read
            from ``tree.depths`` (one host read).
        validate: check the parents and the prefix lengths (host reads). With ``max_depth``
            given and ``validate=False`` nothing is read on the host: the live step's compile
            for trees the lab built on the device (issue 36).

    Returns:
        :class:`DDTreeVerifyInput`.

    Raises:
        ValueError: parents not before children, or a negative prefix length (with ``validate``).
    """
    bs, n = tree.parents.shape
    if isinstance(prefix_len, int):
        prefix = torch.full((bs,), prefix_len, dtype=torch.int64, device=tree.parents.device)
    else:
        prefix = check_tensor("prefix_len", prefix_len, dtype=torch.int64, ndim=1)
        check_shape("prefix_len", prefix, (bs,))
        prefix = to_device(prefix, tree.parents.device)  # a host tensor beside a tree built on a GPU
    if validate and (prefix < 0).any():
        raise ValueError(f"prefix_len must be >= 0, got {prefix.tolist()}")
    retrieve_index, next_token, next_sibling = encode_retrieve(tree.parents, tree.num_nodes, validate=validate)
    if max_depth is None:
        max_depth = int(tree.depths.max()) if tree.depths.numel() else 0
    elif isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"max_depth must be an int >= 0, got {max_depth!r}")
    mask = tree_attention_mask(tree.parents, tree.num_nodes, max_depth)
    positions = prefix[:, None] + tree.depths.clamp(min=0)
    return DDTreeVerifyInput(
        node_token_ids=tree.node_token_ids,
        retrieve_index=retrieve_index,
        retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling,
        tree_mask=mask,
        positions=positions,
        depths=tree.depths,
        num_nodes=tree.num_nodes,
    )


def _rows(x, bs, n, name):
    if x is None:
        return None
    if tuple(x.shape) != (bs, n):
        raise ValueError(f"{name} must have shape {(bs, n)}, got {tuple(x.shape)}")
    return x.tolist()


def find_retrieve_problems(
    verify_input: "DDTreeVerifyInput | torch.Tensor",
    retrieve_next_sibling: torch.Tensor | None = None,
    num_nodes: torch.Tensor | None = None,
    *,
    node_logws: torch.Tensor | None = None,
    retrieve_index: torch.Tensor | None = None,
    depths: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
    node_token_ids: torch.Tensor | None = None,
    limit: int | None = None,
) -> list[Problem]:
    """Every broken invariant of a batch of verify buffers (the doctor's check), in order.

    Per request: ``num_nodes`` in ``[1, N]``; link values ``-1`` or a valid node (a bad link
    is reported and not followed); ``retrieve_index[b, i] == b * N + i``; the root has no
    next sibling; then one walk over the links from the root, each node entered once:
    a sibling chain that loops (named at the parent, with the cycle's nodes: SGLang's sibling
    walks have no hop bound, so such a chain hangs its kernel), a first-child or sibling link
    back to an ancestor (a cycle through ``retrieve_next_token``, its nodes named), a node
    reached twice (e.g. both a child and a sibling of other nodes), a depth that is not the
    parent's + 1, siblings out of ``node_logws`` order, a repeated token among siblings, then
    nodes not reachable from the root, positions not ``positions[root] + depth`` and tree-mask
    rows that miss an ancestor or see a non-ancestor (real rows; columns past ``num_nodes``
    must be False). Padding rows are not checked. Algorithm: O(N) per request, plus one
    vectorised comparison of the ``[N, N]`` mask.

    Args:
        verify_input: a :class:`DDTreeVerifyInput` (every field checked), or the
            ``retrieve_next_token [bs, N]`` integer tensor of raw buffers (then give
            ``retrieve_next_sibling`` and whichever optional fields you have).
        retrieve_next_sibling, num_nodes: raw buffers (``num_nodes`` default ``N``).
        node_logws: ``[bs, N]`` for the sibling-order check (not part of the verify input).
        retrieve_index, depths, positions, tree_mask, node_token_ids: raw optional fields.
        limit: stop after this many problems (``None``: all).

    Returns:
        :class:`~ddtree_lab.problems.Problem` s (``request`` the batch row, ``node``, ``field``,
        ``kind`` one of ``range``, ``cycle``, ``reached_twice``, ``unreachable``,
        ``root_sibling``, ``index``, ``depth``, ``position``, ``sibling_order``,
        ``duplicate_token``, ``mask_missing_ancestor``, ``mask_non_ancestor``, ``num_nodes``;
        ``value`` / ``limit`` the number found and the one expected where there is one;
        ``nodes`` the nodes involved), possibly empty.

    Raises:
        ValueError: a given field with the wrong shape.
    """
    if isinstance(verify_input, DDTreeVerifyInput):
        vi = verify_input
        nt_t, ns_t, num_nodes = vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes
        retrieve_index, depths, positions = vi.retrieve_index, vi.depths, vi.positions
        tree_mask, node_token_ids = vi.tree_mask, vi.node_token_ids
    else:
        if retrieve_next_sibling is None:
            raise TypeError("find_retrieve_problems needs a DDTreeVerifyInput, or retrieve_next_token and "
                            "retrieve_next_sibling tensors")
        nt_t, ns_t = verify_input, retrieve_next_sibling
    bs, n = nt_t.shape
    nt, ns = nt_t.tolist(), _rows(ns_t, bs, n, "retrieve_next_sibling")
    assert ns is not None  # ns_t is a tensor in both branches above
    counts = [n] * bs if num_nodes is None else [int(v) for v in num_nodes.tolist()]
    ri = _rows(retrieve_index, bs, n, "retrieve_index")
    lw = _rows(node_logws, bs, n, "node_logws")
    dp = _rows(depths, bs, n, "depths")
    ps = _rows(positions, bs, n, "positions")
    tk = _rows(node_token_ids, bs, n, "node_token_ids")
    if tree_mask is not None and tuple(tree_mask.shape) != (bs, n, n):
        raise ValueError(f"tree_mask must have shape {(bs, n, n)}, got {tuple(tree_mask.shape)}")
    problems: list[Problem] = []

    def add(request, node, field, kind, message, nodes=(), value=None, expected=None) -> bool:
        problems.append(Problem(kind, request=request, node=node, field=field, value=value, limit=expected,
                                message=message, nodes=tuple(nodes)))
        return limit is not None and len(problems) >= limit

    mask_parents = [[-1] * n for _ in range(bs)]
    mask_rows = [[False] * n for _ in range(bs)]
    good: dict[tuple, tuple[list[int], list[bool]]] = {}  # requests already found sound, by content
    for b in range(bs):
        count = counts[b]
        if not 1 <= count <= n:
            if add(b, 0, "num_nodes", "num_nodes", f"num_nodes {count} outside [1, {n}]", value=count, expected=n):
                return problems
            continue
        key = (count, tuple(nt[b][:count]), tuple(ns[b][:count]),
               *(None if x is None else tuple(x[b][:count]) for x in (dp, tk, lw)),
               None if ps is None else tuple(v - ps[b][0] for v in ps[b][:count]))
        if key in good and (ri is None or ri[b][:count] == list(range(b * n, b * n + count))):
            mask_parents[b][:count], mask_rows[b][:count] = good[key]
            continue
        before = len(problems)
        links = {"retrieve_next_token": [-1] * count, "retrieve_next_sibling": [-1] * count}
        for i in range(count):
            for name, buf in (("retrieve_next_token", nt), ("retrieve_next_sibling", ns)):
                v = buf[b][i]
                if v == -1 or 0 <= v < count:
                    links[name][i] = v
                elif add(b, i, name, "range", f"{name} = {v} is out of range (valid: -1 or 0..{count - 1})",
                           value=v, expected=count - 1):
                    return problems
            if ri is not None and ri[b][i] != b * n + i:
                if add(b, i, "retrieve_index", "index", f"retrieve_index = {ri[b][i]}, expected {b * n + i}",
                       value=ri[b][i], expected=b * n + i):
                    return problems
        first, nxt = links["retrieve_next_token"], links["retrieve_next_sibling"]
        if nxt[0] != -1:
            if add(b, 0, "retrieve_next_sibling", "root_sibling", f"the root has a next sibling ({nxt[0]})", (nxt[0],)):
                return problems
        if dp is not None and dp[b][0] != 0:
            if add(b, 0, "depths", "depth", f"the root's depth is {dp[b][0]}, not 0", value=dp[b][0], expected=0):
                return problems
        parent_of = [-1] * count
        depth_of = [0] + [-1] * (count - 1)
        seen = [False] * count
        seen[0] = True
        stack = [0]
        while stack:
            parent = stack.pop()
            chain, in_chain, prev, child, via = [], set(), None, first[parent], "retrieve_next_token"
            tokens_here = {}
            while child != -1:
                link_owner = parent if prev is None else prev
                if child in in_chain:
                    loop = chain[chain.index(child):] + [child]
                    if add(b, parent, "retrieve_next_sibling", "cycle",
                           "sibling chain longer than the tree (a cycle in retrieve_next_sibling: "
                           + " -> ".join(map(str, loop)) + ")", tuple(loop[:-1])):
                        return problems
                    break
                if seen[child]:
                    anc, a = [], parent
                    while a != -1 and a != child:
                        anc.append(a)
                        a = parent_of[a]
                    if a == child:  # a link back to an ancestor (or to itself)
                        loop = [child] + anc[::-1] + [child]
                        msg = (f"reached twice (again as a child of node {parent}, through {via} of node "
                               f"{link_owner}): a cycle in retrieve_next_token: " + " -> ".join(map(str, loop)))
                        if add(b, child, via, "cycle", msg, tuple(loop[:-1])):
                            return problems
                    else:
                        first_parent = parent_of[child]
                        msg = (f"reached twice: a child of node {parent} (through {via} of node {link_owner}) and "
                               + ("the root" if child == 0 else f"already of node {first_parent}")
                               + " (a shared node: the walk would verify it twice)")
                        if add(b, child, via, "reached_twice", msg, (parent, first_parent)):
                            return problems
                    break
                seen[child] = True
                parent_of[child] = parent
                depth_of[child] = depth_of[parent] + 1
                chain.append(child)
                in_chain.add(child)
                if dp is not None and dp[b][child] != depth_of[child]:
                    if add(b, child, "depths", "depth",
                           f"depth {dp[b][child]} is not parent depth {depth_of[parent]} + 1 (parent node {parent})",
                           (), dp[b][child], depth_of[child]):
                        return problems
                if lw is not None and prev is not None and lw[b][child] > lw[b][prev]:
                    if add(b, child, "node_logws", "sibling_order",
                           f"sibling chain out of log-weight order: node_logw {lw[b][child]:.6g} follows sibling "
                           f"{prev} with {lw[b][prev]:.6g}", (prev,), lw[b][child], lw[b][prev]):
                        return problems
                if tk is not None:
                    t = tk[b][child]
                    if t in tokens_here:
                        if add(b, child, "node_token_ids", "duplicate_token",
                               f"token {t} repeats sibling {tokens_here[t]}'s token (children of node {parent}): "
                               "the target-only rule is no longer lossless", (tokens_here[t],)):
                            return problems
                    else:
                        tokens_here[t] = child
                stack.append(child)
                prev, child, via = child, nxt[child], "retrieve_next_sibling"
        for i in range(count):
            if not seen[i]:
                if add(b, i, "retrieve_next_token", "unreachable", "not reachable from the root"):
                    return problems
        if ps is not None:
            for i in range(1, count):
                if seen[i] and ps[b][i] != ps[b][0] + depth_of[i]:
                    if add(b, i, "positions", "position",
                           f"position {ps[b][i]} is not the root's position {ps[b][0]} + depth {depth_of[i]}", (),
                           ps[b][i], ps[b][0] + depth_of[i]):
                        return problems
        mask_parents[b][:count] = parent_of
        mask_rows[b][:count] = seen
        if len(problems) == before:
            good[key] = (parent_of, seen)
    if tree_mask is not None:
        mask_rows = torch.tensor(mask_rows, dtype=torch.bool)
        want = tree_attention_mask(torch.tensor(mask_parents, dtype=torch.int64), torch.tensor([min(max(c, 0), n) for c in counts]))
        real_col = torch.arange(n)[None, :] < torch.tensor(counts)[:, None]
        want &= real_col[:, None, :]
        have = tree_mask.bool().cpu()
        diff = (have != want) & mask_rows[:, :, None]
        for b, i in diff.any(-1).nonzero().tolist():
            missing = (want[b, i] & ~have[b, i]).nonzero().flatten().tolist()
            extra = (have[b, i] & ~want[b, i]).nonzero().flatten().tolist()
            if missing and add(b, i, "tree_mask", "mask_missing_ancestor",
                               f"tree mask row misses ancestor-or-self node(s) {missing}", tuple(missing)):
                return problems
            if extra and add(b, i, "tree_mask", "mask_non_ancestor",
                             f"tree mask row sees node(s) {extra}, not ancestors", tuple(extra)):
                return problems
    return problems


def find_retrieve_problem(
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    num_nodes: torch.Tensor | None = None,
    *,
    retrieve_index: torch.Tensor | None = None,
    node_logws: torch.Tensor | None = None,
    depths: torch.Tensor | None = None,
) -> RetrieveError | None:
    """The first broken invariant of a batch of retrieve buffers, or None.

    The first of :func:`find_retrieve_problems` over the given fields, as a
    :class:`RetrieveError` naming request and node.
    """
    found = find_retrieve_problems(retrieve_next_token, retrieve_next_sibling, num_nodes, retrieve_index=retrieve_index,
                                   node_logws=node_logws, depths=depths, limit=1)
    return _error(found[0]) if found else None


def check_retrieve(verify_input: DDTreeVerifyInput, node_logws: torch.Tensor | None = None) -> None:
    """Raise :class:`RetrieveError` at the first broken invariant of ``verify_input``
    (links, index, depths and, with ``node_logws``, sibling order)."""
    problem = find_retrieve_problem(
        verify_input.retrieve_next_token,
        verify_input.retrieve_next_sibling,
        verify_input.num_nodes,
        retrieve_index=verify_input.retrieve_index,
        node_logws=node_logws,
        depths=verify_input.depths,
    )
    if problem is not None:
        raise problem


def check_verify_buffers(verify_input: DDTreeVerifyInput) -> None:
    """What every verifier backend runs before walking (``validate=True``, the default).

    Raises:
        RetrieveError: the first problem :func:`find_retrieve_problems` finds in
            ``verify_input`` (every field: links, index, depths, positions, tree mask, sibling
            tokens), naming request and node.
    """
    found = find_retrieve_problems(verify_input, limit=1)
    if found:
        raise _error(found[0])


def decode_retrieve(
    retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor, num_nodes: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Parents and depths from retrieve buffers (the inverse of :func:`encode_retrieve`).

    Args:
        retrieve_next_token, retrieve_next_sibling: ``[bs, N]`` integer.
        num_nodes: ``[bs]``; default ``N``.

    Returns:
        ``(parents, depths)``, ``[bs, N]`` int64, root -1 / 0, padding -1 / -1.

    Raises:
        RetrieveError: the buffers are not a tree (see :func:`find_retrieve_problem`).
    """
    problem = find_retrieve_problem(retrieve_next_token, retrieve_next_sibling, num_nodes)
    if problem is not None:
        raise problem
    bs, n = retrieve_next_token.shape
    nt, ns = retrieve_next_token.tolist(), retrieve_next_sibling.tolist()
    parents = [[-1] * n for _ in range(bs)]
    depths = [[-1] * n for _ in range(bs)]
    for b in range(bs):
        depths[b][0] = 0
        stack = [0]
        while stack:
            p = stack.pop()
            c = nt[b][p]
            while c != -1:
                parents[b][c] = p
                depths[b][c] = depths[b][p] + 1
                stack.append(c)
                c = ns[b][c]
    return torch.tensor(parents, dtype=torch.int64), torch.tensor(depths, dtype=torch.int64)


def verify_input_from_parents(tokens: torch.Tensor, parents: torch.Tensor, prefix_len: int = 0) -> DDTreeVerifyInput:
    """The buffers of one tree given per node ``tokens [n]`` and ``parents [n]`` (int64; root
    -1, parents before children), a batch of one: children linked in ascending index order
    (:func:`encode_retrieve`), positions ``prefix_len + depth``.

    Raises:
        ValueError: a parent that does not precede its child (as :func:`encode_retrieve`).
    """
    parents = parents.long()[None]
    n = int(parents.shape[1])
    num = torch.tensor([n])
    retrieve_index, next_token, next_sibling = encode_retrieve(parents, num)
    depths = torch.zeros(1, n, dtype=torch.int64)
    for i in range(1, n):
        depths[0, i] = depths[0, int(parents[0, i])] + 1
    return DDTreeVerifyInput(node_token_ids=tokens.long()[None].clone(), retrieve_index=retrieve_index,
                             retrieve_next_token=next_token, retrieve_next_sibling=next_sibling,
                             tree_mask=tree_attention_mask(parents, num), positions=depths + prefix_len,
                             depths=depths, num_nodes=num)
