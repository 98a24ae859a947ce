"""Read serving engines' acceptance summaries (vLLM, SGLang) from JSON/JSONL/Prometheus dumps.

What a user gets by saving an engine's response metadata or metrics, per request where the
engine reports it:

**vLLM, per request** (server flag ``--per-request-spec-decode-metrics summary|detailed``,
added by vllm-project/vllm PR #48915; documented on vLLM's "Per-Request Acceptance Metrics"
docs page). The OpenAI-style response carries ``metrics.speculative_decoding`` (``null`` when
the flag is off or ``n > 1``); the offline ``CompletionOutput`` carries the same dict as
``spec_decode_metrics``. Fields: ``mean_acceptance_length`` (``1 + accepted / steps``, bonus
included), ``draft_acceptance_rate`` (accepted / drafted), ``acceptance_histogram`` (length
``num_spec_tokens + 1``; index ``j`` = steps that accepted exactly ``j`` draft tokens),
``num_spec_steps``, ``num_accepted_draft_tokens``, ``num_draft_tokens``, ``num_spec_tokens``
(k); ``detailed`` adds ``per_step_accepted`` and ``per_step_drafted`` (one entry per verify
step, in order).

**vLLM, engine aggregate** (``vllm/v1/spec_decode/metrics.py``: ``SpecDecodingStats`` and the
Prometheus counters ``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens``,
``vllm:spec_decode_num_accepted_tokens``, ``vllm:spec_decode_num_accepted_tokens_per_pos``
(label ``position``); ``vllm/v1/metrics/reader.py`` returns them from ``LLM.get_metrics()`` as
``Counter(name, labels, value)`` and, for the per-position one, ``Vector(name, labels,
values)``). Read from a JSON list of those objects (``dataclasses.asdict`` of each) or from the
``/metrics`` text (names with ``_total``). Summed over all requests, so one record per label set.

**SGLang, per request** (``python/sglang/srt/managers/tokenizer_manager.py``,
``_calculate_spec_decoding_metrics``; histogram from sgl-project/sglang PR #18332): the
``meta_info`` of a ``/generate`` response (or of ``Engine.generate`` output, or of an OpenAI
response's choice) holds ``spec_verify_ct`` (verify steps), ``spec_accept_length``
(``completion_tokens / spec_verify_ct``: bonus included, and the prefill's first token too, so a
little above the mean τ), ``spec_accept_rate`` (accepted / (steps x (draft tokens - 1))),
accepted and proposed draft counts under ``spec_accept_token_num`` / ``spec_draft_token_num``
(older), ``spec_accepted_drafts`` / ``spec_proposed_drafts``, or ``spec_num_correct_drafts`` /
``spec_num_proposed_drafts`` (newer), and the histogram ``spec_accept_histogram`` or (newer)
``spec_correct_drafts_histogram`` (index = draft tokens accepted in a step; may be shorter than
the draft length).

Every record keeps only what its source holds: absent fields are None and named in ``missing``.
τ here always means accepted draft tokens + 1 (the bonus). Bad input raises
:class:`AcceptanceSummaryError` naming the request and the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..step import Run, Step
from .json_records import first_json_record, read_json_document

__all__ = ["SUMMARY_CANNOT", "AcceptanceSummaryError", "RequestAcceptance", "AcceptanceSummaries",
           "parse_vllm_request", "parse_sglang_request", "parse_vllm_metrics", "parse_prometheus_text",
           "read_acceptance_summaries", "looks_like_summary", "summary_run", "load_summary_run"]

_VLLM_PREFIX = "vllm:spec_decode_"
_SGLANG_ALIASES = {  # our field -> SGLang meta_info keys, oldest first
    "num_accepted_draft_tokens": ("spec_accept_token_num", "spec_accepted_drafts", "spec_num_correct_drafts"),
    "num_draft_tokens": ("spec_draft_token_num", "spec_proposed_drafts", "spec_num_proposed_drafts"),
    "accept_histogram": ("spec_accept_histogram", "spec_correct_drafts_histogram"),
}


class AcceptanceSummaryError(ValueError):
    """An acceptance summary that is not one or has a bad field.

    Attributes: ``request`` (index in the file, None for the file itself), ``field`` (the
    engine's key).
    """

    def __init__(self, message: str, request: int | None = None, field: str | None = None):
        where = [f"request {request}" if request is not None else None, f"field {field!r}" if field else None]
        where = [w for w in where if w]
        super().__init__(f"{', '.join(where)}: {message}" if where else message)
        self.request, self.field = request, field


@dataclass
class RequestAcceptance:
    """One request's (or, ``level == "engine aggregate"``, one engine's) acceptance counts.

    Attributes:
        engine: ``"vllm"`` or ``"sglang"``. level: ``"per request"`` or ``"engine aggregate"``.
        request: index in the file. request_id: the engine's id (None when absent).
        num_spec_tokens: k, draft tokens proposed per step (vLLM: ``num_spec_tokens``; SGLang:
            ``speculative_num_draft_tokens - 1``, derived as proposed / steps, which for a tree
            is its node count, not its depth; an engine aggregate: the per-position length).
        num_steps: verify steps. num_accepted_draft_tokens / num_draft_tokens: totals, bonus
            excluded.
        accept_histogram: index j = steps that accepted exactly j draft tokens.
        per_step_accepted / per_step_drafted: per verify step, in order (vLLM ``detailed``).
        accepted_per_position: steps whose draft token at position i (0-based) was accepted.
        reported_accept_length: the engine's own mean accept length; its definition in
            ``reported_accept_length_definition``. reported_acceptance_rate: the engine's rate.
        completion_tokens: output tokens of the request.
        source_fields: our name -> the engine's key it came from.
        missing: fields this source lacks.
    """

    engine: str
    level: str
    request: int
    request_id: str | None = None
    num_spec_tokens: int | None = None
    num_steps: int | None = None
    num_accepted_draft_tokens: int | None = None
    num_draft_tokens: int | None = None
    accept_histogram: list[int] | None = None
    per_step_accepted: list[int] | None = None
    per_step_drafted: list[int] | None = None
    accepted_per_position: list[int] | None = None
    reported_accept_length: float | None = None
    reported_accept_length_definition: str | None = None
    reported_acceptance_rate: float | None = None
    completion_tokens: int | None = None
    source_fields: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    def tau_mean(self) -> float | None:
        """Mean τ over verify steps, ``1 + accepted / steps`` (None without both counts or steps 0)."""
        if self.num_steps is None or self.num_accepted_draft_tokens is None or self.num_steps == 0:
            return None
        return 1 + self.num_accepted_draft_tokens / self.num_steps

    def tau_counts(self) -> dict[int, int] | None:
        """τ -> number of steps (from the per-step arrays or the histogram; None without either)."""
        if self.per_step_accepted is not None:
            out: dict[int, int] = {}
            for a in self.per_step_accepted:
                out[a + 1] = out.get(a + 1, 0) + 1
            return dict(sorted(out.items()))
        if self.accept_histogram is not None:
            return {j + 1: c for j, c in enumerate(self.accept_histogram) if c}
        return None

    def taus(self) -> list[int] | None:
        """τ of each verify step in order (only with ``per_step_accepted``; a histogram has no order)."""
        return None if self.per_step_accepted is None else [a + 1 for a in self.per_step_accepted]


@dataclass
class AcceptanceSummaries:
    """The records read from one file."""

    path: str
    engine: str
    requests: list[RequestAcceptance]
    metadata: dict = field(default_factory=dict)


def _count(v, req, name) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()) or v < 0:
        raise AcceptanceSummaryError(f"{v!r} is not a non-negative integer count", req, name)
    return int(v)


def _counts(v, req, name) -> list[int]:
    if not isinstance(v, list):
        raise AcceptanceSummaryError(f"expected a list of counts, got {type(v).__name__}", req, name)
    out = []
    for k, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise AcceptanceSummaryError(f"entry {k} is {x!r}, expected a non-negative int", req, name)
        out.append(x)
    return out


def _rate(v, req, name) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise AcceptanceSummaryError(f"{v!r} is not a finite non-negative number", req, name)
    return float(v)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def _check_consistent(rec: RequestAcceptance, names: dict[str, str]) -> None:
    """The identities between the counts (any one failing names the field that disagrees)."""
    req, h, steps, acc = rec.request, rec.accept_histogram, rec.num_steps, rec.num_accepted_draft_tokens
    if h is not None:
        if steps is not None and sum(h) != steps:
            raise AcceptanceSummaryError(f"sums to {sum(h)} steps but {names['num_steps']} is {steps}", req,
                                         names["accept_histogram"])
        if acc is not None and sum(j * c for j, c in enumerate(h)) != acc:
            raise AcceptanceSummaryError(f"counts {sum(j * c for j, c in enumerate(h))} accepted draft tokens but "
                                         f"{names['num_accepted_draft_tokens']} is {acc}", req, names["accept_histogram"])
        if rec.engine == "vllm" and rec.num_spec_tokens is not None and len(h) != rec.num_spec_tokens + 1:
            raise AcceptanceSummaryError(f"length {len(h)}, expected num_spec_tokens + 1 = {rec.num_spec_tokens + 1}",
                                         req, names["accept_histogram"])
    if acc is not None and rec.num_draft_tokens is not None and acc > rec.num_draft_tokens:
        raise AcceptanceSummaryError(f"{acc} accepted but only {rec.num_draft_tokens} drafted", req,
                                     names["num_accepted_draft_tokens"])
    if rec.per_step_accepted is not None:
        a = rec.per_step_accepted
        if steps is not None and len(a) != steps:
            raise AcceptanceSummaryError(f"{len(a)} entries for {steps} steps", req, "per_step_accepted")
        if acc is not None and sum(a) != acc:
            raise AcceptanceSummaryError(f"sums to {sum(a)}, num_accepted_draft_tokens is {acc}", req, "per_step_accepted")
        if h is not None and [a.count(j) for j in range(len(h))] != h:
            raise AcceptanceSummaryError("does not match acceptance_histogram", req, "per_step_accepted")
    if rec.per_step_drafted is not None:
        d = rec.per_step_drafted
        if rec.per_step_accepted is not None:
            if len(d) != len(rec.per_step_accepted):
                raise AcceptanceSummaryError(f"{len(d)} entries, per_step_accepted has {len(rec.per_step_accepted)}",
                                             req, "per_step_drafted")
            for k, (x, y) in enumerate(zip(rec.per_step_accepted, d)):
                if x > y:
                    raise AcceptanceSummaryError(f"step {k}: {x} accepted of {y} drafted", req, "per_step_accepted")
        if rec.num_draft_tokens is not None and sum(d) != rec.num_draft_tokens:
            raise AcceptanceSummaryError(f"sums to {sum(d)}, num_draft_tokens is {rec.num_draft_tokens}", req,
                                         "per_step_drafted")
    if rec.reported_acceptance_rate is not None and acc is not None and rec.num_draft_tokens:
        if not _close(rec.reported_acceptance_rate, acc / rec.num_draft_tokens):
            raise AcceptanceSummaryError(f"{rec.reported_acceptance_rate} but accepted / drafted = "
                                         f"{acc / rec.num_draft_tokens}", req, names["reported_acceptance_rate"])


def _missing(rec: RequestAcceptance, optional: tuple[str, ...]) -> list[str]:
    return [n for n in optional if getattr(rec, n) is None]


def parse_vllm_request(obj: dict, request: int = 0) -> RequestAcceptance:
    """One vLLM per-request record from a response (``metrics.speculative_decoding``), an offline
    output (``spec_decode_metrics``) or the bare dict.

    Raises:
        AcceptanceSummaryError: the dict is null or absent (the server flag was off, or ``n > 1``),
            a field has the wrong type, or the counts disagree (naming the field).
    """
    if not isinstance(obj, dict):
        raise AcceptanceSummaryError(f"expected a JSON object, got {type(obj).__name__}", request)
    rid = obj.get("id") if isinstance(obj.get("id"), str) else obj.get("request_id")
    where = "metrics.speculative_decoding"
    if "metrics" in obj:
        sd = obj["metrics"].get("speculative_decoding") if isinstance(obj["metrics"], dict) else None
    elif "spec_decode_metrics" in obj:
        sd, where = obj["spec_decode_metrics"], "spec_decode_metrics"
    else:
        sd, where = obj, "(top level)"
    if sd is None:
        raise AcceptanceSummaryError("null: start vLLM with --per-request-spec-decode-metrics summary|detailed "
                                     "(reported for n == 1 only)", request, where)
    if not isinstance(sd, dict) or "num_spec_steps" not in sd:
        raise AcceptanceSummaryError("no num_spec_steps: not vLLM's per-request spec-decode metrics", request, where)
    rec = RequestAcceptance("vllm", "per request", request, str(rid) if rid is not None else None)
    for ours, key in (("num_steps", "num_spec_steps"), ("num_accepted_draft_tokens", "num_accepted_draft_tokens"),
                      ("num_draft_tokens", "num_draft_tokens"), ("num_spec_tokens", "num_spec_tokens")):
        if sd.get(key) is not None:
            setattr(rec, ours, _count(sd[key], request, key))
            rec.source_fields[ours] = key
    for ours, key in (("accept_histogram", "acceptance_histogram"), ("per_step_accepted", "per_step_accepted"),
                      ("per_step_drafted", "per_step_drafted")):
        if sd.get(key) is not None:
            setattr(rec, ours, _counts(sd[key], request, key))
            rec.source_fields[ours] = key
    if sd.get("mean_acceptance_length") is not None:
        rec.reported_accept_length = _rate(sd["mean_acceptance_length"], request, "mean_acceptance_length")
        rec.reported_accept_length_definition = "1 + num_accepted_draft_tokens / num_spec_steps (bonus included)"
        if rec.num_steps and rec.num_accepted_draft_tokens is not None and not _close(
                rec.reported_accept_length, 1 + rec.num_accepted_draft_tokens / rec.num_steps):
            raise AcceptanceSummaryError(f"{rec.reported_accept_length} but 1 + accepted / steps = "
                                         f"{1 + rec.num_accepted_draft_tokens / rec.num_steps}", request,
                                         "mean_acceptance_length")
    if sd.get("draft_acceptance_rate") is not None:
        rec.reported_acceptance_rate = _rate(sd["draft_acceptance_rate"], request, "draft_acceptance_rate")
    usage = obj.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        rec.completion_tokens = _count(usage["completion_tokens"], request, "usage.completion_tokens")
    if rec.accept_histogram is not None:
        h = rec.accept_histogram
        rec.accepted_per_position = [sum(h[i + 1:]) for i in range(len(h) - 1)]
    _check_consistent(rec, {"num_steps": "num_spec_steps", "accept_histogram": "acceptance_histogram",
                            "num_accepted_draft_tokens": "num_accepted_draft_tokens",
                            "reported_acceptance_rate": "draft_acceptance_rate"})
    rec.missing = _missing(rec, ("request_id", "num_spec_tokens", "num_steps", "num_accepted_draft_tokens",
                                 "num_draft_tokens", "accept_histogram", "per_step_accepted", "per_step_drafted",
                                 "completion_tokens"))
    return rec


def _sglang_meta(obj: dict, request: int) -> dict:
    if isinstance(obj.get("meta_info"), dict):
        return obj["meta_info"]
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict) and isinstance(
            choices[0].get("meta_info"), dict):
        return choices[0]["meta_info"]
    if "spec_verify_ct" in obj:
        return obj
    raise AcceptanceSummaryError("no meta_info with spec_verify_ct (was the server started with a "
                                 "--speculative-algorithm?)", request, "meta_info")


def parse_sglang_request(obj: dict, request: int = 0) -> RequestAcceptance:
    """One SGLang per-request record from a ``/generate`` response, an ``Engine.generate``
    output, an OpenAI-style response whose choice carries ``meta_info``, or a bare ``meta_info``.

    Raises:
        AcceptanceSummaryError: no ``spec_verify_ct``, a field of the wrong type, two spellings of
            one field that disagree, or counts that disagree (naming the field).
    """
    if not isinstance(obj, dict):
        raise AcceptanceSummaryError(f"expected a JSON object, got {type(obj).__name__}", request)
    meta = _sglang_meta(obj, request)
    if "spec_verify_ct" not in meta:
        raise AcceptanceSummaryError("missing", request, "spec_verify_ct")
    rid = meta.get("id")
    rec = RequestAcceptance("sglang", "per request", request, str(rid) if rid is not None else None)
    rec.num_steps = _count(meta["spec_verify_ct"], request, "spec_verify_ct")
    rec.source_fields["num_steps"] = "spec_verify_ct"
    for ours, keys in _SGLANG_ALIASES.items():
        found = [(k, meta[k]) for k in keys if meta.get(k) is not None]
        if not found:
            continue
        parse = _counts if ours == "accept_histogram" else _count
        values = [(k, parse(v, request, k)) for k, v in found]
        for k, v in values[1:]:
            if v != values[0][1]:
                raise AcceptanceSummaryError(f"{v!r} disagrees with {values[0][0]} = {values[0][1]!r}", request, k)
        setattr(rec, ours, values[0][1])
        rec.source_fields[ours] = values[0][0]
    if rec.num_draft_tokens is not None and rec.num_steps and rec.num_draft_tokens % rec.num_steps == 0:
        # SGLang counts steps x (speculative_num_draft_tokens - 1) proposed: k per step
        rec.num_spec_tokens = rec.num_draft_tokens // rec.num_steps
        rec.source_fields["num_spec_tokens"] = f"{rec.source_fields['num_draft_tokens']} / spec_verify_ct"
    if meta.get("completion_tokens") is not None:
        rec.completion_tokens = _count(meta["completion_tokens"], request, "completion_tokens")
    if meta.get("spec_accept_length") is not None:
        rec.reported_accept_length = _rate(meta["spec_accept_length"], request, "spec_accept_length")
        rec.reported_accept_length_definition = ("completion_tokens / spec_verify_ct (bonus included, and the "
                                                 "prefill's first token: a little above the mean tau)")
        if rec.num_steps and rec.completion_tokens is not None and not _close(
                rec.reported_accept_length, rec.completion_tokens / rec.num_steps):
            raise AcceptanceSummaryError(f"{rec.reported_accept_length} but completion_tokens / spec_verify_ct = "
                                         f"{rec.completion_tokens / rec.num_steps}", request, "spec_accept_length")
    if meta.get("spec_accept_rate") is not None:
        rec.reported_acceptance_rate = _rate(meta["spec_accept_rate"], request, "spec_accept_rate")
    if rec.accept_histogram is not None:
        h = rec.accept_histogram
        rec.accepted_per_position = [sum(h[i + 1:]) for i in range(len(h) - 1)]
        if rec.num_accepted_draft_tokens is None:  # the histogram holds the total exactly
            rec.num_accepted_draft_tokens = sum(j * c for j, c in enumerate(h))
            rec.source_fields["num_accepted_draft_tokens"] = f"{rec.source_fields['accept_histogram']} (sum j*h[j])"
    _check_consistent(rec, {"num_steps": "spec_verify_ct",
                            "accept_histogram": rec.source_fields.get("accept_histogram", "spec_accept_histogram"),
                            "num_accepted_draft_tokens": rec.source_fields.get("num_accepted_draft_tokens",
                                                                               "spec_accept_token_num"),
                            "reported_acceptance_rate": "spec_accept_rate"})
    rec.missing = _missing(rec, ("request_id", "num_spec_tokens", "num_accepted_draft_tokens", "num_draft_tokens",
                                 "accept_histogram", "per_step_accepted", "per_step_drafted", "completion_tokens"))
    return rec


def _aggregate(groups: dict[str, dict], source: str) -> list[RequestAcceptance]:
    out = []
    for i, (labels, g) in enumerate(sorted(groups.items())):
        rec = RequestAcceptance("vllm", "engine aggregate", i, labels or None)
        for ours, name in (("num_steps", "num_drafts"), ("num_draft_tokens", "num_draft_tokens"),
                           ("num_accepted_draft_tokens", "num_accepted_tokens")):
            if name in g:
                setattr(rec, ours, _count(g[name], i, _VLLM_PREFIX + name))
                rec.source_fields[ours] = _VLLM_PREFIX + name
        if "per_pos" in g:
            pos = _counts(g["per_pos"], i, _VLLM_PREFIX + "num_accepted_tokens_per_pos")
            rec.accepted_per_position = pos
            rec.num_spec_tokens = len(pos)
            rec.source_fields["accepted_per_position"] = _VLLM_PREFIX + "num_accepted_tokens_per_pos"
            if rec.num_steps is not None:  # exactly j accepted = (accepted > j-1) - (accepted > j)
                chain = [rec.num_steps] + pos + [0]
                h = [chain[j] - chain[j + 1] for j in range(len(pos) + 1)]
                if any(c < 0 for c in h):
                    raise AcceptanceSummaryError(f"per-position counts {pos} are not non-increasing from "
                                                 f"{rec.num_steps} drafts", i, _VLLM_PREFIX + "num_accepted_tokens_per_pos")
                rec.accept_histogram = h
                rec.source_fields["accept_histogram"] = "derived from num_accepted_tokens_per_pos and num_drafts"
        _check_consistent(rec, {"num_steps": _VLLM_PREFIX + "num_drafts",
                                "accept_histogram": _VLLM_PREFIX + "num_accepted_tokens_per_pos",
                                "num_accepted_draft_tokens": _VLLM_PREFIX + "num_accepted_tokens",
                                "reported_acceptance_rate": "-"})
        rec.missing = ["per-request counts (an engine aggregate over every request)", "per_step_accepted",
                       "per_step_drafted", "completion_tokens"] + _missing(rec, ("num_steps", "num_accepted_draft_tokens",
                                                                              "num_draft_tokens", "accept_histogram"))
        rec.source_fields["container"] = source
        out.append(rec)
    return out


def _label_key(labels: dict) -> str:
    return ",".join(f"{k}={labels[k]}" for k in sorted(labels) if k != "position")


def parse_vllm_metrics(items: list) -> list[RequestAcceptance]:
    """Engine-aggregate records from a JSON dump of ``LLM.get_metrics()`` (objects with ``name``,
    ``labels`` and ``value`` or, for the per-position vector, ``values``); one per label set.

    Raises:
        AcceptanceSummaryError: no spec-decode metric, or a bad value (naming the metric).
    """
    groups: dict[str, dict] = {}
    for k, m in enumerate(items):
        if not isinstance(m, dict) or not isinstance(m.get("name"), str):
            raise AcceptanceSummaryError(f"metric {k} is not an object with a 'name'")
        name = m["name"]
        if not name.startswith(_VLLM_PREFIX):
            continue
        g = groups.setdefault(_label_key(m.get("labels") or {}), {})
        short = name[len(_VLLM_PREFIX):]
        if short == "num_accepted_tokens_per_pos":
            g["per_pos"] = m.get("values")
        elif short in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            g[short] = m.get("value")
    if not groups:
        raise AcceptanceSummaryError(f"no {_VLLM_PREFIX}* metric (was speculative decoding enabled?)")
    return _aggregate(groups, "LLM.get_metrics()")


_PROM_LINE = re.compile(r'^(vllm:spec_decode_\w+?)(?:_total)?(?:\{(.*)\})?\s+(\S+)')


def parse_prometheus_text(text: str) -> list[RequestAcceptance]:
    """Engine-aggregate records from vLLM's ``/metrics`` text (the four spec-decode counters).

    Raises:
        AcceptanceSummaryError: no spec-decode counter, or a sample that is not a number.
    """
    groups: dict[str, dict] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        m = _PROM_LINE.match(line.strip())
        if not m or line.startswith("#") or m.group(1).endswith("_created"):
            continue
        name, label_text, value = m.groups()
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', label_text or ""))
        try:
            v = float(value)
        except ValueError:
            raise AcceptanceSummaryError(f"line {lineno}: sample {value!r} is not a number", None, name) from None
        g = groups.setdefault(_label_key(labels), {})
        short = name[len(_VLLM_PREFIX):]
        if short == "num_accepted_tokens_per_pos":
            pos = int(labels.get("position", -1))
            if pos < 0:
                raise AcceptanceSummaryError(f"line {lineno}: no 'position' label", None, name)
            per = g.setdefault("_pos", {})
            per[pos] = v
        elif short in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            g[short] = v
    for g in groups.values():
        if "_pos" in g:
            per = g.pop("_pos")
            g["per_pos"] = [int(per.get(p, 0)) for p in range(max(per) + 1)]
    if not groups:
        raise AcceptanceSummaryError(f"no {_VLLM_PREFIX}* counter in the text")
    return _aggregate(groups, "/metrics text")


def _engine_of(obj) -> str | None:
    if not isinstance(obj, dict):
        return None
    if "metrics" in obj or "spec_decode_metrics" in obj or "num_spec_steps" in obj:
        return "vllm"
    if "meta_info" in obj or "spec_verify_ct" in obj or (isinstance(obj.get("choices"), list) and obj["choices"]
                                                          and isinstance(obj["choices"][0], dict)
                                                          and "meta_info" in obj["choices"][0]):
        return "sglang"
    return None


def read_acceptance_summaries(path: str | Path, engine: str | None = None) -> AcceptanceSummaries:
    """Read a dump of per-request acceptance summaries (layouts: module docstring).

    Args:
        path: ``.json`` (one response or a list; a list of vLLM metric objects for the engine
            aggregate), ``.jsonl`` (one response per line) or ``.prom`` / ``.txt`` (vLLM
            ``/metrics`` text).
        engine: ``"vllm"`` or ``"sglang"``; None detects it from the first record's keys.

    Raises:
        FileNotFoundError: no such file. ValueError: unknown ``engine``.
        AcceptanceSummaryError: not JSON, no record, mixed engines, or a bad field.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if engine not in (None, "vllm", "sglang"):
        raise ValueError(f"engine must be 'vllm', 'sglang' or None, got {engine!r}")
    if path.suffix.lower() in (".prom", ".txt"):
        return AcceptanceSummaries(str(path), "vllm", parse_prometheus_text(path.read_text()),
                                   {"level": "engine aggregate"})
    try:
        doc = read_json_document(path)
    except ValueError as e:
        raise AcceptanceSummaryError(str(e)) from None
    docs = doc if isinstance(doc, list) else [doc]
    if not docs:
        raise AcceptanceSummaryError(f"{path}: no records")
    if all(isinstance(d, dict) and isinstance(d.get("name"), str) and d["name"].startswith("vllm:") for d in docs):
        return AcceptanceSummaries(str(path), "vllm", parse_vllm_metrics(docs), {"level": "engine aggregate"})
    engine = engine or _engine_of(docs[0])
    if engine is None:
        raise AcceptanceSummaryError(f"{path}: record 0 is neither a vLLM response (metrics.speculative_decoding) "
                                     "nor an SGLang one (meta_info.spec_verify_ct); pass engine=")
    parse = parse_vllm_request if engine == "vllm" else parse_sglang_request
    records = []
    for i, d in enumerate(docs):
        other = _engine_of(d)
        if other is not None and other != engine:
            raise AcceptanceSummaryError(f"a {other} record in a {engine} file", i)
        records.append(parse(d, i))
    return AcceptanceSummaries(str(path), engine, records, {"level": "per request"})


