"""Bug-report bundles: make, write and replay a minimal, self-contained repro of ONE verify step.

A bundle directory holds

* ``bundle.safetensors``: the step (tree, buffers, draft top-k, parameters, coins, recorded
  output and decision log, timings) in the trace container (every tensor and the JSON
  document checksummed, :func:`ddtree_lab.store.container.read_container`), the token texts of the
  tokens involved, and where it came from;
* ``tree.svg``: the step's diagram (:func:`ddtree_lab.views.step_svg`);
* ``README.md``: what it is and how to replay it (``ddtree-lab replay DIR``).

**The rows the verifier needs, reduced** (nothing else of the target's rows is kept):

* ``child_probs [n]``: each node's token probability in its parent's row -- every verdict
  of the walk reads only these (the rows of unvisited nodes are never read);
* the bonus draw (:func:`ddtree_lab.verify.residual_draw`) reads the residual row (rejected
  siblings zeroed) through its float64 running sum ``cum``, in token-id order, up to the drawn
  token ``t``, and the residual mass. With a chunk start ``c <= t`` (a multiple of
  :data:`CHUNK`), the draw depends on tokens ``< c`` only through ``cum[c - 1]`` (and
  ``cum[c - 1] <= coin * mass`` holds, since ``t`` was drawn): the bundle stores that float64
  sum (``final_row_base``), ``c`` and the last chunk's values ``row[c .. t]``
  (``final_row_tail``, at most :data:`CHUNK` floats).

Replay rebuilds a row prefix the unchanged reference verifier reads exactly as it read the
original: the tail at ``c .. t``, the children's probabilities at their tokens, and
``final_row_base`` written as at most three float32 pieces (each the float32 truncation of
what is left) at free token positions below ``c``: every partial sum of the pieces is a
prefix of the base's binary digits, hence exact in float64, so the running sum reaches
``cum[c - 1]`` exactly and agrees with the original from ``c`` on. :func:`make_bundle`
checks this (bit for bit) and proves the bundle by replaying it beside the full step;
where it cannot, it keeps the whole prefix.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .io.bundle import (CHUNK, FILES, FORMAT, VERSION, Bundle, bundle_run, bundle_step,  # noqa: F401  (re-exported)
                        load_bundle, reduce_bonus_row)
from .store.container import write_container
from .io.lab_trace import step_json, step_tensors
from .replaying import Difference, compare_outputs, replay_differences
from .step import Run, Step, TargetRows
from .verify import VerifyOutput
from .views.labels import mass_label

__all__ = ["Bundle", "BundleReplay", "make_bundle", "save_bundle", "load_bundle", "replay_bundle", "bundle_run", "CHUNK"]


@dataclass
class BundleReplay:
    """What :func:`replay_bundle` found: the replayed output and its differences from the
    recorded one (empty: reproduced; bit for bit unless the step came from the Triton
    backend, whose probabilities compare within the kernel tolerance)."""

    output: VerifyOutput
    differences: list[Difference]

    @property
    def ok(self) -> bool:
        return not self.differences

    def lines(self) -> list[str]:
        return [str(d) for d in self.differences]


def make_bundle(run: Run, step: int | Step, request: int | None = None) -> Bundle:
    """The bundle of decoding step ``step`` of request ``request`` of ``run`` (or of the
    :class:`Step` ``step`` of ``run``).

    The reduced rows are proven on the spot: the reference verifier on the bundle's rows
    must give exactly the output it gives on the full step's rows (whether or not that
    matches the recorded output -- a bundle may well be filed because it does not).

    Raises:
        KeyError: no such step / request in ``run``.
        ValueError: the step stores no verify rows (recorded at level ``off``).
        AssertionError: the reduction does not replay like the full step (a bug in this module).
    """
    from . import views

    if isinstance(step, Step):
        s, step, request = step, step.step, step.request
    elif request is None:
        raise TypeError("make_bundle(run, step, request): give the request, or pass a Step as step")
    else:
        s = run.find_step(step, request)
    if s.child_probs is None or s.final_row_prefix is None:
        raise ValueError(f"step {step}, request {request}: recorded at level {s.level!r}: no verify rows to bundle")
    c, base, tail = reduce_bonus_row(s)
    kept_rows = TargetRows(kind="bundle", child_probs=s.child_probs, final_mass=s.final_mass,
                           row_logsumexp=s.row_logsumexp, node_logits=s.node_logits)
    keep = dataclasses.replace(s, rows=kept_rows, level="light", timings=dict(s.timings), extra=dict(s.extra))
    wanted = s.token_ids() | set(s.draft_token_ids.flatten().tolist())
    if s.top_token_ids is not None:
        for i in s.accepted_path:
            wanted.update(s.top_token_ids[i].tolist())
    texts = {t: run.token_texts[t] for t in sorted(wanted) if t in run.token_texts}
    meta = {key: run.metadata.get(key) for key in ("vocab_size", "tokenizer", "source") if run.metadata.get(key) is not None}
    for key in ("target", "drafter"):
        value = run.metadata.get(key)
        if isinstance(value, dict):
            meta[key] = {k: v for k, v in value.items() if k in ("name", "dtype", "device", "vocab_size", "block_size")}
    meta["from"] = {"step": s.step, "request": s.request, "request_id": s.request_id, "level": s.level}
    requests = run.metadata.get("requests") or []
    if 0 <= s.request < len(requests) and isinstance(requests[s.request], dict):
        r = requests[s.request]
        earlier = sum(len(t.emitted) for t in run.for_request(s.request) if t.step < s.step)
        generated = list(r.get("generated_token_ids") or [])[: 1 + earlier]
        meta["prompt"] = r.get("prompt")
        meta["context"] = "".join(run.text(t) for t in generated) if generated else None
    bundle = Bundle(step=keep, final_row_start=c, final_row_base=base, final_row_tail=tail, token_texts=texts,
                    svg=views.step_svg(s, run.token_texts), metadata=meta)
    vocab = run.vocab_size
    try:
        full_out, _ = replay_differences(s, vocab)
    except ValueError:
        full_out = None  # the full step itself cannot be re-walked; the bundle keeps its whole prefix
    if full_out is not None:
        got = replay_bundle(bundle).output
        diffs = compare_outputs(full_out, got)
        if diffs:
            raise AssertionError(f"step {step}, request {request}: the reduced bundle replays differently: {diffs[0]}")
    return bundle


def _readme(b: Bundle) -> str:
    s = b.step
    p = s.params
    params = "greedy" if p.is_greedy else (f"temperature {p.temperature}, top_k {p.top_k}, top_p {p.top_p}"
                                           + (f", min_p {p.min_p}" if p.min_p else ""))
    rows = [f"| {k} | {d.parent} | {d.node} | {d.token} `{b.token_texts.get(d.token, '?')!r}` | {d.target_prob:.6g} | "
            f"{mass_label(d.cumulative_mass, 6)} | {'-' if d.coin is None else f'{d.coin:.6g}'} | {d.verdict} |"
            for k, d in enumerate(s.decisions)]
    bonus = s.bonus
    target = (b.metadata.get("target") or {}).get("name", "unknown target")
    prompt, context = b.metadata.get("prompt"), b.metadata.get("context")
    context = ("" if prompt is None and context is None else
               "\n## Request\n\n" + (f"Prompt: {json.dumps(prompt, ensure_ascii=False)}\n\n" if prompt is not None else "")
               + (f"Generated before this step: {json.dumps(context, ensure_ascii=False)}\n" if context else ""))
    exact = ("probabilities within the Triton kernel's tolerance, everything else bit for bit"
             if s.backend.startswith("triton") else "bit for bit")
    return f"""# ddtree-lab bundle: step {s.step}, request {s.request} (`{s.request_id}`)

