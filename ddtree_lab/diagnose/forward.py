"""Checks with the target: the tree forward (mask, positions) and the KV commit, from the first divergent step found by bisection.

A step's rows are right when its stored top-M raw logits equal those of a fresh forward: a
prefill of the committed prefix, then the recorded tree with its right mask and positions
(:meth:`ddtree_lab.models.TargetModel.tree_forward_batch`). A wrong cache stays wrong, so the
first wrong step of a request is found by bisection over its steps (after a coarse sample, for
faults that come and go). At that step:

* root row wrong (the previous step's rows were right): the cache after the last commit is
  wrong, a KV-commit (or cache rollback) bug; the previous step is re-run and committed under
  each candidate commit fault (:data:`ddtree_lab.faults.COMMIT_FAULTS`) to name it;
* root right, nodes wrong: the tree forward is re-run under each candidate mask/positions
  fault (:data:`ddtree_lab.faults.FORWARD_FAULTS`, the batch ones with the step's other
  requests rebuilt from the run), and the one reproducing every row is named; else an unknown
  fault with the first bad node, told apart by the tree's spine (the chain of first children,
  a path with no sibling on it, :func:`spine`): spine right and other nodes wrong is a leak
  across siblings (a node sees tokens off its path); a wrong spine node is a positions or
  ancestor-mask fault (a chain has nothing else to see).

The named fault is then confirmed by re-running the request from there under it (a forward per
step, the cache kept as the faulty engine kept it): how many later steps it reproduces.
"""

from __future__ import annotations

import torch

from ..build import DDTreeBuildResult
from ..buffers import compile_retrieve
from ..faults import COMMIT_FAULTS, FORWARD_FAULTS, forward_input, kept_rows
from ..step import Run, Step
from .common import CheckResult, Finding, next_command

__all__ = ["check_tree_forward", "step_rows_diff", "request_prefix", "ROW_ATOL", "first_bad_step", "spine",
           "unknown_forward_kind"]

#: Max |logit difference| between a recorded row and a fresh forward still counted equal (the
#: batched live forward and a single-request forward differ by float rounding, ~1e-5).
ROW_ATOL = 2e-3


def request_prefix(run: Run, request: int) -> list[int]:
    """The request's committed tokens (prompt, then generated) from the run's metadata.

    Raises:
        ValueError: the metadata has no token ids for the request.
    """
    for r in run.metadata.get("requests") or []:
        if int(r["request"]) == request:
            return list(r["prompt_token_ids"]) + list(r["generated_token_ids"])
    raise ValueError(f"request {request}: the run's metadata has no prompt / generated token ids")


def _forward(target, prefix: list[int], vi, state=None):
    """Logits ``[N, V]`` of a one-request tree forward on a fresh prefill of ``prefix`` (or on
    ``state``), and the state after it."""
    if state is None:
        state, _, _ = target.prefill_batch([prefix])
    fwd = target.tree_forward_batch(state, vi)
    return fwd.logits[0].float().cpu(), state


def step_rows_diff(step: Step, logits: torch.Tensor) -> torch.Tensor:
    """``[n]`` max |recorded top-M logit - ``logits``| per node (``logits [>= n, V]``)."""
    n = step.num_nodes
    got = logits[:n].gather(1, step.row_logit_ids.long())
    return (got - step.row_logits.float()).abs().max(-1).values


def spine(step: Step) -> list[int]:
    """The step's spine: the root, its first child in the buffers' sibling order, that node's
    first child, ... (``retrieve_next_token`` followed from node 0): a chain with no sibling
    on its path."""
    nt, out, c = step.retrieve_next_token.tolist(), [0], 0
    while nt[c] != -1 and len(out) <= step.num_nodes:
        c = nt[c]
        out.append(c)
    return out


def unknown_forward_kind(step: Step, bad_nodes: list[int]) -> tuple[str, str]:
    """``(kind, evidence)`` of a tree-forward fault no candidate reproduces, from which nodes
    are wrong on and off the spine (:func:`spine`)."""
    chain = spine(step)
    on = [n for n in bad_nodes if n in chain]
    if not on:
        return ("unknown mask fault that leaks across siblings (a node sees tokens off its path)",
                f"the spine ({len(chain)} nodes, a chain with no sibling on it) is right; {len(bad_nodes)} node(s) "
                "off it are wrong")
    return ("unknown positions or ancestor-mask fault in the tree forward",
            f"the spine (a chain with no sibling on it) is wrong from node {on[0]} (depth "
            f"{int(step.depths[on[0]])}) on: positions or the ancestor part of the mask")