def looks_like_summary(path: str | Path) -> bool:
    """Whether ``path`` looks like an engine acceptance summary (a ``.prom`` file, a ``.txt``
    holding ``vllm:spec_decode_`` counters (``/metrics`` text), or JSON / JSONL whose first
    record is a vLLM response / output / metric or an SGLang response or ``meta_info``); a quick
    look for telling sources apart, not a validation. Source ``"engine summary"`` of
    :func:`ddtree_lab.io.load`."""
    path = Path(path)
    if path.suffix.lower() == ".prom":
        return path.is_file()
    if path.suffix.lower() == ".txt":
        try:
            if path.is_file() and _VLLM_PREFIX in path.read_text():
                return True
        except (OSError, UnicodeDecodeError):
            return False
    rec = first_json_record(path)
    if isinstance(rec, dict) and isinstance(rec.get("name"), str):
        return rec["name"].startswith(_VLLM_PREFIX)
    return _engine_of(rec) is not None


# -- as a lab Run ---------------------------------------------------------------------------

#: Lab features a run from engine summaries cannot feed, and why (shown by the run summary).
SUMMARY_CANNOT = {
    "tree views (trees, accepted paths)": "no trees",
    "acceptance by sibling rank": "no trees",
    "verify replay, audit, what-if": "no trees, target rows, coins or sampling parameters",
    "acceptance by depth from trees": "only per-position counts (accepted at position i), not offered/accepted per node",
    "stage times": "the engines' summaries carry no stage timings",
}


