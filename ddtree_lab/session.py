"""Live DDTree decoding on a real target, one :class:`Step` per request per step.

One step for the batch of active requests (Ringel & Romano, arXiv 2604.12989, §4; the reference
``ddtree.py`` loop), each stage timed under one name (``Step.timings``, seconds):

1. ``draft``: the drafter's logits for the L-1 positions after each anchor, then the draft
   top-k (:func:`ddtree_lab.draft_topk_from_logits`);
2. ``build``: on an accelerator :func:`ddtree_lab.build_device.build_tree_device` (whole batch,
   on the draft's device, no host read), on the CPU :func:`ddtree_lab.build_tree` (the same trees,
   ~20x faster there: ``benchmarks/tree_build_device.out.txt``); :attr:`LiveSession.tree_build`
   picks one. Or the session's tree policy (``policy=``, :mod:`ddtree_lab.analysis.policies`) called once per request on the host;
3. ``compile``: :func:`ddtree_lab.compile_retrieve` (buffers, tree mask, positions);
4. ``target``: ONE forward over every active request's tree
   (:meth:`ddtree_lab.models.TargetModel.tree_forward_batch`: ragged trees padded to the batch's
   N, each on top of its own KV-cache row);
5. ``verify``: level ``full``: the full target rows (:func:`ddtree_lab.target_probs`) and the
   chosen backend; levels ``light`` / ``off``: the backend on the raw logits, reading only the
   rows the walk reaches (torch-lazy on CPU, Triton on CUDA by default);
6. ``record``: the :class:`Step` of each request at the recording level;
7. ``commit``: each KV-cache row keeps exactly its accepted path
   (:meth:`~ddtree_lab.models.TargetModel.keep_paths`), the drafter gets the features of the
   root and the accepted nodes (``Drafter.commit``), the bonus becomes the next anchor, and
   finished requests leave the batch.

The sync-free step (``verify_backend="torch-batched"``, levels ``off`` and ``light``; issue 36)
reads the host once per step: :mod:`ddtree_lab.live` (its methods come from
:class:`ddtree_lab.live.SyncFreeStep`).

Recording levels (``record=``): ``full`` (everything a :class:`Step` holds, every node's
target row and its top-64 raw logits), ``light`` (buffers, draft top-k, decisions and only the
rows the verifier read: ``child_probs`` of the visited nodes' children, NaN elsewhere, no
top-M rows: those fields are None, see :func:`ddtree_lab.record.record_step`), ``off``
(outputs only: no Step; the tokens, ``last_timings`` and ``stage_totals``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from .models.drafter import DraftContext, Drafter
from .buffers import compile_retrieve
from .sampling import SamplingParams, normalize_params, target_probs
from .record import TOP_M_LOGITS, record_step
from .step import LEVELS, STAGES, DraftTopK, Run, Step
from .build import DDTreeBuildResult, build_tree
from .build_device import build_tree_device
from .draft import draft_topk_from_logits
from .hostsync import to_device
from .live import StepClock, StepWriter, SyncFreeStep
from .verify import VerifyOutput, draw_coins, make_generators, residual_draw, verify_sampled
from .verify.batched import BatchedVerifyOutput

__all__ = ["LiveSession", "RequestState", "SESSION_BACKENDS"]


@dataclass
class RequestState:
    """The live state of one request (what a person sees as 'the conversation so far')."""

    request: int
    request_id: str
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    generated: list[int] = field(default_factory=list)  # first token (from prefill) onwards
    finish_reason: str | None = None
    prefix_len: int = 0
    anchor: int = -1
    generator: torch.Generator | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def committed_ids(self) -> list[int]:
        return self.prompt_ids + self.generated


def _request_output(out: VerifyOutput, b: int) -> VerifyOutput:
    decisions = [dataclasses.replace(d, request=0) for d in out.decisions[b]]
    return VerifyOutput(
        accept_index=out.accept_index[b : b + 1].clone(), accept_length=out.accept_length[b : b + 1].clone(),
        emitted_tokens=out.emitted_tokens[b : b + 1].clone(), bonus_token=out.bonus_token[b : b + 1].clone(),
        support_exhausted=out.support_exhausted[b : b + 1].clone(), decisions=[decisions],
        bonus=[dataclasses.replace(out.bonus[b], request=0)], backend=out.backend, thresholds=out.thresholds,
        lossy=out.lossy)


#: The verify backends a session takes: :data:`ddtree_lab.verify.BACKENDS` and ``"torch-batched"``
#: (the sync-free step, levels ``off`` and ``light``: :mod:`ddtree_lab.live`).
SESSION_BACKENDS = ("auto", "reference", "torch-lazy", "triton", "torch-batched")


def default_backend(record: str, device) -> str:
    """The verify backend a session uses when none is given: ``reference`` at level ``full``
    (it computes the full rows anyway); otherwise ``triton`` on CUDA where the kernels import,
    else ``torch-lazy``."""
    if record == "full":
        return "reference"
    if torch.device(device).type == "cuda":
        from .verify import select_backend

        try:
            return "triton" if select_backend("triton", device)[0] == "triton" else "torch-lazy"
        except RuntimeError:
            return "torch-lazy"
    return "torch-lazy"


class LiveSession(SyncFreeStep):
    """DDTree speculative decoding of a batch of prompts, live, recording each step.

    ``tree_build`` (attribute, default ``"auto"``): ``"device"`` builds each step's trees with
    :func:`~ddtree_lab.build_device.build_tree_device` where the draft lies (no host read),
    ``"host"`` with :func:`ddtree_lab.build_tree` on the host; ``"auto"`` is ``"device"`` on an
    accelerator and ``"host"`` on the CPU. Both give the same trees (``tests/test_build_device.py``).

    Args:
        target: a :class:`ddtree_lab.models.TargetModel`.
        drafter: a :class:`ddtree_lab.models.Drafter` (its ``block_size`` is L).
        block_size: L; must equal the drafter's (default: the drafter's).
        budget: B, draft nodes per tree (an int, or one per request).
        sampling: one :class:`SamplingParams` for every request or one per request.
        seed: seeds the coin generators of requests whose params have no seed
            (request ``b`` gets ``seed * 1000 + b``). One :class:`SamplingParams` with a
            seed given for the whole batch seeds request ``b`` with ``params.seed + b``, so
            requests never share coins.
        max_depth, top1_spine, min_prob: passed to :func:`ddtree_lab.build_tree`
            (``max_depth`` also to a policy, as ``PolicyContext.max_depth``).
        policy: the tree policy that builds each request's tree
            (:mod:`ddtree_lab.analysis.policies`: a function ``policy(draft, anchor_token_id,
            budget, context) -> DDTreeBuildResult`` or the name of a built-in one, e.g.
            ``"chain"``). None (default): DDTree best-first by :func:`ddtree_lab.build_tree`,
            as before. The recorded :class:`Step` holds the policy's tree as built (its draft
            nodes, not the budget asked, are what ``num_nodes - 1`` says); the policy's name
            is in the run's metadata (``"policy"``; absent without a policy) and in every
            step's ``extra["policy"]``,
            the budget asked in ``extra["policy_budget"]``.
        policy_context: the :class:`~ddtree_lab.analysis.policies.PolicyContext` handed to the
            policy (the ``cost`` policy's cost model); its ``batch_size`` is set to the active
            batch at every step.
        top_m: tokens kept per target row for display (see :mod:`ddtree_lab.record`).
        verify_backend: ``"reference"`` (:func:`ddtree_lab.verify_sampled` on
            :func:`ddtree_lab.target_probs`), ``"torch-lazy"``, ``"triton"`` or ``"auto"``
            (:func:`ddtree_lab.verify_tree` on the raw logits), or ``"torch-batched"`` (the
            sync-free step, :mod:`ddtree_lab.live`: level ``off`` or ``light``, no ``record_to``,
            planted fault or policy); default :func:`default_backend` of the level. Recorded in every :class:`Step`.
        record: ``"full"`` (default), ``"light"`` or ``"off"`` (module docstring).
        threshold_single, threshold_acc: SGLang's acceptance thresholds, passed to the
            verifier (:func:`ddtree_lab.verify_sampled`); 1.0 (default) is the exact rule,
            anything else is recorded as lossy in every step.
        record_to: a file to write the run to as it is made, append-only
            (:mod:`ddtree_lab.io.live_record`): each step's verify inputs before the verifier
            runs, its records after; a crash or a kill keeps every finished step. None: the
            run stays in memory only (:meth:`trace`).
        inputs_first: what ``record_to`` writes before each verify call: ``"buffers"``
            (default), ``"rows"`` (also the nodes' target logits, for replaying a call that
            never returns) or ``"off"``.
        faults: planted faults for tests and teaching (:mod:`ddtree_lab.faults`; default none).

    The session sets torch's thread count once per process (:mod:`ddtree_lab.threads`).

    Raises:
        ValueError: block size mismatch, unknown backend or level, ``"torch-batched"`` at
            level ``full`` or with ``record_to``, faults or a policy, or invalid parameters
            (naming the request), or bad thresholds; a ``policy`` with ``top1_spine`` /
            ``min_prob`` (options of :func:`ddtree_lab.build_tree` a policy does not take) or
            with a ``policy_context.max_depth`` other than ``max_depth``.
        KeyError: an unknown policy name.
        TypeError: a ``policy`` that is neither a name nor callable.
    """

    def __init__(self, target, drafter: Drafter, block_size: int | None = None, budget: int | Sequence[int] = 32,
                 sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(temperature=0.0),
                 seed: int = 0, max_depth: int | None = None, top1_spine: bool = False,
                 min_prob: float | None = None, top_m: int = 16, verify_backend: str | None = None,
                 record: str = "full", threshold_single: float = 1.0, threshold_acc: float = 1.0,
                 record_to=None, inputs_first: str = "buffers", faults=None, policy=None, policy_context=None):
        if block_size is not None and block_size != drafter.block_size:
            raise ValueError(f"block_size {block_size} != the drafter's block size {drafter.block_size}")
        if record not in LEVELS:
            raise ValueError(f"record must be one of {LEVELS}, got {record!r}")
        from .threads import configure_threads

        configure_threads()
        self.target = target
        self.drafter = drafter
        self.block_size = drafter.block_size
        if not isinstance(budget, (list, tuple, torch.Tensor)):  # per-request lists are checked per batch
            from .build import request_budgets

            request_budgets(budget, 1)
        self.budget = budget
        self.sampling = sampling
        self.seed = seed
        self.max_depth = max_depth
        self.top1_spine = top1_spine
        self.min_prob = min_prob
        self.policy, self.policy_context = self._check_policy(policy, policy_context)
        self.top_m = top_m
        self.record = record
        from .verify import check_thresholds
        check_thresholds(threshold_single, threshold_acc)
        self.threshold_single, self.threshold_acc = float(threshold_single), float(threshold_acc)

        if verify_backend is None:
            verify_backend = default_backend(record, target.device)
        if verify_backend not in SESSION_BACKENDS:
            raise ValueError(f"verify_backend must be one of {SESSION_BACKENDS}, got {verify_backend!r}")
        self.verify_backend = verify_backend
        from .faults import as_faults

        self.faults = as_faults(faults)  # planted faults: identity hooks unless given
        self.requests: list[RequestState] = []
        self.steps: list[Step] = []
        self.missing_records: list[dict] = []  # sync-free steps whose records failed: {"step", "error"}
        self.last_timings: dict[str, float] = {}
        self.stage_totals: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self.num_steps = 0
        self._batch = None  # BatchCache of the active requests
        self._rows: list[int] = []  # request index of each batch row
        self.extra_metadata: dict = {}  # merged into trace()'s metadata (e.g. the CLI's thread count)
        self.recorder = None
        if record_to is not None:
            from .io.live_record import SessionRecorder

            self.recorder = SessionRecorder(record_to, inputs_first)
        # The build and verify stages, chosen once: the step calls them and never branches on
        # the policy, the backend or a planted fault.
        self._build = self._build_ddtree if self.policy is None else self._build_policy
        if verify_backend == "torch-batched":
            others = [what for what, on in (("record_to", record_to is not None), ("faults", bool(self.faults)),
                                            ("a policy", policy is not None)) if on]
            if record == "full" or others:
                raise ValueError("verify_backend 'torch-batched' runs at record='off' or 'light', without "
                                 "record_to, planted faults or a policy (got "
                                 + ", ".join([f"record={record!r}"] + others) + ")")
        self._writer = StepWriter()
        if self.faults.verifier or self.faults.sampling:
            self._verify = self._verify_planted
        elif self.verify_backend == "reference":
            self._verify = self._verify_reference
        else:
            self._verify = self._verify_backend

    def _check_policy(self, policy, context) -> "tuple[Callable[..., Any] | None, Any]":
        if policy is None:
            if context is not None:
                raise ValueError("policy_context is given without a policy")
            return None, None
        from .analysis.policies import PolicyContext, get_policy

        if isinstance(policy, str):
            policy = get_policy(policy)
        if not callable(policy):
            raise TypeError(f"policy must be a policy function or the name of one, got {type(policy).__name__}")
        fn: Callable[..., Any] = policy
        if self.top1_spine or self.min_prob is not None:
            raise ValueError("top1_spine and min_prob are options of build_tree: a policy does not take them "
                             "(write them into the policy)")
        context = context if context is not None else PolicyContext()
        if not isinstance(context, PolicyContext):
            raise TypeError(f"policy_context must be a PolicyContext, got {type(context).__name__}")
        if context.max_depth is not None and self.max_depth is not None and context.max_depth != self.max_depth:
            raise ValueError(f"policy_context.max_depth {context.max_depth} != max_depth {self.max_depth}")
        if context.max_depth is None and self.max_depth is not None:
            context = dataclasses.replace(context, max_depth=self.max_depth)
        return fn, context

    @property
    def policy_label(self) -> str:
        """The recorded name of the tree policy (``"ddtree"`` when none was given)."""
        if self.policy is None:
            return "ddtree"
        from .analysis.policies import policy_name

        return policy_name(self.policy)

    @property
    def layer_ids(self) -> list[int] | None:
        return list(getattr(self.drafter, "target_layer_ids", None) or []) or None

    # -- set-up ------------------------------------------------------------------------------

    def start(self, prompts: str | Sequence[str], chat: bool = True, request_ids: Sequence[str] | None = None) -> None:
        """Prefill every prompt in one batched forward, hand the drafter the prompts' features,
        and emit each request's first token (the first anchor)."""
        if prompts is None or not isinstance(prompts, (str, list, tuple)):
            raise TypeError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        for b, prompt in enumerate(prompts):
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"request {b}: prompt must be a non-empty string, got {prompt!r}")
        if request_ids is not None and len(request_ids) != len(prompts):
            raise ValueError(f"request_ids has {len(request_ids)} entries for {len(prompts)} prompts")
        from .build import request_budgets

        self.request_budgets = request_budgets(self.budget, len(prompts))  # validated before any prefill
        params = normalize_params(self.sampling, len(prompts), self.target.vocab_size)
        shared = isinstance(self.sampling, SamplingParams)
        params = [dataclasses.replace(p, seed=self.seed * 1000 + b) if p.seed is None
                  else dataclasses.replace(p, seed=p.seed + b) if shared else p
                  for b, p in enumerate(params)]
        gens = make_generators(params, device="cpu")
        self._written(wait=True)  # a previous run's pending steps join its steps, which a new start drops
        self.requests, self.steps, self.num_steps, self.missing_records = [], [], 0, []
        self.stage_totals = dict.fromkeys(STAGES, 0.0)
        ids_all = [self.target.encode_prompt(prompt, chat=chat) for prompt in prompts]
        self.drafter.start(len(prompts))
        state, feats, last = self.target.prefill_batch(ids_all, self.layer_ids)
        for b, (prompt, ids, p, g) in enumerate(zip(prompts, ids_all, params, gens)):
            self.drafter.commit(b, self.faults.drafter_features(feats[b], prefill=True), 0)
            probs = target_probs(last[b : b + 1, None].float().cpu(), p)[0, 0]
            u = float(torch.rand(1, generator=g))
            first, _, _ = residual_draw(probs, [], u)
            rid = str(request_ids[b]) if request_ids is not None else str(b)
            st = RequestState(b, rid, prompt, ids, p, prefix_len=len(ids), anchor=first, generator=g)
            st.generated.append(first)
            if first in self.target.eos_token_ids:
                st.finish_reason = "eos"
            self.requests.append(st)
        self._batch, self._rows = state, list(range(len(prompts)))
        self._leave_finished()
        if self.recorder is not None:
            run = self.trace()
            self.recorder.open(run.metadata)

    def _leave_finished(self) -> None:
        keep = [j for j, r in enumerate(self._rows) if not self.requests[r].finished]
        if len(keep) != len(self._rows):
            self.target.drop_rows(self._batch, keep)
            self._rows = [self._rows[j] for j in keep]

    # -- one step ----------------------------------------------------------------------------

    def step(self, max_new_tokens: int) -> list[Step]:
        """One DDTree step for every unfinished request, one batched target forward.

        Args:
            max_new_tokens: the cap on each request's generated tokens (its first token, made
                by the prefill, included): a request that reaches it finishes with ``"length"``.

        Host reads (``benchmarks/host_syncs.py``): the per-request walks (every backend but
        ``"torch-batched"``) read tens per request (draft top-k, buffer checks, walks) and the
        result once; ``"torch-batched"`` reads once, at the commit (:mod:`ddtree_lab.live`).
        The tree is built on the host on a CPU, on the device on an accelerator (:attr:`tree_build`).

        Returns:
            the :class:`Step` s of the requests that took part (empty at level ``off``). With
            ``verify_backend="torch-batched"`` at level ``light`` the records are written one
            step behind: this returns the *previous* step's (none on the first call), and the
            call that finds no active request returns the last ones; so loop on the requests'
            ``finish_reason`` (or use :meth:`generate` / :meth:`run`), not on a non-empty return.
        """
        if self._batch is not None:
            self._leave_finished()
        active = [self.requests[r] for r in self._rows]
        if not active:
            return self._written(wait=True)  # the sync-free step's last records (nothing otherwise)
        if self.verify_backend == "torch-batched":
            self._step_batched(active, max_new_tokens)
            # the previous step's records: written while this step ran (this step's come next time)
            return self._written(upto=self.num_steps - 2)
        step_no = self.num_steps
        clock = StepClock(self.target.device)
        anchors = torch.tensor([r.anchor for r in active], dtype=torch.int64)
        prefix = torch.tensor([r.prefix_len for r in active], dtype=torch.int64)
        context = DraftContext([r.request for r in active], anchors, prefix.clone(), [r.committed_ids for r in active])
        draft_logits = self.faults.draft_logits(self.drafter.draft_logits(self.faults.draft_context(context)))
        budgets = [self.request_budgets[r.request] for r in active]
        ids, lps = draft_topk_from_logits(draft_logits.float(), k=min(max(budgets + [1]), draft_logits.shape[-1]))
        clock.mark("draft")
        tree = self._build(ids, lps, anchors, budgets)
        clock.mark("build")
        vi = compile_retrieve(tree, prefix)
        clock.mark("compile")
        fwd = self.target.tree_forward_batch(self._batch, self.faults.forward_input(vi, tree.parents), self.layer_ids)
        logits = fwd.logits
        clock.mark("target")
        gens = [r.generator for r in active]
        assert all(g is not None for g in gens)  # start() gives every request its generator
        coins, final = draw_coins([g for g in gens if g is not None], vi.num_rows)
        if self.recorder is not None:  # on disk before the verifier runs (a hang leaves them there)
            self.recorder.inputs(step_no, active, tree, vi, coins, final, logits, self.record, self.verify_backend)
        out, final, probs = self._verify(vi, logits, [r.params for r in active], coins, final, tree.node_logws)
        clock.mark("verify")
        traces = []
        if self.record != "off":
            ids, lps = ids.cpu(), lps.cpu()  # the recorded draft top-k, on the host
            for b, r in enumerate(active):
                traces.append(self._record(step_no, b, r, ids, lps, tree, vi, logits, probs, coins, final, out))
        clock.mark("record")
        self._commit(active, out, fwd.hidden, vi.num_rows, max_new_tokens)
        clock.mark("commit")
        timings = self._count(clock)
        for t in traces:
            t.timings = dict(timings)
        self.steps.extend(traces)
        if self.recorder is not None:
            self.recorder.steps(traces, self.target.token_text)
        return traces

    def _count(self, clock: StepClock) -> dict[str, float]:
        timings = clock.result()
        self.last_timings = timings
        for k, v in timings.items():
            self.stage_totals[k] += v
        self.num_steps += 1
        return timings

    def _builds_on_host(self, ids) -> bool:
        if self.tree_build not in ("auto", "device", "host"):
            raise ValueError(f"LiveSession.tree_build: 'auto', 'device' or 'host', not {self.tree_build!r}")
        return self.policy is not None or self.tree_build == "host" or (self.tree_build == "auto"
                                                                        and ids.device.type == "cpu")

    def _build_ddtree(self, ids, lps, anchors, budgets) -> DDTreeBuildResult:
        if self._builds_on_host(ids):
            return build_tree(ids.cpu(), lps.cpu(), anchors, budgets, self.max_depth, top1_spine=self.top1_spine,
                              min_prob=self.min_prob)
        # on the draft's device, no host read: the top-k comes from draft_topk_from_logits,
        # which checked the logits, so its rows are not read back to be checked again
        return build_tree_device(ids, lps, to_device(anchors, ids.device), budgets, self.max_depth,
                                 top1_spine=self.top1_spine, min_prob=self.min_prob, validate=False)

    def _build_policy(self, ids, lps, anchors, budgets) -> DDTreeBuildResult:
        from .analysis.policies import build_policy_trees

        assert self.policy is not None and self.policy_context is not None  # set together (_check_policy)
        return build_policy_trees(self.policy, ids.cpu(), lps.cpu(), anchors, budgets,
                                  dataclasses.replace(self.policy_context, batch_size=len(budgets)))

    def _full_rows(self, vi, logits, params) -> torch.Tensor | None:
        """The full target rows at level ``full`` (recorded), None at the other levels."""
        return target_probs(logits.cpu(), params, num_nodes=vi.num_nodes) if self.record == "full" else None

    def _verify_reference(self, vi, logits, params, coins, final, node_logws):
        probs = self._full_rows(vi, logits, params)
        if probs is None:
            probs = target_probs(logits.cpu(), params, num_nodes=vi.num_nodes)
        out = verify_sampled(vi, probs, coins, final, threshold_single=self.threshold_single,
                             threshold_acc=self.threshold_acc)
        return out, final, probs

    def _verify_backend(self, vi, logits, params, coins, final, node_logws):
        from .verify import verify_tree

        probs = self._full_rows(vi, logits, params)
        host = logits if self.verify_backend in ("triton", "auto") else logits.cpu()
        out = verify_tree(vi, host, params, coins, final, backend=self.verify_backend,
                          threshold_single=self.threshold_single, threshold_acc=self.threshold_acc)
        return out, final, probs

    def _verify_planted(self, vi, logits, params, coins, final, node_logws):
        """Verify under the planted sampling or verifier fault (:mod:`ddtree_lab.faults`): the rows
        are made with the fault's parameters, and a verifier fault replaces the verifier."""
        params = self.faults.verify_params(params)
        if not self.faults.verifier:
            verify = self._verify_reference if self.verify_backend == "reference" else self._verify_backend
            return verify(vi, logits, params, coins, final, node_logws)
        probs = target_probs(logits.cpu(), params, num_nodes=vi.num_nodes)
        out, final = self.faults.verify(vi, probs, coins, final, node_logws, logits=logits.cpu(), params=params)
        return out, final, probs

    def _record(self, step_no, b, r, ids, lps, tree, vi, logits, probs, coins, final, out) -> Step:
        return record_step(
            step=step_no, request=r.request, request_id=r.request_id, prefix_len=r.prefix_len, params=r.params,
            tree=tree.request(b), buffers=vi.request(b), output=_request_output(out, b),
            coins=coins[b], final_coin=float(final[b]), draft=DraftTopK(ids[b], lps[b]),
            logits=logits[b], probs=None if probs is None else probs[b], level=self.record,
            top_m=self.top_m, top_m_logits=TOP_M_LOGITS, backend=out.backend,
            extra=None if self.policy is None else {"policy": self.policy_label,
                                                    "policy_budget": int(self.request_budgets[r.request])})

    def _commit(self, active: list[RequestState], out: "VerifyOutput | BatchedVerifyOutput", features: torch.Tensor,
                num_rows: int, max_new_tokens: int, checks: torch.Tensor | None = None) -> list[bool]:
        """Commit the step; returns the ``checks`` flags as read (and commits nothing when one is set)."""
        # the one host read of the step's result: accepted paths, emitted tokens, support
        # exhausted and bonus token of every request, and the deferred checks' flags, in one copy
        n_path, n_emit = out.accept_index.shape[1], out.emitted_tokens.shape[1]
        bs = out.accept_index.shape[0]
        table = torch.cat([out.accept_index, out.emitted_tokens.to(out.accept_index.device),
                           out.support_exhausted.to(out.accept_index)[:, None],
                           out.bonus_token.to(out.accept_index)[:, None]], 1)
        extra = [] if checks is None else [checks.to(table).reshape(-1)]
        flat = torch.cat([table.reshape(-1)] + extra).tolist()
        width = table.shape[1]
        result = [flat[b * width:(b + 1) * width] for b in range(bs)]
        flags = [bool(v) for v in flat[bs * width:]]
        if any(flags):
            return flags
        paths = [[i for i in row[:n_path] if i >= 0] for row in result]
        self.target.keep_paths(self._batch, self.faults.kept_rows(paths), num_rows)
        for b, r in enumerate(active):
            emitted, exhausted, bonus = result[b][n_path:n_path + n_emit], result[b][-2], result[b][-1]
            path = paths[b]
            idx = to_device(torch.tensor(path, dtype=torch.int64), features.device)
            self.drafter.commit(r.request, self.faults.drafter_features(features[b].index_select(0, idx)), r.prefix_len)
            r.prefix_len += len(path)
            for t in (t for t in emitted if t >= 0):
                r.generated.append(t)
                if t in self.target.eos_token_ids:
                    r.finish_reason = "eos"
                    break
                if len(r.generated) >= max_new_tokens:
                    r.finish_reason = "length"
                    break
            if exhausted and r.finish_reason is None:
                r.finish_reason = "support_exhausted"
            r.anchor = int(bonus)
        self._leave_finished()
        return flags

    # -- whole runs --------------------------------------------------------------------------

    def generate(self, prompts: str | Sequence[str], max_new_tokens: int = 64, chat: bool = True,
                 request_ids: Sequence[str] | None = None) -> Iterator[Step]:
        """Start the prompts and yield each request's :class:`Step` as steps complete."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        self.start(prompts, chat=chat, request_ids=request_ids)
        for r in self.requests:
            if len(r.generated) >= max_new_tokens and not r.finished:
                r.finish_reason = "length"
        self._leave_finished()
        while any(not r.finished for r in self.requests):
            yield from self.step(max_new_tokens)
        yield from self._written(wait=True)
        self.close_recording()

    def close_recording(self, note: str = "closed") -> None:
        """With ``record_to``: write the final metadata and token texts and close the file
        (``note``, e.g. ``"interrupted"``, is kept in its end segment). No-op otherwise."""
        if self.recorder is not None:
            run = self.trace()
            self.recorder.close(run.metadata, run.token_texts, note)

    def run(self, prompts: str | Sequence[str], max_new_tokens: int = 64, chat: bool = True,
            request_ids: Sequence[str] | None = None) -> Run:
        """Generate to the end and return the recorded :class:`Run`."""
        for _ in self.generate(prompts, max_new_tokens, chat, request_ids):
            pass
        return self.trace()

    def text(self, request: int = 0) -> str:
        """The generated text of a request so far."""
        if not 0 <= request < len(self.requests):
            raise IndexError(f"request {request} does not exist: the session has {len(self.requests)} requests")
        return self.target.decode(self.requests[request].generated)

    def trace(self) -> Run:
        """The run so far as a :class:`Run` (metadata, steps, token texts)."""
        import platform

        from .version import __version__

        self._written(wait=True)
        seen = set()
        for r in self.requests:
            seen.update(r.generated)
            seen.update(r.prompt_ids[-8:])
        for s in self.steps:
            seen.update(s.token_ids())  # tree, draft top-k, display rows, outputs (what the level stores)
        seen.discard(-1)
        texts = {t: self.target.token_text(t) for t in sorted(seen)}
        meta = {
            "target": self.target.metadata(),
            "tokenizer": self.target.name,
            "drafter": self.drafter.metadata(),
            "block_size": self.block_size, "budget": self.budget, "max_depth": self.max_depth,
            "top1_spine": self.top1_spine, "min_prob": self.min_prob, "top_m": self.top_m, "seed": self.seed,
            "thresholds": [self.threshold_single, self.threshold_acc],
            "record": self.record, "num_steps": self.num_steps, "stage_totals": dict(self.stage_totals),
            "verifier": f"{self.verify_backend} (greedy requests: one-hot rows); see each step's backend",
            "requests": [{"request": r.request, "request_id": r.request_id, "prompt": r.prompt,
                          "prompt_token_ids": r.prompt_ids, "params": r.params.to_dict(),
                          "generated_token_ids": r.generated, "finish_reason": r.finish_reason}
                         for r in self.requests],
            **({"planted_faults": list(self.faults.names)} if self.faults else {}),
            **({"policy": self.policy_label} if self.policy is not None else {}),
            **({"missing_records": list(self.missing_records)} if self.missing_records else {}),
            "versions": {"ddtree_lab": __version__, "torch": torch.__version__,
                         "python": platform.python_version()},
        }
        meta.update(self.extra_metadata)
        try:
            import transformers

            meta["versions"]["transformers"] = transformers.__version__
        except ImportError:  # pragma: no cover - models extra missing
            pass
        return Run(metadata=meta, steps=list(self.steps), token_texts=texts)
