"""The recording file: SGLang verify calls kept by :class:`~ddtree_lab.sglang.recorder.SGLangRecorder`,
and lab objects read back from one recorded row.

**A recorded step** is a plain dict for one verify call: ``kind`` (``greedy``,
``target_only`` or ``chain``), ``call`` (the call index in the process), ``rank``, ``kernel``,
``rows`` (the batch rows kept), ``request_ids``, ``draft_token_num`` (N),
``num_speculative_tokens`` (S), ``time``, for sampled kinds ``threshold_single`` /
``threshold_acc`` / ``block_verification``, optionally ``sampling`` (per kept row:
``temperature``, ``top_k``, ``top_p``), and ``tensors``, each ``[rows, ...]``:

* ``candidates``, ``retrive_index`` (request-local: ``i``, or -1), ``retrive_next_token``,
  ``retrive_next_sibling`` ``[r, N]`` int64; ``seq_lens [r]`` int64 when known;
* greedy: ``target_predict [r, N]`` int64 (the target argmax of every row);
* sampled: ``uniform_samples [r, N]`` and ``uniform_samples_final [r]`` float32 (the coins),
  ``target_prob_rows [r, M, V]`` float32 with ``target_prob_nodes [r, M]`` int64 (the node of
  each stored row, -1 padded; ``M = S`` for the accepted path, ``N`` for every row), chain:
  ``draft_probs [r, N, V]`` float32;
* outputs: ``predicts [r, N]``, ``accept_index [r, S]`` (request-local nodes, -1 padded),
  ``accept_token_num [r]``, int64.

**File**: ``NAME.json`` (``format``, ``version``, run ``metadata``, per-step scalars with their
tensor names, and a ``checksums`` entry per tensor) + ``NAME.safetensors`` (tensors
named ``"{step}/{name}"``); each tensor's checksum entry holds its SHA-256, dtype and shape.
Loading reads JSON and safetensors only (no code from the file runs)
and refuses a file whose tensors do not match their checksums.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ..buffers import DDTreeVerifyInput, find_retrieve_problems
from ..store.container import TraceFormatError
from ..store.segments import read_segment, scan
from ..verify import VerifyOutput
from .buffers import verify_input_from_retrieve, verify_output_from_sglang

__all__ = [
    "FORMAT",
    "VERSION",
    "KINDS",
    "Recording",
    "RecordingFormatError",
    "save_recording",
    "load_recording",
    "recording_paths",
    "tensor_checksum",
    "step_verify_input",
    "step_sglang_output",
    "step_target_probs",
    "is_one_hot_chain",
    "step_parts",
    "recording_problems",
]

FORMAT = "ddtree-lab/sglang-recording"
#: The append-only layout (:mod:`ddtree_lab.sglang.append` writes it; :func:`load_append_recording` reads it).
APPEND_FORMAT = "ddtree-lab/sglang-recording-segments"
APPEND_VERSION = 1
VERSION = 2  # 2: per-tensor checksums
KINDS = ("greedy", "target_only", "chain")


class RecordingFormatError(ValueError):
    """A file that is not a recording, a newer version, or a missing, corrupted or badly typed part."""


@dataclass
class Recording:
    """Recorded SGLang verify steps (plain dicts, module docstring) plus run metadata."""

    metadata: dict
    steps: list[dict] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def num_rows(self) -> int:
        """Recorded rows over all steps (one per request per call)."""
        return sum(len(s["rows"]) for s in self.steps)


def tensor_checksum(t: torch.Tensor) -> dict:
    """What a recording stores to check a tensor: ``{"sha256", "dtype", "shape"}`` (the SHA-256 of
    its bytes is :func:`ddtree_lab.store.checksums.tensor_sha256`, shared with trace files)."""
    from ..store.checksums import tensor_sha256

    return {"sha256": tensor_sha256(t), "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def recording_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """``(NAME.json, NAME.safetensors)`` for ``NAME``, ``NAME.json`` or ``NAME.safetensors``."""
    p = Path(path)
    if p.suffix in (".json", ".safetensors"):
        p = p.with_suffix("")
    return p.with_name(p.name + ".json"), p.with_name(p.name + ".safetensors")


def save_recording(steps: Sequence[dict], path: str | os.PathLike, metadata: dict | None = None) -> tuple[Path, Path]:
    """Write steps as ``path.json`` + ``path.safetensors`` (module docstring); returns both paths.

    Written to temporary names first, then renamed, so a reader never sees half a file.

    Raises:
        FileNotFoundError: the directory does not exist (it is never created).
    """
    from safetensors.torch import save_file

    json_path, st_path = recording_paths(path)
    if not json_path.parent.is_dir():
        raise FileNotFoundError(f"{json_path.parent}: no such directory (save_recording does not create it)")
    tensors, entries, checksums = {}, [], {}
    for i, step in enumerate(steps):
        entry = {k: v for k, v in step.items() if k != "tensors"}
        entry["tensors"] = sorted(step["tensors"])
        for name, value in step["tensors"].items():
            key = f"{i}/{name}"
            tensors[key] = value.detach().to("cpu").contiguous()
            checksums[key] = tensor_checksum(tensors[key])
        entries.append(entry)
    doc = {"format": FORMAT, "version": VERSION, "metadata": metadata or {}, "steps": entries,
           "checksums": checksums}
    tmp_json, tmp_st = json_path.with_suffix(".json.tmp"), st_path.with_suffix(".safetensors.tmp")
    save_file(tensors, str(tmp_st))
    tmp_json.write_text(json.dumps(doc, indent=1, sort_keys=True))
    os.replace(tmp_st, st_path)
    os.replace(tmp_json, json_path)
    return json_path, st_path


def load_recording(path: str | os.PathLike) -> Recording:
    """Read a recording written by :func:`save_recording` (no code from the file runs).

    Raises:
        FileNotFoundError: a part is missing.
        RecordingFormatError: not this format, another version, unreadable JSON or
            safetensors, a missing tensor, or a tensor that does not match its checksum (the
            message names the file, step and tensor).
    """
    from safetensors import safe_open

    from ..store.segments import is_segment_file

    if not Path(path).exists() and is_segment_file(str(path) + ".ddrec"):  # NAME for NAME.ddrec
        path = str(path) + ".ddrec"
    if is_segment_file(os.fspath(path)):  # the append-only file (calls that did not return: metadata["did_not_return"])
        return load_append_recording(os.fspath(path))[0]
    json_path, st_path = recording_paths(path)
    for p in (json_path, st_path):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such file (a recording is NAME.json + NAME.safetensors)")
    try:
        doc = json.loads(json_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordingFormatError(f"{json_path}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise RecordingFormatError(f"{json_path}: not a {FORMAT} file (format {got!r})")
    if doc.get("version") != VERSION:
        raise RecordingFormatError(f"{json_path}: recording version {doc.get('version')!r}; this ddtree-lab reads "
                                   f"version {VERSION} (re-record with this version)")
    if not isinstance(doc.get("steps"), list) or not isinstance(doc.get("checksums"), dict):
        raise RecordingFormatError(f"{json_path}: 'steps' must be a list and 'checksums' an object")
    try:
        with safe_open(str(st_path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types
        raise RecordingFormatError(f"{st_path}: not a readable safetensors file ({exc})") from exc
    checksums = doc["checksums"]
    steps = []
    for i, entry in enumerate(doc["steps"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("tensors"), list):
            raise RecordingFormatError(f"{json_path}: step {i}: not an object with a 'tensors' list")
        step = {k: v for k, v in entry.items() if k != "tensors"}
        step["tensors"] = {}
        for name in entry["tensors"]:
            key = f"{i}/{name}"
            if key not in tensors:
                raise RecordingFormatError(f"{st_path}: step {i}: tensor {name!r} is missing")
            if checksums.get(key) != tensor_checksum(tensors[key]):
                raise RecordingFormatError(f"{st_path}: step {i}: tensor {name!r} does not match its checksum "
                                           "(the file is corrupted or was edited)")
            step["tensors"][name] = tensors[key]
        steps.append(step)
    return Recording(doc.get("metadata", {}), steps)


# ---- one recorded row as lab objects ------------------------------------------------------------


def step_verify_input(step: dict, row: int) -> DDTreeVerifyInput:
    """The lab verify input of recorded row ``row`` of ``step`` (a batch of one; mask and
    positions rebuilt from the links and ``seq_lens``, which the kernels do not see)."""
    t = step["tensors"]
    seq = t["seq_lens"][row : row + 1] if "seq_lens" in t else 0
    return verify_input_from_retrieve(t["candidates"][row : row + 1], t["retrive_next_token"][row : row + 1],
                                      t["retrive_next_sibling"][row : row + 1], t["retrive_index"][row : row + 1], seq)


def step_sglang_output(step: dict, row: int, vi: DDTreeVerifyInput | None = None) -> VerifyOutput:
    """SGLang's output for recorded row ``row`` as a lab :class:`VerifyOutput` (no decision log)."""
    vi = step_verify_input(step, row) if vi is None else vi
    t = step["tensors"]
    return verify_output_from_sglang(vi, t["predicts"][row], t["accept_index"][row : row + 1],
                                     t["accept_token_num"][row : row + 1], backend=f"sglang-{step['kind']}")