def summary_run(summaries: AcceptanceSummaries):
    """A :class:`~ddtree_lab.step.Run`: one Step per verify step holding only its accept length
    (``stored_accept_length``; no tree, output, parameters, coins or rows; ``source``
    ``"engine summary"``), for requests with ``per_step_accepted`` only -- a histogram has no
    step order, so its request gives no Steps. Every request's counts are in
    ``metadata["requests"]`` (``tau_mean`` = 1 + accepted / steps, the histogram, the engine's
    own accept length and its definition, ``missing``), with ``missing`` and ``cannot``."""
    steps, requests = [], []
    for rec in summaries.requests:
        rid = rec.request_id if rec.request_id is not None else str(rec.request)
        for k, a in enumerate(rec.per_step_accepted or []):
            steps.append(Step(step=k, request=rec.request, request_id=rid, prefix_len=None, params=None, output=None,
                              stored_accept_length=a, level="off", source="engine summary", backend=rec.engine,
                              extra={"engine": rec.engine,
                                     "drafted": None if rec.per_step_drafted is None else rec.per_step_drafted[k],
                                     "missing": ["tree", "output", "params", "coins", "rows", "timings"]}))
        requests.append({"request_id": rid, "engine": rec.engine, "level": rec.level, "num_steps": rec.num_steps,
                         "num_spec_tokens": rec.num_spec_tokens,
                         "num_accepted_draft_tokens": rec.num_accepted_draft_tokens,
                         "num_draft_tokens": rec.num_draft_tokens, "accept_histogram": rec.accept_histogram,
                         "accepted_per_position": rec.accepted_per_position, "tau_mean": rec.tau_mean(),
                         "reported_accept_length": rec.reported_accept_length,
                         "reported_accept_length_definition": rec.reported_accept_length_definition,
                         "completion_tokens": rec.completion_tokens, "generated_token_ids": None,
                         "has_steps": rec.per_step_accepted is not None, "source_fields": dict(rec.source_fields),
                         "missing": list(rec.missing)})
    meta = {**summaries.metadata, "source": "engine summary", "engine": summaries.engine, "path": summaries.path,
            "requests": requests, "cannot": dict(SUMMARY_CANNOT),
            "missing": ["trees", "target rows", "sampling parameters", "coins", "stage times"]}
    return Run(metadata=meta, steps=steps, token_texts={}, problems=[])


def load_summary_run(path: str | Path, engine: str | None = None):
    """:func:`summary_run` of :func:`read_acceptance_summaries`.

    Raises:
        FileNotFoundError, ValueError, AcceptanceSummaryError: as :func:`read_acceptance_summaries`.
    """
    return summary_run(read_acceptance_summaries(path, engine=engine))