One DDTree verify step, reduced to what replays it exactly. Target: {target}; backend that
ran: `{s.backend}`; sampling: {params}; {s.num_nodes} tree nodes; accepted {s.accept_length}
draft token(s); bonus token {s.bonus_token} `{b.token_texts.get(s.bonus_token, '?')!r}`
({bonus.kind if bonus else '-'} draw, coin {s.final_coin}).
{context}
## Replay

From inside this directory:

    ddtree-lab replay .
    ddtree-lab render . -o tree.txt

or in Python:

    import ddtree_lab as dl
    run = dl.load(".")
    print(dl.replay_differences(run.steps[0], run.vocab_size)[1])  # [] when it reproduces

Replay runs the lab's reference verifier on the stored tree, buffers, coins and target
rows and compares every decision, the bonus draw and the output with the recorded ones
({exact}); any difference is listed field by field.

## Files

- `bundle.safetensors`: tree, buffers, draft top-k, parameters, coins, recorded output and
  decision log; target rows reduced to each node's token probability in its parent's row
  (`child_probs`, all the walk reads) and the bonus row's float64 running sum up to token
  {b.final_row_start} plus its tokens {b.final_row_start}..{s.bonus_token} (all the final draw
  reads). Every tensor and the JSON document carry a SHA-256 checksum.