def _batch_input(run: Run, step_no: int):
    """The step's whole batch rebuilt from the run: ``(vi [bs, N], parents [bs, N], requests)``."""
    steps = sorted((s for s in run.steps if s.step == step_no and s.tree is not None), key=lambda s: s.request)
    n = max(s.num_nodes for s in steps)

    def pad(t, fill, dtype):
        out = torch.full((len(steps), n), fill, dtype=dtype)
        for b, s in enumerate(steps):
            out[b, : s.num_nodes] = t(s)
        return out

    tree = DDTreeBuildResult(node_token_ids=pad(lambda s: s.node_token_ids, -1, torch.int64),
                             parents=pad(lambda s: s.parents, -1, torch.int64),
                             depths=pad(lambda s: s.depths, -1, torch.int64),
                             ranks=pad(lambda s: s.ranks, -1, torch.int64),
                             node_logws=pad(lambda s: s.node_logws, float("-inf"), torch.float32),
                             num_nodes=torch.tensor([s.num_nodes for s in steps]))
    prefix = torch.tensor([s.prefix_len for s in steps], dtype=torch.int64)
    return compile_retrieve(tree, prefix), tree.parents, [s.request for s in steps]


def _fault_input(run: Run, step: Step, name: str):
    vi, parents, reqs = _batch_input(run, step.step)
    return forward_input(vi, parents, name).request(reqs.index(step.request))


