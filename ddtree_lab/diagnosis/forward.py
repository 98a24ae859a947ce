"""Checks with the target: the tree forward (mask, positions) and the KV commit, from the first divergent step found by bisection.

A step's rows are right when its stored top-M raw logits (level ``full``; at level ``light``
the child probabilities of the rows the walk read, under the request's parameters) equal those
of a fresh forward: a prefill of the committed prefix, then the recorded tree with its right
mask and positions (:meth:`ddtree_lab.models.TargetModel.tree_forward_batch`). A wrong cache stays wrong, so the
first wrong step of a request is found by bisection over its steps (after a coarse sample, for
faults that come and go; at level ``light``, whose rows can hide a wrong cache, every step is
compared). At that step:

* root row wrong (the previous step's rows were right): the cache after the last commit is
  wrong, a KV-commit (or cache rollback) bug; the previous step is re-run and committed under
  each candidate commit fault (:data:`ddtree_lab.faults.COMMIT_FAULTS`) to name it; when none
  reproduces the rows, the previous step's tree forward is re-run under each mask / positions
  fault and its accepted rows committed: at level ``light`` a forward fault may leave the rows
  the walk read right and show only in the cache it leaves behind;
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
from ..sampling import apply_bans, target_probs
from ..step import Run, Step
from .common import CheckResult, Finding, next_command

__all__ = ["check_tree_forward", "step_rows_diff", "row_atol", "request_prefix", "ROW_ATOL", "PROB_ATOL",
           "first_bad_step", "spine",
           "unknown_forward_kind"]

#: Max |logit difference| between a recorded row and a fresh forward still counted equal (the
#: batched live forward and a single-request forward differ by float rounding, ~1e-5).
ROW_ATOL = 2e-3
#: The same for a recorded probability (level ``light`` keeps no logits).
PROB_ATOL = 1e-3


def request_prefix(run: Run, request: int) -> list[int]:
    """The request's committed tokens (prompt, then generated) from the run's metadata.

    Raises:
        ValueError: the metadata has no token ids for the request.
    """
    for r in run.metadata.get("requests") or []:
        if int(r["request"]) == request and r.get("prompt_token_ids") is not None:
            return list(r["prompt_token_ids"]) + list(r.get("generated_token_ids") or [])
    raise ValueError(f"request {request}: the run's metadata has no prompt / generated token ids")


def _forward(target, prefix: list[int], vi, state=None):
    """Logits ``[N, V]`` of a one-request tree forward on a fresh prefill of ``prefix`` (or on
    ``state``), and the state after it."""
    if state is None:
        state, _, _ = target.prefill_batch([prefix])
    fwd = target.tree_forward_batch(state, vi)
    return fwd.logits[0].float().cpu(), state


def step_rows_diff(step: Step, logits: torch.Tensor) -> torch.Tensor:
    """``[n]`` per node, how far its recorded row is from ``logits [>= n, V]``, in the units of
    :func:`row_atol`: level ``full``, max |recorded top-M raw logit - logit|; level ``light``
    (only the child probabilities of the rows the walk read), max |recorded p - p| over the
    node's children under the request's parameters (greedy: 1 where the recorded verdict is not
    the argmax by more than :data:`ROW_ATOL` in logits), 0 for a row not recorded."""
    n = step.num_nodes
    where = f"step {step.step}, request {step.request}"
    if step.row_logits is not None:
        if step.row_logit_ids is None:
            raise ValueError(f"{where}: top-M raw logits recorded without their token ids (row_logit_ids)")
        got = logits[:n].gather(1, step.row_logit_ids.long())
        return (got - step.row_logits.float()).abs().max(-1).values
    if step.child_probs is None:
        raise ValueError(f"{where}: no target rows recorded (top-M raw logits or child probabilities)")
    cp, out = step.child_probs.float(), torch.zeros(n)
    read = (~torch.isnan(cp)) & (torch.arange(n) > 0)
    kids = read.nonzero().flatten()
    if kids.numel() == 0:
        return out
    parents, tokens, params = step.parents, step.node_token_ids, step.params
    if parents is None or tokens is None:
        raise ValueError(f"{where}: no tree recorded (parents, node_token_ids)")
    if params is None:
        raise ValueError(f"{where}: no sampling parameters recorded")
    par, tok = parents[kids], tokens[kids]
    rows = logits[:n].float()
    if params.is_greedy:
        rows = apply_bans(rows, params)
        top2 = rows.topk(2, -1).values
        mine = rows[par, tok]
        is_top = mine >= top2[par, 0] - ROW_ATOL  # within noise of the argmax
        clear_top = mine > top2[par, 1] + ROW_ATOL  # the argmax by a margin
        d = torch.where(cp[kids] >= 0.5, (~is_top).float(), clear_top.float())
    else:
        d = (target_probs(rows[None], params)[0][par, tok] - cp[kids]).abs()
    return out.scatter_reduce(0, par, d, "amax")


def row_atol(step: Step) -> float:
    """The tolerance of :func:`step_rows_diff` for this step: :data:`ROW_ATOL` (logits, level
    ``full``) or :data:`PROB_ATOL` (probabilities, level ``light``)."""
    return ROW_ATOL if step.row_logits is not None else PROB_ATOL


def _what(step: Step) -> str:
    return "logits" if step.row_logits is not None else "target p"


def spine(step: Step) -> list[int]:
    """The step's spine: the root, its first child in the buffers' sibling order, that node's
    first child, ... (``retrieve_next_token`` followed from node 0): a chain with no sibling
    on its path."""
    if step.retrieve_next_token is None:
        raise ValueError(f"step {step.step}, request {step.request}: no verify buffers recorded (retrieve_next_token)")
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
            f"{int(_depths(step)[on[0]])}) on: positions or the ancestor part of the mask")


def _depths(step: Step) -> torch.Tensor:
    if step.depths is None:
        raise ValueError(f"step {step.step}, request {step.request}: no tree recorded (depths)")
    return step.depths


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


def _confirm(run, target, steps, fault: str) -> tuple[int, int, list[int]]:
    """Re-run ``steps`` (from a fresh prefill of the first) under ``fault`` with the cache kept
    as the faulty engine keeps it: ``(steps reproduced, steps run, the step numbers reproduced)``."""
    prefix = request_prefix(run, steps[0].request)
    state, ok, which = None, 0, []
    for s in steps:
        vi = _fault_input(run, s, fault) if fault in FORWARD_FAULTS else s.buffers
        logits, state = _forward(target, prefix[: s.prefix_len], vi, state)
        if float(step_rows_diff(s, logits).max()) <= row_atol(s):
            ok += 1
            which.append(s.step)
        target.keep_paths(state, kept_rows([s.accepted_path], fault if fault in COMMIT_FAULTS else None),
                          int(vi.node_token_ids.shape[1]))
    return ok, len(steps), which


def _confirm_note(run, target, steps: list[Step], fault: str, reproduced: list[int], where: str) -> str:
    """:func:`_confirm` of ``steps`` under ``fault`` as evidence text; the step numbers it
    reproduces go into ``reproduced``."""
    ok, total, which = _confirm(run, target, steps, fault)
    reproduced.extend(which)
    return f"; re-running {where} under it reproduces {ok} of {total} steps"


def _from_start(run, target, steps: list[Step], k: int) -> list[str]:
    """The faults (forward and commit) that, re-run from ``steps[0]`` on a fresh prefill with the
    cache kept as the faulty engine keeps it, reproduce every step up to ``steps[k]``: for a
    step whose cache was already wrong where the recorded rows could not show it (level
    ``light`` keeps only the rows the walk read)."""
    names = []
    for name in (*FORWARD_FAULTS, *COMMIT_FAULTS):
        ok, total, _ = _confirm(run, target, steps[: k + 1], name)
        if ok == total:
            names.append(name)
    return names


def _named_from_start(run, target, steps, k, s, base, node):
    """A :class:`Finding` naming the one fault :func:`_from_start` finds, or None."""
    if k == 0:
        return None
    names = _from_start(run, target, steps, k)
    if len(names) != 1:
        return None
    name = names[0]
    check, kind = ("tree-forward", FORWARD_FAULTS[name]) if name in FORWARD_FAULTS else ("commit", COMMIT_FAULTS[name])
    return Finding(check, kind, name, s.step, s.request, node,
                   f"{base}; no fault reproduces it from a fresh prefill (the cache was already wrong where the "
                   f"recorded rows do not show it), but re-running the request from step {steps[0].step} under it "
                   f"reproduces all {k + 1} steps up to step {s.step}", "high", next_command(check, s.step, s.request))


def _diagnose_request(run, target, steps: list[Step], confirm: bool, reproduced: list[int]):
    prefix = request_prefix(run, steps[0].request)
    cache: dict[int, torch.Tensor] = {}

    def diff(k):
        if k not in cache:
            logits, _ = _forward(target, prefix[: steps[k].prefix_len], steps[k].buffers)
            cache[k] = step_rows_diff(steps[k], logits)
        return cache[k]

    def bad(k):
        return float(diff(k).max()) > row_atol(steps[k])

    if steps[0].row_logits is None:  # level light: a wrong cache may look right on the rows read: every step
        k = next((k for k in range(len(steps)) if bad(k)), None)
    else:
        k = first_bad_step(steps, bad)
    if k is None:
        return None, len(cache)
    s, d = steps[k], diff(k)
    atol = row_atol(s)
    bad_nodes = (d > atol).nonzero().flatten().tolist()
    node = bad_nodes[0]
    if float(d[0]) > atol:  # the cache the step started from is wrong
        prev = steps[k - 1] if k > 0 else next((p for p in run.for_request(s.request) if p.step == s.step - 1
                                                 and p.buffers is not None), None)
        if prev is None:
            return Finding("commit", "the first step's root row differs from a fresh prefill of the prompt "
                           "(prefill or prompt tokens)", None, s.step, s.request, 0,
                           f"root logits differ by {float(d[0]):.3g}", "medium",
                           next_command("commit", s.step, s.request)), len(cache)
        if k == 0:  # a restricted check: were the previous step's rows right?
            logits, _ = _forward(target, prefix[: prev.prefix_len], prev.buffers)
            if float(step_rows_diff(prev, logits).max()) > row_atol(prev):
                return Finding("tree-forward", "the cache was already wrong before this step (the rows of the "
                               "previous step are wrong too)", None, s.step, s.request, 0,
                               f"root logits differ by {float(d[0]):.3g}; step {prev.step} differs as well",
                               "low", "ddtree-lab diagnose RUN --model default  # no --step: finds the first "
                               "divergent step"), len(cache)

        def reproduced_after(vi_prev, commit_fault) -> bool:
            """Step ``prev`` forwarded with ``vi_prev``, committed (under ``commit_fault``), then
            step ``s``: are its recorded rows reproduced?"""
            _, state = _forward(target, prefix[: prev.prefix_len], vi_prev)
            target.keep_paths(state, kept_rows([prev.accepted_path], commit_fault), prev.num_nodes)
            logits, _ = _forward(target, prefix[: s.prefix_len], s.buffers, state)
            return float(step_rows_diff(s, logits).max()) <= atol

        def again(name):
            return _confirm_note(run, target, [prev] + steps[k:], name, reproduced, f"from step {prev.step}") \
                if confirm else ""

        base = (f"root {_what(s)} differ from a fresh prefill of the committed prefix by {float(d[0]):.3g} while step "
                f"{prev.step}'s rows were right (accepted path {prev.accepted_path})")
        commits = [n for n in COMMIT_FAULTS if reproduced_after(prev.buffers, n)]
        if len(commits) == 1:
            name = commits[0]
            return Finding("commit", COMMIT_FAULTS[name], name, s.step, s.request, 0,
                           base + f"; committing the first {len(prev.accepted_path)} tree rows instead reproduces "
                           f"every row{again(name)}", "high", next_command("commit", prev.step, s.request)), len(cache)
        # or the previous tree forward was wrong where its recorded rows do not show it (level light)
        forwards = [] if commits else [n for n in FORWARD_FAULTS if reproduced_after(_fault_input(run, prev, n), None)]
        if len(forwards) == 1:
            name = forwards[0]
            return Finding("tree-forward", FORWARD_FAULTS[name], name, prev.step, s.request, None,
                           f"step {s.step}'s root {_what(s)} differ from a fresh prefill of the committed prefix "
                           f"by {float(d[0]):.3g}; step {prev.step}'s recorded rows were right, but its tree "
                           f"forward under this fault, its accepted rows {prev.accepted_path} committed, "
                           f"reproduces step {s.step}'s rows (only the rows the walk read were recorded)"
                           f"{again(name)}", "high", next_command("tree-forward", prev.step, s.request)), len(cache)
        named = _named_from_start(run, target, steps, k, s, base, 0)
        if named is not None:
            reproduced.extend(x.step for x in steps[: k + 1])
            return named, len(cache)
        kind = ("the cache after the verify is wrong: " + " or ".join(COMMIT_FAULTS[n] for n in commits) if commits
                else "the cache after the verify is wrong: " + " or ".join(FORWARD_FAULTS[n] for n in forwards)
                + " in the previous tree forward" if forwards
                else "a KV-commit (cache rollback) bug: the cache after the verify keeps the wrong rows (not the ones "
                     "of a known fault)")
        return Finding("commit", kind, None, s.step, s.request, 0, base, "medium",
                       next_command("commit", prev.step, s.request)), len(cache)
    names = []
    for name in FORWARD_FAULTS:
        logits, _ = _forward(target, prefix[: s.prefix_len], _fault_input(run, s, name))
        if float(step_rows_diff(s, logits).max()) <= atol:
            names.append(name)
    base = (f"node {node} (depth {int(_depths(s)[node])}): recorded {_what(s)} differ from the right tree forward by "
            f"{float(d[node]):.3g} ({len(bad_nodes)} of {s.num_nodes} nodes wrong, root right)")
    if not names:
        named = _named_from_start(run, target, steps, k, s, base, node)
        if named is not None:
            reproduced.extend(x.step for x in steps[: k + 1])
            return named, len(cache)
        kind, how = unknown_forward_kind(s, bad_nodes)
        return Finding("tree-forward", kind, None, s.step, s.request, node, f"{base}; {how}; no known fault "
                       "reproduces the rows", "medium", next_command("tree-forward", s.step, s.request)), len(cache)
    extra = _confirm_note(run, target, steps[k:], names[0], reproduced, "the request from here") if confirm else ""
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
    usable = [s for s in steps if s.buffers is not None and (s.row_logits is not None or s.child_probs is not None)
              and s.output is not None
              and s.prefix_len is not None]
    if not usable:
        result.why = "no step stores its buffers and target rows (top-M raw logits or child probabilities)"
        return result
    for r in sorted({s.request for s in usable}):
        mine = sorted((s for s in usable if s.request == r), key=lambda s: s.step)
        try:
            reproduced: list[int] = []
            finding, checked = _diagnose_request(run, target, mine, confirm, reproduced)
        except ValueError as exc:
            result.note = (result.note + "; " if result.note else "") + str(exc)  # it names the request
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
    how = "bisection" if all(s.row_logits is not None for s in usable) else "bisection (level full), every step (light)"
    result.note = (result.note + "; " if result.note else "") + f"steps compared by {how}"
    return result
