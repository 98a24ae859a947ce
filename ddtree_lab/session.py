"""Live DDTree decoding on a real target, one :class:`StepTrace` per request per step.

One step for a batch of requests (Ringel & Romano, arXiv 2604.12989, §4; the reference
``ddtree.py`` loop):

1. draft: the drafter's logits for the L-1 positions after each anchor -> draft top-k;
2. build: :func:`ddtree_lab.build_tree` (whole batch);
3. retrieve: :func:`ddtree_lab.compile_retrieve` (buffers, tree mask, positions);
4. target: one tree forward per request over its ``1 + B`` nodes on top of its KV cache;
5. verify: :func:`ddtree_lab.target_probs` then :func:`ddtree_lab.verify_sampled` for the whole
   batch (greedy requests get one-hot rows, so the rule accepts exactly the argmax child);
6. commit: keep exactly the accepted path in each KV cache; the bonus becomes the next anchor,
   the hidden state of the last accepted node feeds the drafter.

The session records every step; the views read the records and never the models.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from .models.drafter import DraftContext, Drafter
from .retrieve import compile_retrieve
from .sampling import SamplingParams, normalize_params, target_probs
from .trace import TOP_M_LOGITS, RunTrace, StepTrace, make_step_trace
from .tree import build_tree, draft_topk_from_logits
from .verify import VerifyOutput, draw_coins, make_generators, residual_draw, verify_sampled

__all__ = ["LiveSession", "RequestState"]


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
    cache: object = None
    prefix_len: int = 0
    anchor: int = -1
    hidden: torch.Tensor | None = None
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
        bonus=[dataclasses.replace(out.bonus[b], request=0)], backend=out.backend)


class LiveSession:
    """DDTree speculative decoding of a batch of prompts, live, recording each step.

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
        max_depth, top1_spine, min_prob: passed to :func:`ddtree_lab.build_tree`.
        top_m: tokens kept per target row for display (see :mod:`ddtree_lab.trace`).
        verify_backend: ``"reference"`` (default: :func:`ddtree_lab.verify_sampled` on
            :func:`ddtree_lab.target_probs`), or ``"torch-lazy"``, ``"triton"``, ``"auto"``
            through :func:`ddtree_lab.verify_tree` on the raw logits. The backend that ran is
            recorded in every :class:`StepTrace` (``backend``).

    Raises:
        ValueError: block size mismatch, or invalid parameters (naming the request).
    """

    def __init__(self, target, drafter: Drafter, block_size: int | None = None, budget: int | Sequence[int] = 32,
                 sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(temperature=0.0),
                 seed: int = 0, max_depth: int | None = None, top1_spine: bool = False,
                 min_prob: float | None = None, top_m: int = 16, verify_backend: str = "reference"):
        if block_size is not None and block_size != drafter.block_size:
            raise ValueError(f"block_size {block_size} != the drafter's block size {drafter.block_size}")
        self.target = target
        self.drafter = drafter
        self.block_size = drafter.block_size
        self.budget = budget
        self.sampling = sampling
        self.seed = seed
        self.max_depth = max_depth
        self.top1_spine = top1_spine
        self.min_prob = min_prob
        self.top_m = top_m
        from .verify_backends import BACKENDS

        if verify_backend not in BACKENDS:
            raise ValueError(f"verify_backend must be one of {BACKENDS}, got {verify_backend!r}")
        self.verify_backend = verify_backend
        self.requests: list[RequestState] = []
        self.steps: list[StepTrace] = []

    # -- set-up ------------------------------------------------------------------------------

    def start(self, prompts: str | Sequence[str], chat: bool = True, request_ids: Sequence[str] | None = None) -> None:
        """Prefill each prompt and emit its first token (the first anchor)."""
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
        params = normalize_params(self.sampling, len(prompts), self.target.vocab_size)
        shared = isinstance(self.sampling, SamplingParams)
        params = [dataclasses.replace(p, seed=self.seed * 1000 + b) if p.seed is None
                  else dataclasses.replace(p, seed=p.seed + b) if shared else p
                  for b, p in enumerate(params)]
        from .tree import _budgets

        self._budgets = _budgets(self.budget, len(prompts))  # validated before any prefill
        gens = make_generators(params, device="cpu")
        self.requests, self.steps = [], []
        for b, (prompt, p, g) in enumerate(zip(prompts, params, gens)):
            ids = self.target.encode_prompt(prompt, chat=chat)
            cache, hidden, logits = self.target.prefill(ids)
            probs = target_probs(logits[-1:][None], p)[0, 0]
            u = float(torch.rand(1, generator=g))
            first, _, _ = residual_draw(probs, [], u)
            rid = str(request_ids[b]) if request_ids is not None else str(b)
            st = RequestState(b, rid, prompt, ids, p, cache=cache, prefix_len=len(ids), anchor=first,
                              hidden=hidden[-1], generator=g)
            st.generated.append(first)
            if first in self.target.eos_token_ids:
                st.finish_reason = "eos"
            self.requests.append(st)

    # -- one step ----------------------------------------------------------------------------

    def step(self, max_new_tokens: int) -> list[StepTrace]:
        """One DDTree step for every unfinished request; returns their step traces."""
        active = [r for r in self.requests if not r.finished]
        if not active:
            return []
        step_no = 1 + max((s.step for s in self.steps), default=-1)
        bs = len(active)
        timings = {}
        t0 = time.perf_counter()
        anchors = torch.tensor([r.anchor for r in active], dtype=torch.int64)
        context = DraftContext([r.committed_ids for r in active], anchors, torch.stack([r.hidden for r in active]))
        draft_logits = self.drafter.draft_logits(context).float().cpu()
        budgets = [self._budgets[r.request] for r in active]
        ids, lps = draft_topk_from_logits(draft_logits, k=min(max(budgets + [1]), draft_logits.shape[-1]))
        timings["draft"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        tree = build_tree(ids, lps, anchors, budgets, self.max_depth, top1_spine=self.top1_spine,
                          min_prob=self.min_prob)
        timings["build"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        vi = compile_retrieve(tree, torch.tensor([r.prefix_len for r in active], dtype=torch.int64))
        timings["retrieve"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        n_rows, vocab = vi.num_rows, self.target.vocab_size
        logits = torch.zeros(bs, n_rows, vocab)
        hidden = []
        for b, r in enumerate(active):
            fwd = self.target.tree_forward(r.cache, vi, b)
            n = fwd.logits.shape[0]
            logits[b, :n] = fwd.logits.cpu()
            hidden.append(fwd.hidden.cpu())
        timings["target"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        params = [r.params for r in active]
        # Full rows are needed for the record (child probabilities, top-M, the bonus prefix),
        # whichever backend verifies; the lazy / Triton backends still verify from the logits.
        probs = target_probs(logits, params, num_nodes=vi.num_nodes)
        coins, final = draw_coins([r.generator for r in active], n_rows)
        if self.verify_backend == "reference":
            out = verify_sampled(vi, probs, coins, final)
        else:
            from .verify_backends import verify_tree

            out = verify_tree(vi, logits, params, coins, final, backend=self.verify_backend)
        timings["verify"] = time.perf_counter() - t0
        traces = []
        for b, r in enumerate(active):
            traces.append(self._record(step_no, b, r, ids, lps, tree, vi, logits, probs, coins, final, out, timings))
            self._commit(r, out, b, hidden[b], max_new_tokens)
        self.steps.extend(traces)
        return traces

    def _record(self, step_no, b, r, ids, lps, tree, vi, logits, probs, coins, final, out, timings) -> StepTrace:
        t0 = time.perf_counter()
        n = int(tree.num_nodes[b])
        local = vi.request(b)
        trace = make_step_trace(
            step=step_no, request=r.request, request_id=r.request_id, prefix_len=r.prefix_len, params=r.params,
            output=_request_output(out, b), level=getattr(self, "level", "full"),
            node_token_ids=tree.node_token_ids[b, :n], parents=tree.parents[b, :n], depths=tree.depths[b, :n],
            ranks=tree.ranks[b, :n], node_logws=tree.node_logws[b, :n],
            retrieve_next_token=local.retrieve_next_token[0, :n], retrieve_next_sibling=local.retrieve_next_sibling[0, :n],
            positions=vi.positions[b, :n], draft_token_ids=ids[b], draft_logprobs=lps[b], coins=coins[b, :n],
            final_coin=float(final[b]), logits=logits[b, :n], probs=None if probs is None else probs[b, :n],
            top_m=self.top_m, top_m_logits=getattr(self, "top_m_logits", TOP_M_LOGITS), timings=timings,
            backend=out.backend)
        trace.timings["record"] = time.perf_counter() - t0
        return trace

    def _commit(self, r: RequestState, out: VerifyOutput, b: int, hidden: torch.Tensor, max_new_tokens: int) -> None:
        path = [i for i in out.accept_index[b].tolist() if i >= 0]
        self.target.keep_path(r.cache, r.prefix_len, path)
        r.prefix_len += len(path)
        r.hidden = hidden[path[-1]]
        emitted = [t for t in out.emitted_tokens[b].tolist() if t >= 0]
        for t in emitted:
            r.generated.append(t)
            if t in self.target.eos_token_ids:
                r.finish_reason = "eos"
                break
            if len(r.generated) >= max_new_tokens:
                r.finish_reason = "length"
                break
        if bool(out.support_exhausted[b]) and r.finish_reason is None:
            r.finish_reason = "support_exhausted"
        r.anchor = int(out.bonus_token[b])

    # -- whole runs --------------------------------------------------------------------------

    def generate(self, prompts: str | Sequence[str], max_new_tokens: int = 64, chat: bool = True,
                 request_ids: Sequence[str] | None = None) -> Iterator[StepTrace]:
        """Start the prompts and yield each request's :class:`StepTrace` as steps complete."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        self.start(prompts, chat=chat, request_ids=request_ids)
        for r in self.requests:
            if len(r.generated) >= max_new_tokens and not r.finished:
                r.finish_reason = "length"
        while any(not r.finished for r in self.requests):
            yield from self.step(max_new_tokens)

    def run(self, prompts: str | Sequence[str], max_new_tokens: int = 64, chat: bool = True,
            request_ids: Sequence[str] | None = None) -> RunTrace:
        """Generate to the end and return the recorded :class:`RunTrace`."""
        for _ in self.generate(prompts, max_new_tokens, chat, request_ids):
            pass
        return self.trace()

    def text(self, request: int = 0) -> str:
        """The generated text of a request so far."""
        if not 0 <= request < len(self.requests):
            raise IndexError(f"request {request} does not exist: the session has {len(self.requests)} requests")
        return self.target.decode(self.requests[request].generated)

    def trace(self) -> RunTrace:
        """The run so far as a :class:`RunTrace` (metadata, steps, token texts)."""
        import platform

        import ddtree_lab

        seen = set()
        for r in self.requests:
            seen.update(r.generated)
            seen.update(r.prompt_ids[-8:])
        for s in self.steps:
            seen.update(s.node_token_ids.tolist())
            seen.update(s.top_token_ids.flatten().tolist())
            seen.update(s.draft_token_ids.flatten().tolist())
            seen.add(s.bonus_token)
        seen.discard(-1)
        texts = {t: self.target.token_text(t) for t in sorted(seen)}
        meta = {
            "target": self.target.metadata(),
            "tokenizer": self.target.name,
            "drafter": self.drafter.metadata(),
            "block_size": self.block_size, "budget": self.budget, "max_depth": self.max_depth,
            "top1_spine": self.top1_spine, "min_prob": self.min_prob, "top_m": self.top_m, "seed": self.seed,
            "verifier": f"{self.verify_backend} (greedy requests: one-hot rows); see each step's backend",
            "requests": [{"request": r.request, "request_id": r.request_id, "prompt": r.prompt,
                          "prompt_token_ids": r.prompt_ids, "params": r.params.to_dict(),
                          "generated_token_ids": r.generated, "finish_reason": r.finish_reason}
                         for r in self.requests],
            "versions": {"ddtree_lab": ddtree_lab.__version__, "torch": torch.__version__,
                         "python": platform.python_version()},
        }
        try:
            import transformers

            meta["versions"]["transformers"] = transformers.__version__
        except ImportError:  # pragma: no cover - models extra missing
            pass
        return RunTrace(metadata=meta, steps=list(self.steps), token_texts=texts)