def first_bad_step(steps: list[Step], bad) -> int | None:
    """Index of the first step with ``bad(k)`` true, by a coarse sample then bisection (``bad``
    is cached by the caller); None when no sampled step is bad."""
    m = len(steps)
    sample = sorted({round(j * (m - 1) / 7) for j in range(8)} if m > 8 else set(range(m)))
    hi = next((k for k in sample if bad(k)), None)
    if hi is None:
        return None
    lo = max([k for k in sample if k < hi], default=-1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if bad(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _confirm(run, target, steps, start: int, fault: str) -> tuple[int, int, list[int]]:
    """Re-run ``steps[start:]`` under ``fault`` with the cache kept as it keeps it: ``(steps
    reproduced, steps run, the step numbers reproduced)``."""
    prefix = request_prefix(run, steps[start].request)
    state, ok, which = None, 0, []
    for s in steps[start:]:
        vi = _fault_input(run, s, fault) if fault in FORWARD_FAULTS else s.buffers
        logits, state = _forward(target, prefix[: s.prefix_len], vi, state)
        if float(step_rows_diff(s, logits).max()) <= ROW_ATOL:
            ok += 1
            which.append(s.step)
        target.keep_paths(state, kept_rows([s.accepted_path], fault if fault in COMMIT_FAULTS else None),
                          int(vi.node_token_ids.shape[1]))
    return ok, len(steps) - start, which


def _diagnose_request(run, target, steps: list[Step], confirm: bool, reproduced: list[int]):
    prefix = request_prefix(run, steps[0].request)
    cache: dict[int, torch.Tensor] = {}

    def diff(k):
        if k not in cache:
            logits, _ = _forward(target, prefix[: steps[k].prefix_len], steps[k].buffers)
            cache[k] = step_rows_diff(steps[k], logits)
        return cache[k]

    k = first_bad_step(steps, lambda k: float(diff(k).max()) > ROW_ATOL)
    if k is None:
        return None, len(cache)
    s, d = steps[k], diff(k)
    bad_nodes = (d > ROW_ATOL).nonzero().flatten().tolist()
    node = bad_nodes[0]
    if float(d[0]) > ROW_ATOL:  # the cache the step started from is wrong
        prev = steps[k - 1] if k > 0 else next((p for p in run.for_request(s.request) if p.step == s.step - 1
                                                 and p.buffers is not None), None)
        if prev is None:
            return Finding("commit", "the first step's root row differs from a fresh prefill of the prompt "
                           "(prefill or prompt tokens)", None, s.step, s.request, 0,
                           f"root logits differ by {float(d[0]):.3g}", "medium",
                           next_command("commit", s.step, s.request)), len(cache)
        if k == 0:  # a restricted check: were the previous step's rows right?
            logits, _ = _forward(target, prefix[: prev.prefix_len], prev.buffers)
            if float(step_rows_diff(prev, logits).max()) > ROW_ATOL:
                return Finding("tree-forward", "the cache was already wrong before this step (the rows of the "
                               "previous step are wrong too)", None, s.step, s.request, 0,
                               f"root logits differ by {float(d[0]):.3g}; step {prev.step} differs as well",
                               "low", "ddtree-lab diagnose RUN --model default (no --step: finds the first "
                               "divergent step)"), len(cache)
        names = []
        for name in COMMIT_FAULTS:
            _, state = _forward(target, prefix[: prev.prefix_len], prev.buffers)
            target.keep_paths(state, kept_rows([prev.accepted_path], name), prev.num_nodes)
            logits, _ = _forward(target, prefix[: s.prefix_len], s.buffers, state)
            if float(step_rows_diff(s, logits).max()) <= ROW_ATOL:
                names.append(name)
        base = (f"root logits differ from a fresh prefill of the committed prefix by {float(d[0]):.3g} while step "
                f"{prev.step}'s rows were right (accepted path {prev.accepted_path})")
        if not names:
            return Finding("commit", "a KV-commit (cache rollback) bug: the cache after the verify keeps the wrong "
                           "rows (not the ones of a known fault)", None, s.step, s.request, 0, base, "medium",
                           next_command("commit", prev.step, s.request)), len(cache)
        name = names[0]
        extra = ""
        if confirm:
            ok, total, which = _confirm(run, target, [prev] + steps[k:], 0, name)
            reproduced.extend(which)
            extra = f"; re-running from step {prev.step} under it reproduces {ok} of {total} steps"
        return Finding("commit", COMMIT_FAULTS[name], name, s.step, s.request, 0,
                       base + f"; committing the first {len(prev.accepted_path)} tree rows instead reproduces "
                       f"every row{extra}", "high", next_command("commit", prev.step, s.request)), len(cache)
    names = []
    for name in FORWARD_FAULTS:
        logits, _ = _forward(target, prefix[: s.prefix_len], _fault_input(run, s, name))
        if float(step_rows_diff(s, logits).max()) <= ROW_ATOL:
            names.append(name)
    base = (f"node {node} (depth {int(s.depths[node])}): recorded logits differ from the right tree forward by "
            f"{float(d[node]):.3g} ({len(bad_nodes)} of {s.num_nodes} nodes wrong, root right)")
    if not names:
        kind, how = unknown_forward_kind(s, bad_nodes)
        return Finding("tree-forward", kind, None, s.step, s.request, node, f"{base}; {how}; no known fault "
                       "reproduces the rows", "medium", next_command("tree-forward", s.step, s.request)), len(cache)
    extra = ""
    if confirm:
        ok, total, which = _confirm(run, target, steps, k, names[0])
        reproduced.extend(which)
        extra = f"; re-running the request from here under it reproduces {ok} of {total} steps"
    kind = FORWARD_FAULTS[names[0]] if len(names) == 1 else " or ".join(FORWARD_FAULTS[n] for n in names)
    return Finding("tree-forward", kind, names[0] if len(names) == 1 else None, s.step, s.request, node,
                   base + f"; the tree forward under it reproduces every row{extra}",
                   "high" if len(names) == 1 else "medium", next_command("tree-forward", s.step, s.request)), len(cache)


def check_tree_forward(run: Run, target, steps: list[Step] | None = None, confirm: bool = True) -> CheckResult:
    """Tree forward and KV commit of every request against fresh forwards of ``target``
    (module docstring); one finding per request at its first divergent step.

    Args:
        run: the run (its metadata must hold each request's token ids).
        target: the :class:`ddtree_lab.models.TargetModel` it was recorded with.
        steps: restrict to these steps (one request's, or one step: then no bisection).
        confirm: re-run the request under a named fault to count the steps it reproduces.
    """
    steps = run.steps if steps is None else steps
    result = CheckResult("tree-forward", ran=False)
    usable = [s for s in steps if s.buffers is not None and s.row_logits is not None and s.output is not None
              and s.prefix_len is not None]
    if not usable:
        result.why = "no step stores its buffers and top-M raw logits (level full)"
        return result
    for r in sorted({s.request for s in usable}):
        mine = sorted((s for s in usable if s.request == r), key=lambda s: s.step)
        try:
            reproduced: list[int] = []
            finding, checked = _diagnose_request(run, target, mine, confirm, reproduced)
        except ValueError as exc:
            result.note = (result.note + "; " if result.note else "") + f"request {r}: {exc}"
            continue
        result.checked += checked
        if finding is not None:
            result.findings.append(finding)
            result.per_step[(finding.step, r)] = finding.fault or "unknown"
            for k in reproduced:  # the later steps the named fault reproduces (confirm)
                result.per_step.setdefault((k, r), finding.fault)
    result.ran = result.checked > 0
    if not result.ran:
        result.why = result.note or "no request could be re-run"
    result.note = (result.note + "; " if result.note else "") + "steps compared by bisection"
    return result
