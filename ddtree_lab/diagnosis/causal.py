"""The doctor's model checks: tree-node target rows against plain causal forwards of their paths.

A tree mask that hides an ancestor or shows a non-ancestor leaves every buffer valid and still
corrupts the target's rows (the "accept length stuck at 1" symptom). These checks recompute
sampled nodes' rows with a causal forward of the node's path and name the first node whose row
differs (as a :class:`~ddtree_lab.problems.Problem`, ``part="model"``). The buffer checks
themselves are :func:`ddtree_lab.buffers.find_retrieve_problems`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..buffers import DDTreeVerifyInput
from ..problems import Problem
from ..sampling import SamplingParams, target_probs

__all__ = ["TreeLogitsCheck", "check_tree_logits", "RecordedRowsCheck", "check_recorded_rows"]


@dataclass
class TreeLogitsCheck:
    """Tree-forward logits against plain causal forwards of the nodes' paths.

    ``checked``: node indices compared; ``max_abs``: per checked node, the max absolute logit
    difference; ``first_bad``: the first node (in index order) over ``atol``, or None.
    """

    checked: list
    max_abs: list
    atol: float
    first_bad: int | None

    @property
    def problems(self) -> list[Problem]:
        """The first node over ``atol`` as a :class:`~ddtree_lab.problems.Problem`
        (``kind="tree_logits"``, ``value`` its max |diff|, ``limit`` ``atol``), or none."""
        if self.first_bad is None:
            return []
        k = self.checked.index(self.first_bad)
        return [Problem("tree_logits", request=0, node=self.first_bad, field="tree_logits", value=self.max_abs[k],
                        limit=self.atol, part="model",
                        message=(f"tree-forward logits differ from a causal forward of its path by "
                                 f"{self.max_abs[k]:.3g} (> {self.atol:g}): the tree mask or positions are wrong "
                                 "there (the accept-length-stuck-at-1 symptom)"))]

    def text(self) -> str:
        worst = max(self.max_abs) if self.max_abs else 0.0
        if self.first_bad is None:
            return f"tree logits match causal forwards at {len(self.checked)} nodes (max |diff| {worst:.3g} <= {self.atol:g})"
        return f"node {self.first_bad}: {self.problems[0].message}"


@torch.no_grad()
def check_tree_logits(target, prefix_ids: Sequence[int], verify_input: DDTreeVerifyInput, parents: torch.Tensor,
                      tree_logits: torch.Tensor, nodes: Sequence[int] | None = None, sample: int = 8,
                      seed: int = 0, atol: float = 1e-3) -> TreeLogitsCheck:
    """Compare tree-node logits with plain causal forwards of each node's path.

    Node ``i``'s tree logits must equal the causal forward of ``prefix_ids`` + the tokens on
    the path root..i (a tree mask that hides an ancestor or shows a non-ancestor, or a wrong
    position, breaks this; a target whose tree forward is wrong accepts almost nothing).

    Args:
        target: a :class:`ddtree_lab.models.TargetModel`.
        prefix_ids: the committed tokens before the root (the KV cache of the step).
        verify_input: the step, batch of one (its ``node_token_ids``).
        parents: ``[n]`` int64 parents of the nodes (root -1).
        tree_logits: ``[n, V]`` the logits under test (e.g. an engine's, or
            ``target.tree_forward``'s).
        nodes: nodes to check (default: the root, then ``sample - 1`` others drawn with ``seed``,
            deepest first).
        atol: tolerance on the max absolute logit difference.

    Returns:
        :class:`TreeLogitsCheck`.
    """
    n = int(verify_input.num_nodes[0])
    tokens = verify_input.node_token_ids[0].tolist()
    if nodes is None:
        g = torch.Generator().manual_seed(seed)
        others = torch.randperm(max(n - 1, 0), generator=g)[: max(sample - 1, 0)].add(1).tolist()
        nodes = [0] + sorted(others)
    checked, diffs, first_bad = [], [], None
    for i in nodes:
        path, j = [], i
        while j != -1:
            path.append(tokens[j])
            j = int(parents[j])
        ids = list(prefix_ids) + path[::-1]
        _, _, logits = target.prefill(ids)
        d = float((logits[-1].float().cpu() - tree_logits[i].float().cpu()).abs().max())
        checked.append(int(i))
        diffs.append(d)
        if d > atol and first_bad is None:
            first_bad = int(i)
    order = sorted(range(len(checked)), key=lambda k: checked[k])
    checked = [checked[k] for k in order]
    diffs = [diffs[k] for k in order]
    bad = [c for c, d in zip(checked, diffs) if d > atol]
    return TreeLogitsCheck(checked, diffs, atol, bad[0] if bad else None)


@dataclass
class RecordedRowsCheck:
    """Recorded child probabilities against plain causal forwards of the parents' paths.

    ``checked``: nodes compared; ``diffs``: per node, |recorded p - causal p|; ``first_bad``: the
    first node (in index order) over ``atol``, or None.
    """

    checked: list
    diffs: list
    atol: float
    first_bad: int | None
    step: int | None = None
    request: int | None = None

    @property
    def problems(self) -> list[Problem]:
        """The first node over ``atol`` as a :class:`~ddtree_lab.problems.Problem`
        (``kind="tree_rows"``, ``field="child_probs"``, ``value`` its |diff|, ``limit``
        ``atol``), or none."""
        if self.first_bad is None:
            return []
        k = self.checked.index(self.first_bad)
        return [Problem("tree_rows", self.step, self.request, self.first_bad, "child_probs", self.diffs[k], self.atol,
                        f"recorded target p differs from a causal forward of its parent's path by "
                        f"{self.diffs[k]:.3g} (> {self.atol:g}): the tree forward that produced it (mask, "
                        "positions) is wrong there (the accept-length-stuck-at-1 symptom)", "model")]

    def text(self) -> str:
        worst = max(self.diffs) if self.diffs else 0.0
        if not self.checked:
            return "could not compare any node (no sampled node's token is in its parent's stored rows): not checked"
        if self.first_bad is None:
            return (f"recorded target p of {len(self.checked)} nodes match causal forwards "
                    f"(max |diff| {worst:.3g} <= {self.atol:g})")
        return f"node {self.first_bad}: {self.problems[0].message}"


def _path_tokens(tokens: list[int], parents: list[int], i: int) -> list[int]:
    path = []
    while i != -1:
        path.append(tokens[i])
        i = parents[i]
    return path[::-1]


def _sample_nodes(n: int, sample: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(max(n - 1, 0), generator=g)[: max(sample, 0)].add(1).tolist())


@torch.no_grad()
def check_recorded_rows(target, run, step, sample: int = 8, seed: int = 0, atol: float = 2e-3,
                        nodes: Sequence[int] | None = None) -> RecordedRowsCheck:
    """Compare a recorded step's target probabilities with plain causal forwards.

    For each sampled draft node ``i`` (``seed`` fixed), run the target causally on the
    committed prefix + the tokens of the path root..parent(i), apply the step's sampling
    parameters (:func:`ddtree_lab.target_probs`) and compare ``p(token_i)`` with the recorded
    ``child_probs[i]``. A tree forward with a wrong mask or wrong positions (an engine's or the
    lab's) gives rows that differ; greedy steps compare the softmax of the raw logits.

    Args:
        target: the :class:`ddtree_lab.models.TargetModel` the trace was recorded with.
        run, step: the trace and one of its steps.
        sample: draft nodes compared (or ``nodes``).
        atol: tolerance on the probability difference.

    Raises:
        ValueError: the trace lacks the request's token ids (see :func:`ddtree_lab.audit.step_logits`).

    Returns:
        :class:`RecordedRowsCheck` (its ``problems``: the first node over ``atol``).
    """
    reqs = {int(r["request"]): r for r in run.metadata.get("requests", [])}
    if step.request not in reqs:
        raise ValueError(f"request {step.request}: the trace's metadata has no token ids for it")
    r = reqs[step.request]
    committed = list(r["prompt_token_ids"]) + list(r["generated_token_ids"])
    prefix = committed[: step.prefix_len]
    tokens, parents = step.node_token_ids.tolist(), step.parents.tolist()
    nodes = list(nodes) if nodes is not None else _sample_nodes(step.num_nodes, sample, seed)
    params = SamplingParams(temperature=1.0) if step.params.is_greedy else step.params
    checked, diffs = [], []
    for i in nodes:
        _, _, logits = target.prefill(prefix + _path_tokens(tokens, parents, parents[i]))
        p = float(target_probs(logits[-1:][None].float().cpu(), params)[0, 0, tokens[i]])
        want = float(step.child_probs[i]) if not step.params.is_greedy else None
        if want is None:  # greedy traces store the verifier's one-hot rows: compare the display rows
            row = step.top_token_ids[parents[i]].tolist()
            want = float(step.top_probs[parents[i], row.index(tokens[i])]) if tokens[i] in row else None
        if want is None:
            continue
        checked.append(int(i))
        diffs.append(abs(p - want))
    bad = [c for c, d in zip(checked, diffs) if d > atol]
    return RecordedRowsCheck(checked, diffs, atol, bad[0] if bad else None, step.step, step.request)
