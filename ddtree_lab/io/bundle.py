"""Bug-report bundles, the one module of their format: make, write, read and replay a minimal,
self-contained repro of ONE verify step.

A bundle directory holds

* ``bundle.safetensors``: the step (tree, buffers, draft top-k, parameters, coins, recorded
  output and decision log, timings) in the trace container (every tensor and the JSON
  document checksummed, :func:`ddtree_lab.store.container.read_container`), the token texts of the
  tokens involved, and where it came from;
* ``tree.svg``: the step's diagram (:data:`draw_step`: :func:`ddtree_lab.views.step_svg`);
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
where it cannot, it keeps the whole prefix. :func:`load_bundle` reads a bundle back and
:func:`bundle_run` opens it as a one-step Run (:func:`ddtree_lab.io.load`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..replaying import Difference, compare_outputs, replay_differences
from ..step import Run, Step, TargetRows
from ..store.container import container_format, read_container, write_container
from ..verify import VerifyOutput
from .lab_trace import BUNDLE_FORMAT, TraceFormatError, check_step_tensors, step_from_json, step_json, step_tensors
from ..labels import mass_label, token_label
from ..texts import join_texts

__all__ = ["Bundle", "BundleReplay", "make_bundle", "save_bundle", "load_bundle", "replay_bundle", "bundle_step",
           "bundle_run", "looks_like_bundle", "load_bundle_run", "FORMAT", "VERSION", "CHUNK", "FILES", "reduce_bonus_row", "children_tokens",
           "residual_cumsum", "dense_prefix", "float32_pieces"]


FORMAT = BUNDLE_FORMAT


VERSION = 1


CHUNK = 64  # tokens of the bonus row kept verbatim (at most)


FILES = ("bundle.safetensors", "tree.svg", "README.md")


#: How :func:`make_bundle` draws the step for ``tree.svg``: ``draw_step(step, token_texts) -> svg``.
#: The views sit above io, so this module does not import them: the package's front door
#: (``ddtree_lab/__init__.py``, run before any submodule) sets it to :func:`ddtree_lab.views.step_svg`.
draw_step: Callable[[Step, dict[int, str]], str] | None = None


def _draw(step: Step, texts: dict[int, str]) -> str:
    if draw_step is None:
        raise RuntimeError("ddtree_lab.io.bundle.draw_step is not set (the package's __init__ sets it)")
    return draw_step(step, texts)


@dataclass
class Bundle:
    """One verify step, reduced to what replays it exactly (module docstring).

    Attributes:
        step: the :class:`Step` (level ``"light"``; ``final_row_prefix`` is None, the
            bonus row is the three fields below).
        final_row_start: ``c``, the first token of the stored tail.
        final_row_base: float64, the residual's running sum over tokens ``[0, c)``.
        final_row_tail: ``[t + 1 - c]`` float32, the bonus row at tokens ``c .. t``.
        token_texts: texts of the tokens the step mentions.
        svg: the step's diagram.
        metadata: source trace, target / tokenizer / drafter names, ``vocab_size``.
    """

    step: Step
    final_row_start: int
    final_row_base: float
    final_row_tail: torch.Tensor
    token_texts: dict[int, str] = field(default_factory=dict)
    svg: str = ""
    metadata: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int | None:
        v = self.metadata.get("vocab_size")
        return None if v is None else int(v)

    def rejected_tokens(self) -> list[int]:
        """Tokens of the children of the bonus node (all rejected: the walk ended there)."""
        return children_tokens(self.step, _bonus_node(self.step))

    def final_row_prefix(self) -> torch.Tensor:
        """``[t + 1]`` float32: a bonus row prefix the reference draw reads exactly as the
        original (module docstring); empty when the support was exhausted."""
        tail, c = self.final_row_tail, self.final_row_start
        if self.step.bonus_token < 0:
            return torch.zeros(0)
        return dense_prefix(c, self.final_row_base, tail, self.rejected_tokens())


def _bonus_node(step: Step) -> int:
    bonus = step.bonus
    if bonus is None:
        raise ValueError(f"step {step.step}, request {step.request}: no recorded output (no bonus draw)")
    return bonus.node


def children_tokens(step: Step, node: int) -> list[int]:
    next_token, next_sibling, node_tokens = step.retrieve_next_token, step.retrieve_next_sibling, step.node_token_ids
    if next_token is None or next_sibling is None or node_tokens is None:
        raise ValueError(f"step {step.step}, request {step.request}: no tree or verify buffers stored")
    nt, ns, tokens = next_token.tolist(), next_sibling.tolist(), node_tokens.tolist()
    out, child, hops = [], nt[node], 0
    while child != -1 and hops <= len(tokens):
        out.append(tokens[child])
        child, hops = ns[child], hops + 1
    return out


def float32_pieces(base: float) -> list[np.float32]:
    """float32 values whose sequential float64 sum is exactly ``base`` (each the float32
    truncation toward zero of what is left), or [] for 0."""
    out, rest = [], float(base)
    while rest != 0.0 and len(out) < 6:
        p = np.float32(rest)
        if float(p) > rest:
            p = np.nextafter(p, np.float32(0))
        out.append(p)
        rest = rest - float(p)  # exact: p is a leading-digit truncation of rest
    return out


def dense_prefix(start: int, base: float, tail: torch.Tensor, rejected: list[int]) -> torch.Tensor:
    prefix = torch.zeros(start + tail.shape[0], dtype=torch.float32)
    prefix[start:] = tail
    pieces = float32_pieces(base)
    banned = set(rejected)
    free = [j for j in range(start) if j not in banned][: len(pieces)]
    if len(free) < len(pieces):
        raise TraceFormatError(f"bundle: no room below token {start} for the running sum {base!r}")
    for j, p in zip(free, pieces):
        prefix[j] = float(p)
    return prefix


def residual_cumsum(prefix: torch.Tensor, rejected: list[int]) -> torch.Tensor:
    residual = prefix.double().clone()  # as ddtree_lab.verify.residual_draw does
    idx = [t for t in rejected if t < residual.shape[0]]
    if idx:
        residual[torch.tensor(idx, dtype=torch.int64)] = 0.0
    return residual.cumsum(0)


def reduce_bonus_row(step: Step) -> tuple[int, float, torch.Tensor]:
    """``(c, base, tail)`` for the step's bonus row (module docstring)."""
    prefix = step.final_row_prefix
    if prefix is None:
        raise ValueError(f"step {step.step}, request {step.request}: no bonus row (final_row_prefix) stored")
    t = prefix.shape[0] - 1
    if t < 0:
        return 0, 0.0, torch.zeros(0)
    rejected = children_tokens(step, _bonus_node(step))
    cum = residual_cumsum(prefix, rejected)
    c = (t // CHUNK) * CHUNK
    if c > 0:
        base = float(cum[c - 1])
        tail = prefix[c:].clone()
        try:
            dense = dense_prefix(c, base, tail, rejected)
        except TraceFormatError:
            dense = None
        if dense is not None and torch.equal(residual_cumsum(dense, rejected)[c - 1:], cum[c - 1:]):
            return c, base, tail
    return 0, 0.0, prefix.clone()


def load_bundle(directory: str | Path) -> Bundle:
    """Read a bundle written by :func:`save_bundle` (checksums, shapes and ranges checked).

    Raises:
        FileNotFoundError: no bundle there.
        TraceFormatError: a corrupted or inconsistent bundle (one line naming file and field).
    """
    directory = Path(directory)
    path = directory / "bundle.safetensors" if directory.is_dir() else directory
    doc, tensors = read_container(path, FORMAT, (VERSION,), what="bundle")
    try:
        js = doc["steps"][0]
        row = doc["final_row"]
        start, base = int(row["start"]), float(row["base"])
        t = {k.partition(".")[2]: v for k, v in tensors.items()}
        tail = t.pop("final_row_tail")
        meta = doc.get("metadata") or {}
        vocab = meta.get("vocab_size")
        check_step_tensors(f"{path}: step 0", js, t, int(vocab) if isinstance(vocab, int) else None, 2,
                           exempt=("final_row_prefix",))
        step = step_from_json(js, t, f"{path}: step 0")
        if step.rows is None:
            raise TraceFormatError(f"{path}: step 0: no verify rows stored (a bundle keeps them)")
        step.rows.kind = "bundle"
        step.source = "bundle"
        texts = {int(k): str(v) for k, v in (doc.get("token_texts") or {}).items()}
    except TraceFormatError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise TraceFormatError(f"{path}: bad field ({exc!r})") from exc
    bonus = int(js["bonus_token"])
    if tail.dim() != 1 or (bonus >= 0 and start + tail.shape[0] != bonus + 1) or start < 0 or not math.isfinite(base):
        raise TraceFormatError(f"{path}: field 'final_row_tail': tokens {start}..{start + tail.shape[0] - 1} do not "
                               f"end at the bonus token {bonus}")
    svg_path = directory / "tree.svg" if directory.is_dir() else path.with_name("tree.svg")
    svg = svg_path.read_text(encoding="utf-8") if svg_path.is_file() else ""
    return Bundle(step=step, final_row_start=start, final_row_base=base, final_row_tail=tail, token_texts=texts,
                  svg=svg, metadata=meta)


def bundle_step(bundle: Bundle) -> Step:
    """The bundle's step with its bonus row rebuilt from the reduction (rows kind ``"bundle"``):
    what :func:`ddtree_lab.replay` and the views read."""
    if bundle.step.rows is None:
        raise ValueError(f"bundle of step {bundle.step.step}, request {bundle.step.request}: no verify rows stored")
    rows = dataclasses.replace(bundle.step.rows, final_row_prefix=bundle.final_row_prefix())
    return dataclasses.replace(bundle.step, rows=rows, source="bundle")


def bundle_run(bundle: Bundle) -> Run:
    """A bundle as a :class:`~ddtree_lab.step.Run` of its one step (:func:`ddtree_lab.io.load`)."""
    meta = {**bundle.metadata, "bundle_source": bundle.metadata.get("source"), "source": "bundle"}
    return Run(metadata=meta, steps=[bundle_step(bundle)], token_texts=dict(bundle.token_texts))


def looks_like_bundle(path: str | Path) -> bool:
    """Whether ``path`` is a bundle: a directory holding ``bundle.safetensors``, or a file whose
    ``"ddtree_lab"`` document has the bundle :data:`FORMAT` (reads the header only). Source
    ``"bundle"`` of :func:`ddtree_lab.io.load`."""
    path = Path(path)
    if path.is_dir():
        return (path / "bundle.safetensors").is_file()
    return container_format(path) == FORMAT


def load_bundle_run(path: str | Path) -> Run:
    """:func:`bundle_run` of the bundle at ``path`` (its directory or its ``bundle.safetensors``).

    Raises:
        as :func:`load_bundle`.
    """
    path = Path(path)
    return bundle_run(load_bundle(path.parent if path.is_file() else path))


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
    if s.draft_token_ids is None:
        raise ValueError(f"step {step}, request {request}: no draft stored: nothing to bundle")
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
        meta["context"] = join_texts(run.text(t) for t in generated) if generated else None
    bundle = Bundle(step=keep, final_row_start=c, final_row_base=base, final_row_tail=tail, token_texts=texts,
                    svg=_draw(s, run.token_texts), metadata=meta)
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
    def tok(t: int) -> str:  # a Markdown table cell: the id, then the label in a code span (| escaped)
        if t < 0:
            return "none (support exhausted)"
        text = token_label(b.token_texts[t]) if t in b.token_texts else "(text not recorded)"
        return f"{t} `{text}`".replace("|", "\\|")

    s = b.step
    p = s.params
    params = "not recorded" if p is None else "greedy" if p.is_greedy else (f"temperature {p.temperature}, top_k {p.top_k}, top_p {p.top_p}"
                                           + (f", min_p {p.min_p}" if p.min_p else ""))
    rows = [f"| {k} | {d.parent} | {d.node} | {tok(d.token)} | {d.target_prob:.6g} | "
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
draft token(s); bonus token {tok(s.bonus_token)}
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
    created = not directory.exists()
    if created:
        directory.mkdir()
    try:
        _write_bundle_files(bundle, directory)
    except BaseException:  # an error or Ctrl-C: a directory made here is removed again (nothing was renamed in)
        if created and not any(directory.iterdir()):
            directory.rmdir()
        raise
    return directory


def _write_bundle_files(bundle: Bundle, directory: Path) -> None:
    """The bundle's files, each to a temporary name in ``directory`` first, all renamed at the
    end: an error or Ctrl-C on the way leaves no file half written (nor a partial set)."""
    import os

    s = bundle.step
    tensors = step_tensors(s, "0.")
    tensors["0.final_row_tail"] = bundle.final_row_tail.detach().to("cpu", torch.float32).contiguous()
    doc = {"format": FORMAT, "version": VERSION, "metadata": bundle.metadata,
           "token_texts": {str(k): v for k, v in bundle.token_texts.items()},
           "steps": [step_json(s)],
           "final_row": {"start": int(bundle.final_row_start), "base": float(bundle.final_row_base)}}
    tmp = {name: directory / f".{name}.{os.getpid()}.partial" for name in FILES}
    try:
        write_container(tmp["bundle.safetensors"], doc, tensors)
        tmp["tree.svg"].write_text(bundle.svg, encoding="utf-8")
        tmp["README.md"].write_text(_readme(bundle), encoding="utf-8")
        for name, t in tmp.items():
            os.replace(t, directory / name)
    finally:  # renamed away on success; removed after an error or Ctrl-C
        for t in tmp.values():
            t.unlink(missing_ok=True)


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