- `tree.svg`: the step's tree (accepted path, rejected siblings, bonus).

## Decisions

| # | parent | node | token | target p | S_k | coin | verdict |
|---|---|---|---|---|---|---|---|
""" + "\n".join(rows) + "\n"


def save_bundle(bundle: Bundle, directory: str | Path) -> Path:
    """Write the bundle into ``directory`` (created if missing; its parent must exist; an
    existing directory must be empty or hold a previous bundle). Returns the directory.

    Raises:
        FileNotFoundError: the parent directory does not exist.
        FileExistsError: ``directory`` holds files that are not a bundle's.
    """
    directory = Path(directory)
    if not directory.parent.is_dir():
        raise FileNotFoundError(f"{directory}: directory {directory.parent} does not exist (nothing is created for you)")
    if directory.exists():
        if not directory.is_dir():
            raise FileExistsError(f"{directory}: exists and is not a directory")
        other = [p.name for p in directory.iterdir() if p.name not in FILES]
        if other:
            raise FileExistsError(f"{directory}: holds files that are not a bundle's ({', '.join(sorted(other)[:3])})")
    else:
        directory.mkdir()
    s = bundle.step
    tensors = step_tensors(s, "0.")
    tensors["0.final_row_tail"] = bundle.final_row_tail.detach().to("cpu", torch.float32).contiguous()
    doc = {"format": FORMAT, "version": VERSION, "metadata": bundle.metadata,
           "token_texts": {str(k): v for k, v in bundle.token_texts.items()},
           "steps": [step_json(s)],
           "final_row": {"start": int(bundle.final_row_start), "base": float(bundle.final_row_base)}}
    write_container(directory / "bundle.safetensors", doc, tensors)
    (directory / "tree.svg").write_text(bundle.svg, encoding="utf-8")
    (directory / "README.md").write_text(_readme(bundle), encoding="utf-8")
    return directory


def replay_bundle(bundle: Bundle | str | Path, backend: str = "reference") -> BundleReplay:
    """Re-verify a bundle's step with the reference verifier and compare it with the recorded
    output, decision by decision (:func:`ddtree_lab.replaying.compare_outputs`).

    A bundle stores target probabilities (what the verifier read), not logits, so only the
    ``"reference"`` backend replays it.

    Raises:
        ValueError: another ``backend``.
        TraceFormatError / FileNotFoundError: (a path) see :func:`load_bundle`.
        ddtree_lab.ReplayMismatch: the stored buffers are broken.
    """
    if backend != "reference":
        raise ValueError(f"a bundle stores target probabilities, not logits: it replays with the reference "
                         f"verifier only, not {backend!r}")
    if not isinstance(bundle, Bundle):
        bundle = load_bundle(bundle)
    out, diffs = replay_differences(bundle_step(bundle), bundle.vocab_size)
    return BundleReplay(out, diffs)