def step_target_probs(step: dict, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs [1, N, V] float32, recorded [N] bool)`` of a sampled row: the target rows the
    recorder kept (``recorded``); the other rows are zero and must not be read."""
    t = step["tensors"]
    n = int(step["draft_token_num"])
    rows, nodes = t["target_prob_rows"][row], t["target_prob_nodes"][row]
    probs = torch.zeros(1, n, rows.shape[-1], dtype=torch.float32)
    recorded = torch.zeros(n, dtype=torch.bool)
    valid = nodes >= 0
    probs[0, nodes[valid]] = rows[valid].float()
    recorded[nodes[valid]] = True
    return probs, recorded


def is_one_hot_chain(step: dict, row: int) -> bool:
    """Whether a chain row's ``draft_probs`` are one-hot at the next node's token (then
    SGLang's rejection sampler is the target-only rule the lab implements)."""
    q = step["tensors"]["draft_probs"][row]
    cand = step["tensors"]["candidates"][row]
    want = torch.zeros_like(q[:-1])
    want.scatter_(-1, cand[1:, None].clamp(min=0), 1.0)
    return bool(torch.equal(q[:-1], want))


def step_parts(step: dict, row: int) -> dict:
    """Everything a lab step needs from recorded row ``row`` of ``step``, as lab objects.

    Keys: ``request_id``, ``kind``, ``kernel``, ``rank``, ``call``, ``verify_input``
    (:class:`DDTreeVerifyInput`, batch of one), ``target_probs`` (``[1, N, V]``, rows the
    kernel did not read are zero; None for greedy), ``recorded_rows`` (``[N]`` bool; None for
    greedy), ``target_predict`` (``[1, N]``, greedy only), ``coins`` / ``final_coins`` (None
    for greedy), ``draft_probs`` (chain only), ``thresholds``, ``sampling`` (this row's
    values when recorded), ``sglang_output`` (:class:`VerifyOutput`).
    """
    vi = step_verify_input(step, row)
    t = step["tensors"]
    sampled = step["kind"] != "greedy"
    probs, recorded = step_target_probs(step, row) if sampled else (None, None)
    return {
        "request_id": step["request_ids"][row],
        "kind": step["kind"],
        "kernel": step["kernel"],
        "rank": step["rank"],
        "call": step["call"],
        "verify_input": vi,
        "target_probs": probs,
        "recorded_rows": recorded,
        "target_predict": None if sampled else t["target_predict"][row : row + 1],
        "coins": t["uniform_samples"][row : row + 1].float() if sampled else None,
        "final_coins": t["uniform_samples_final"][row : row + 1].float() if sampled else None,
        "draft_probs": t["draft_probs"][row : row + 1] if "draft_probs" in t else None,
        "thresholds": (step.get("threshold_single", 1.0), step.get("threshold_acc", 1.0)),
        "sampling": {k: v[row] for k, v in step.get("sampling", {}).items()},
        "sglang_output": step_sglang_output(step, row, vi),
    }


def recording_problems(recording: Recording) -> list[str]:
    """Every broken recorded row (the doctor's check of a recording), one line each:
    ``"step k (call c), row r (request id): ..."``.

    Checked per row: the links form a tree (:func:`ddtree_lab.buffers.find_retrieve_problems`:
    every broken link, ``retrive_index`` included; SGLang's sibling walks have no hop bound, so
    a cyclic chain named here hangs its kernel); sampled rows' coins lie in [0, 1); SGLang's
    outputs are consistent with the buffers
    (:func:`~ddtree_lab.sglang.buffers.verify_output_from_sglang`). A row with broken links gets
    those lines only.
    """
    problems = []
    for k, step in enumerate(recording.steps):
        t = step["tensors"]
        for row, rid in enumerate(step["request_ids"]):
            where = f"step {k} (call {step.get('call', k)}), row {row} ({rid})"
            one = slice(row, row + 1)
            ri = t["retrive_index"][one]
            links = find_retrieve_problems(t["retrive_next_token"][one], t["retrive_next_sibling"][one],
                                           (ri >= 0).sum(1), retrieve_index=ri)
            if links:
                problems.extend(f"{where}: node {link.node}: {link.message}" for link in links)
                continue
            if step["kind"] != "greedy":
                coins = t["uniform_samples"][row]
                for i in (~((coins >= 0) & (coins < 1))).nonzero().flatten().tolist():
                    problems.append(f"{where}: node {i}: coin {float(coins[i])} is not in [0, 1)")
                final = float(t["uniform_samples_final"][row])
                if not 0.0 <= final < 1.0:
                    problems.append(f"{where}: final coin {final} is not in [0, 1)")
            try:
                step_sglang_output(step, row)
            except ValueError as exc:
                problems.append(f"{where}: SGLang's output: {str(exc).removeprefix('request 0: ')}")
    return problems


def load_append_recording(path: str | Path) -> tuple[Recording, list[dict], list[str]]:
    """``(recording of completed calls, calls that did not return, problems)`` of an append-only
    file. A cut tail is one line in ``problems``; every complete segment before it loads. The
    recording's ``metadata["did_not_return"]`` lists the calls that did not return.

    Raises:
        FileNotFoundError: no such file.
        RecordingFormatError: not this format, or a damaged segment before the tail (naming it).
    """
    path = Path(path)
    try:
        entries, tail = scan(path)
    except TraceFormatError as exc:
        raise RecordingFormatError(str(exc)) from exc
    problems = [] if tail.why is None else [tail.why]
    meta, calls, order = None, {}, []
    with open(path, "rb") as f:
        for e in entries:
            try:
                kind, doc, tensors = read_segment(path, e, f)
            except TraceFormatError as exc:
                raise RecordingFormatError(str(exc)) from exc
            if kind == "run":
                if doc.get("format") != APPEND_FORMAT or doc.get("version") != APPEND_VERSION:
                    raise RecordingFormatError(f"{path}: format {doc.get('format')!r} version {doc.get('version')!r} "
                                               f"is not {APPEND_FORMAT!r} version {APPEND_VERSION}")
                meta = doc.get("metadata") or {}
            elif kind == "inputs":
                step = dict(doc)
                step["tensors"] = dict(tensors)
                calls[doc["call"]] = step
                order.append(doc["call"])
            elif kind == "outputs":
                step = calls.get(doc["call"])
                if step is None:
                    problems.append(f"{path}: outputs of call {doc['call']} without its inputs (left out)")
                    continue
                step["num_speculative_tokens"] = int(doc["num_speculative_tokens"])
                step["tensors"].update(tensors)
                step["returned"] = True
    if meta is None:
        raise RecordingFormatError(f"{path}: no complete run segment at the start"
                                   + (f" ({tail.why})" if tail.why else ""))
    done = [calls[c] for c in order if calls[c].pop("returned", False)]
    pending = [calls[c] for c in order if calls[c] not in done]
    meta = dict(meta)
    meta["did_not_return"] = [s["call"] for s in pending]
    return Recording(meta, done), pending, problems
