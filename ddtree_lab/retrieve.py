"""Retrieve encoding: the flat tree buffers a serving engine verifies from.

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

from ._checks import check_shape, check_tensor
from .tree import DDTreeBuildResult

__all__ = [
    "DDTreeVerifyInput",
    "RetrieveError",
    "compile_retrieve",
    "encode_retrieve",
    "decode_retrieve",
    "tree_attention_mask",
    "find_retrieve_problem",
    "check_retrieve",
]


class RetrieveError(ValueError):
    """A broken retrieve-buffer invariant; ``request`` and ``node`` say where."""

    def __init__(self, message: str, request: int, node: int):
        super().__init__(f"request {request}, node {node}: {message}")
        self.request = request
        self.node = node


@dataclass(frozen=True)
class DDTreeVerifyInput:
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

    @property
    def batch_size(self) -> int:
        return int(self.node_token_ids.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.node_token_ids.shape[1])

    def request(self, b: int) -> "DDTreeVerifyInput":
        """Request ``b`` as a batch of one; ``retrieve_index`` is re-based to row 0."""
        parts = {f.name: getattr(self, f.name)[b : b + 1] for f in fields(self)}
        ri = parts["retrieve_index"]
        parts["retrieve_index"] = torch.where(ri >= 0, ri - b * self.num_rows, ri)
        return DDTreeVerifyInput(**parts)


def encode_retrieve(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Retrieve buffers from parent indices; children are linked in ascending index order.

    For trees in tree order (as :func:`ddtree_lab.build_tree` returns them) ascending index
    is descending log-weight, which is the order SGLang's verifiers expect.

    Args:
        parents: ``[bs, N]`` int64, parent of each node (root -1, padding -1); every parent
            index is smaller than its child's.
        num_nodes: ``[bs]`` int64.

    Returns:
        ``(retrieve_index, retrieve_next_token, retrieve_next_sibling)``, each ``[bs, N]`` int64.

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
    if bad.any():
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
    the diagonal. ``max_depth`` bounds the ancestor walk (default ``N - 1``).
    """
    bs, n = parents.shape
    device = parents.device
    real = torch.arange(n, device=device)[None, :] < num_nodes[:, None]
    mask = torch.eye(n, dtype=torch.bool, device=device).expand(bs, n, n).clone()
    cur = torch.where(real, parents, -1)
    rows = torch.arange(n, device=device).expand(bs, n)
    for _ in range(n - 1 if max_depth is None else max_depth):
        has = cur >= 0
        if not has.any():
            break
        b_idx, i_idx = has.nonzero(as_tuple=True)
        mask[b_idx, rows[b_idx, i_idx], cur[b_idx, i_idx]] = True
        cur = torch.where(has, parents.gather(1, cur.clamp(min=0)), -1)
    return mask


def compile_retrieve(tree: DDTreeBuildResult, prefix_len: int | torch.Tensor) -> DDTreeVerifyInput:
    """Compile a built tree into the verify buffers (DESIGN.md, "Retrieve encoding").

    Args:
        tree: the result of :func:`ddtree_lab.build_tree` (nodes in tree order).
        prefix_len: tokens already in the target's KV cache before the root, an int or
            ``[bs]`` int64; the root sits at position ``prefix_len``, a node at depth ``d``
            at ``prefix_len + d``.

    Returns:
        :class:`DDTreeVerifyInput`.

    Raises:
        ValueError: parents not before children, or a negative prefix length.
    """
    bs, n = tree.parents.shape
    if isinstance(prefix_len, int):
        prefix = torch.full((bs,), prefix_len, dtype=torch.int64, device=tree.parents.device)
    else:
        prefix = check_tensor("prefix_len", prefix_len, dtype=torch.int64, ndim=1)
        check_shape("prefix_len", prefix, (bs,))
    if (prefix < 0).any():
        raise ValueError(f"prefix_len must be >= 0, got {prefix.tolist()}")
    retrieve_index, next_token, next_sibling = encode_retrieve(tree.parents, tree.num_nodes)
    max_depth = int(tree.depths.max()) if tree.depths.numel() else 0
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

    Checked per request, in this order: buffer values in range (``-1`` or a valid node);
    ``retrieve_index[b, i] == b * N + i`` for valid nodes (when given); the walk from the root
    reaches no node twice (this also catches cycles and a root listed as a child); every
    valid node is reachable; along each sibling chain ``node_logws`` do not increase (when
    given); a child's depth is its parent's depth + 1 (when given).

    Args:
        retrieve_next_token, retrieve_next_sibling: ``[bs, N]`` integer.
        num_nodes: ``[bs]``; default ``N`` for every request.
        retrieve_index, node_logws, depths: optional ``[bs, N]`` for the extra checks.

    Returns:
        a :class:`RetrieveError` naming request and node, or None.
    """
    bs, n = retrieve_next_token.shape
    counts = [n] * bs if num_nodes is None else [int(v) for v in num_nodes.tolist()]
    nt, ns = retrieve_next_token.tolist(), retrieve_next_sibling.tolist()
    ri = retrieve_index.tolist() if retrieve_index is not None else None
    lw = node_logws.tolist() if node_logws is not None else None
    dp = depths.tolist() if depths is not None else None
    for b in range(bs):
        count = counts[b]
        if not 1 <= count <= n:
            return RetrieveError(f"num_nodes {count} outside [1, {n}]", b, 0)
        for i in range(count):
            for name, buf in (("retrieve_next_token", nt), ("retrieve_next_sibling", ns)):
                v = buf[b][i]
                if not (v == -1 or 0 <= v < count):
                    return RetrieveError(f"{name} = {v} is out of range (valid: -1 or 0..{count - 1})", b, i)
            if ri is not None and ri[b][i] != b * n + i:
                return RetrieveError(f"retrieve_index = {ri[b][i]}, expected {b * n + i}", b, i)
        if ns[b][0] != -1:
            return RetrieveError(f"the root has a next sibling ({ns[b][0]})", b, 0)
        seen = [False] * count
        seen[0] = True
        stack = [0]
        while stack:
            parent = stack.pop()
            prev = None
            child = nt[b][parent]
            while child != -1:
                if seen[child]:
                    return RetrieveError(f"reached twice (again as a child of node {parent}): a cycle or a shared child", b, child)
                seen[child] = True
                if dp is not None and dp[b][child] != dp[b][parent] + 1:
                    return RetrieveError(
                        f"depth {dp[b][child]} is not parent depth {dp[b][parent]} + 1 (parent node {parent})", b, child
                    )
                if lw is not None and prev is not None and lw[b][child] > lw[b][prev]:
                    return RetrieveError(
                        f"sibling chain out of log-weight order: node_logw {lw[b][child]:.6g} follows sibling "
                        f"{prev} with {lw[b][prev]:.6g}",
                        b,
                        child,
                    )
                stack.append(child)
                prev = child
                child = ns[b][child]
        for i in range(count):
            if not seen[i]:
                return RetrieveError("not reachable from the root", b, i)
    return None


def check_retrieve(verify_input: DDTreeVerifyInput, node_logws: torch.Tensor | None = None) -> None:
    """Raise :class:`RetrieveError` at the first broken invariant of ``verify_input``."""
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
