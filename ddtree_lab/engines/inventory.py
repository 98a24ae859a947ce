"""The inventory of the installed engines' sampled-verify and draft-sampling entry points,
generated from the installed packages (``ddtree-lab audit --engine list``; the table in
docs/ENGINES.md is its output, a test checks they agree).

How it finds them: the installed package's files are parsed (``ast``; nothing is imported, so
modules whose imports reach the whole server are read too) in the folders where the engines
keep their speculative sampling code (:data:`SCAN`). Every public function or method whose
name matches :data:`NAME_PATTERN` must be either a known entry point (:data:`ENTRY_POINTS`:
what it takes, where it runs, which lab audit covers it) or a known other function
(:data:`NOT_ENTRY_POINTS`, each with the reason it is not a sampled-verify or draft-sampling
entry point). :func:`inventory` raises :class:`InventoryError` when a known entry point is gone
or a new function matching the pattern is in neither list, so an engine upgrade that adds a
verifier cannot pass unnoticed. vLLM is read through its own venv's python (it only prints
where its package is).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NAME_PATTERN", "SCAN", "ENTRY_POINTS", "NOT_ENTRY_POINTS", "Entry", "InventoryError", "package_dir",
           "scan", "inventory", "inventory_table", "inventory_blocks", "VERDICTS_FILE", "last_verdicts",
           "VLLM_RULES_COME_IN"]

#: Names that look like a verifier or a draft sampler (matched against the last part of a public name).
NAME_PATTERN = re.compile(r"(accept|verif|reject|speculative_sampling|sample|lattice|selector_walk)", re.IGNORECASE)

#: Folders (and files) scanned, per engine, relative to the package directory.
SCAN = {
    "sglang": ("kernels/ops/speculative", "srt/models/dflash.py", "srt/models/lilicorr.py"),
    "vllm": ("v1/sample/rejection_sampler.py", "v1/worker/gpu/spec_decode/rejection_sampler.py",
             "v1/worker/gpu/spec_decode/rejection_sampler_utils.py", "v1/worker/gpu/spec_decode/dflash2",
             "v1/worker/gpu/spec_decode/dspark", "v1/worker/gpu/spec_decode/lilicorr"),
}

#: The file benchmarks/engine_audit.py writes each rule's last verdict to.
VERDICTS_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_audit.json"


@dataclass(frozen=True)
class Entry:
    """One entry point: ``engine``, ``name`` (``file:Function`` or ``file:Class.method``), its
    ``role`` (``verify`` / ``draft``), where it runs, what it takes, and the lab's audit of it
    (``ddtree-lab audit --engine ...``) or ``not audited here`` with the reason."""

    engine: str
    name: str
    role: str
    runs: str
    takes: str
    audit: str


_CPU_T = "CPU (Triton interpreter) and CUDA"
_NOT_HERE = "not audited here"
ENTRY_POINTS = [
    Entry("sglang", "srt/models/dflash.py:CandidateSelector.build_lattice", "draft", "CPU (torch) and CUDA",
          "candidate ids + unary logits [bs, gamma, K], hidden states, anchor tokens -> K x K transition scores",
          "input of sglang:dflash2-dspark (the audit hands it lattice scores; the projection is a model's)"),
    Entry("sglang", "srt/models/dflash.py:CandidateSelector.sample_path", "draft", "CPU (torch path); CUDA: selector_walk_triton",
          "candidate ids, scores, uniforms, temperatures, greedy mask -> tokens, q_rows over the K candidates",
          "sglang:dflash2-dspark, sglang:dflash2-dspark-block"),
    Entry("sglang", "kernels/ops/speculative/dflash.py:selector_walk_triton", "draft", "CUDA only",
          "as sample_path (its Triton walk)", f"{_NOT_HERE}: CUDA only (scripts/gpu_check.sh)"),
    Entry("sglang", "kernels/ops/speculative/dspark/dspark_accept.py:accept_sampling", "verify", _CPU_T,
          "target logits, dense draft probs q, sampling info (temperature, top-k, top-p), block mode",
          "sglang:dflash2-dspark, sglang:dflash2-dspark-block"),
    Entry("sglang", "kernels/ops/speculative/dspark/dspark_accept.py:accept_sampling_triton", "verify", "CUDA only",
          "as accept_sampling (bonus gathered by a Triton kernel)", f"{_NOT_HERE}: CUDA only (scripts/gpu_check.sh)"),
    Entry("sglang", "kernels/ops/speculative/reject_sampling.py:chain_speculative_sampling_triton", "verify", _CPU_T,
          "target probs, draft probs (real or one-hot), coins, thresholds, block_verification",
          "sglang:chain (draft tokens given); through accept_sampling in sglang:dflash2-dspark, sglang:dflash2-dspark-block"),
    Entry("sglang", "kernels/ops/speculative/dspark/markov_sample.py:MarkovSampleStep.torch", "draft", "CPU (torch)",
          "step base logits + bias, temperatures (0: argmax), Philox key/offset -> tokens, step logits kept",
          "sglang:blockwise-rejection, sglang:blockwise-rejection-onehot"),
    Entry("sglang", "kernels/ops/speculative/dspark/markov_sample.py:MarkovSampleStep.triton", "draft", "CUDA only",
          "as MarkovSampleStep.torch", f"{_NOT_HERE}: CUDA only (scripts/gpu_check.sh)"),
    Entry("sglang", "kernels/ops/speculative/dspark/blockwise_rejection.py:blockwise_rejection_torch", "verify",
          "CPU (torch)", "target logits, draft logits at a draft temperature or one-hot (None), target temperatures, noise key",
          "sglang:blockwise-rejection, sglang:blockwise-rejection-onehot"),
    Entry("sglang", "kernels/ops/speculative/dspark/blockwise_rejection.py:blockwise_rejection_triton", "verify",
          "CUDA only", "as blockwise_rejection_torch (counter-based Murmur3 noise)", f"{_NOT_HERE}: CUDA only (scripts/gpu_check.sh)"),
    Entry("sglang", "kernels/ops/speculative/sampling.py:tree_speculative_sampling_target_only", "verify", "CUDA only",
          "tree buffers, target probs, coins, thresholds", f"{_NOT_HERE}: CUDA only (scripts/gpu_check.sh)"),
    Entry("sglang", "kernels/ops/speculative/lilicorr.py:lilicorr_sample_path", "draft", "CPU (torch) and CUDA",
          "LiLiCorr candidate walk -> tokens, q_rows (verified by accept_sampling)",
          f"{_NOT_HERE}: not attempted in this change (same verify as sglang:dflash2-dspark)"),
    Entry("sglang", "kernels/ops/speculative/spec_tree.py:verify_tree_greedy_triton", "verify", _CPU_T,
          "tree buffers, target argmax (greedy only)", "sglang (greedy kernel)"),
    Entry("vllm", "v1/sample/rejection_sampler.py:RejectionSampler.forward", "verify", "CPU (Triton interpreter) and CUDA",
          "target logits, draft probs or None, sampling metadata (temperature, top-k, top-p), per-request generators",
          "vllm:rejection-sampler (chain, target-only and real draft probs)"),
    Entry("vllm", "v1/sample/rejection_sampler.py:rejection_sample", "verify", "CPU (Triton interpreter) and CUDA",
          "the kernels RejectionSampler.forward launches (greedy, random, recovered tokens)",
          "vllm:rejection-sampler (through RejectionSampler.forward)"),
    Entry("vllm", "v1/worker/gpu/spec_decode/dflash2/speculator.py:CandidateSampler.sample", "draft",
          "CPU (Triton interpreter, with the lab's interpreter shims) and CUDA",
          "candidate ids + lattice scores [reqs, gamma, K, K], temperatures, seeds, positions -> draft tokens, "
          "realized scores cached as sparse pre-temperature draft logits (-inf elsewhere)",
          "vllm:dflash2, vllm:dflash2-block"),
    Entry("vllm", "v1/worker/gpu/spec_decode/rejection_sampler_utils.py:rejection_sample", "verify",
          "CPU (Triton interpreter, with the lab's interpreter shims) and CUDA",
          "processed target logits, pre-temperature draft logits or None (one-hot), draft tokens, temperatures, "
          "seeds, positions, use_block_verification",
          "vllm:dflash2, vllm:dflash2-block (draft logits); vllm:onehot, vllm:onehot-block (draft_logits=None)"),
    Entry("vllm", "v1/worker/gpu/spec_decode/rejection_sampler.py:RejectionSampler.__call__", "verify",
          "needs the new model runner's state", "logits, InputBatch (Sampler states, RequestState): "
          "apply_sampling_params then rejection_sample, in chunks",
          f"{_NOT_HERE}: needs the runner's InputBatch, RequestState and Sampler built from a VllmConfig, not "
          "built here; its verify (rejection_sample) and its temperature / top-k / top-p ops are audited in "
          "vllm:dflash2 and vllm:onehot"),
]

#: Functions matching :data:`NAME_PATTERN` that are not entry points of their own, by reason.
NOT_ENTRY_POINTS = {
    "greedy verify or its helpers (covered by the greedy audits or not a sampled rule)": (
        "sglang:kernels/ops/speculative/tree.py:verify_tree_greedy",
        "sglang:kernels/ops/speculative/spec_tree.py:verify_tree_greedy_func",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:accept_greedy",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:accept_greedy_triton",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:AcceptGreedy.execute",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:AcceptGreedy.torch",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:AcceptGreedy.triton",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:select_mixed_accept",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:select_mixed_accept_triton",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:SelectMixedAccept.execute",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:SelectMixedAccept.torch",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:SelectMixedAccept.triton",
    ),
    "dispatchers to a listed entry point (CPU / CUDA by where the inputs are)": (
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:AcceptSampling.execute",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:AcceptSampling.torch",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:AcceptSampling.triton",
        "sglang:kernels/ops/speculative/dspark/blockwise_rejection.py:BlockwiseRejection.execute",
        "sglang:kernels/ops/speculative/dspark/markov_sample.py:MarkovSampleStep.execute",
    ),
    "bookkeeping after the verify (lengths, caches, masks, windows), or random keys": (
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:finalize_accept_lens",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:finalize_accept_lens_triton",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:FinalizeAcceptLens.execute",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:FinalizeAcceptLens.torch",
        "sglang:kernels/ops/speculative/dspark/dspark_accept.py:FinalizeAcceptLens.triton",
        "sglang:kernels/ops/speculative/dspark/blockwise_rejection.py:rejection_noise_key",
        "sglang:kernels/ops/speculative/dspark/blockwise_rejection.py:make_rejection_noise",
        "sglang:kernels/ops/speculative/eagle.py:fill_accept_out_cache_loc",
        "sglang:kernels/ops/speculative/eagle.py:fill_accept_out_cache_loc_func",
        "sglang:kernels/ops/speculative/eagle.py:prepare_verify_commit_outputs",
        "sglang:kernels/ops/speculative/pack_verify_mask.py:pack_verify_mask_into",
        "sglang:kernels/ops/speculative/ragged_verify_kernels.py:pad_verify_lens_to_bucket",
        "sglang:kernels/ops/speculative/ragged_verify_kernels.py:pad_verify_lens_to_bucket_triton",
        "sglang:kernels/ops/speculative/dspark/dspark_verify_window.py:build_ragged_verify_window",
        "sglang:kernels/ops/speculative/dspark/dspark_verify_window.py:build_ragged_verify_window_triton",
        "sglang:kernels/ops/speculative/dspark/dspark_verify_window.py:compact_verify_ids",
        "sglang:kernels/ops/speculative/dspark/dspark_verify_window.py:compact_verify_ids_triton",
        "sglang:kernels/ops/speculative/dspark/dspark_verify_window.py:BuildRaggedVerifyWindow.execute",
        "sglang:kernels/ops/speculative/dspark/dspark_verify_window.py:BuildRaggedVerifyWindow.torch",
        "sglang:kernels/ops/speculative/dspark/dspark_verify_window.py:BuildRaggedVerifyWindow.triton",
        "sglang:kernels/ops/speculative/dspark/dspark_schedule.py:schedule_verify_lens_topk",
        "sglang:kernels/ops/speculative/dspark/dspark_schedule.py:schedule_verify_lens_topk_from_survival",
        "sglang:kernels/ops/speculative/dspark/dspark_schedule.py:schedule_verify_lens_topk_triton",
        "sglang:kernels/ops/speculative/dspark/dspark_schedule.py:ScheduleVerifyLensTopk.execute",
        "sglang:kernels/ops/speculative/dspark/dspark_schedule.py:ScheduleVerifyLensTopk.torch",
        "sglang:kernels/ops/speculative/dspark/dspark_schedule.py:ScheduleVerifyLensTopk.triton",
        "sglang:kernels/ops/speculative/uno_tree.py:UnoTreeProposal.num_verify_tokens",
    ),
    "the @triton.jit body of a listed launcher, or its input gathering": (
        "vllm:v1/sample/rejection_sampler.py:rejection_greedy_sample_kernel",
        "vllm:v1/sample/rejection_sampler.py:rejection_random_sample_kernel",
        "vllm:v1/sample/rejection_sampler.py:sample_recovered_tokens",
        "vllm:v1/sample/rejection_sampler.py:sample_recovered_tokens_kernel",
        "vllm:v1/worker/gpu/spec_decode/rejection_sampler.py:gather_draft_sampled",
        "sglang:kernels/ops/speculative/reject_sampling.py:speculative_sampling_classic_kernel",
        "sglang:kernels/ops/speculative/spec_tree.py:verify_tree_greedy_kernel_triton",
    ),
    "not a verify: simulated acceptance and bonus (benchmarking aids) and static accept tails": (
        "sglang:kernels/ops/speculative/dspark/simulated_bonus.py:simulated_bonus_sample",
        "sglang:kernels/ops/speculative/dspark/simulated_bonus.py:simulated_bonus_sample_graph",
        "sglang:kernels/ops/speculative/simulated_accept.py:simulated_accept",
        "sglang:kernels/ops/speculative/dspark/static_accept_tail.py:static_accept_tail",
        "sglang:kernels/ops/speculative/dspark/static_accept_tail.py:static_accept_tail_torch",
    ),
}


class InventoryError(RuntimeError):
    """The installed engine no longer matches the inventory (entry points gone or new ones unlisted)."""


def package_dir(engine: str) -> Path | None:
    """The installed package directory of ``engine`` (``"sglang"`` here, ``"vllm"`` through
    its venv's python), or None when it is not installed."""
    if engine == "sglang":
        import importlib.util

        spec = importlib.util.find_spec("sglang")
        return None if spec is None or not spec.submodule_search_locations else Path(list(spec.submodule_search_locations)[0])
    if engine == "vllm":
        from .vllm import vllm_python

        py = vllm_python()
        if not py.exists():
            return None
        code = "import importlib.util, json; s = importlib.util.find_spec('vllm'); print(json.dumps(list(s.submodule_search_locations)))"
        out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            return None
        return Path(json.loads(out.stdout)[0])
    raise ValueError(f"engine must be 'sglang' or 'vllm', got {engine!r}")


def _files(root: Path, engine: str) -> list[Path]:
    out: list[Path] = []
    for rel in SCAN[engine]:
        p = root / rel
        out += sorted(p.rglob("*.py")) if p.is_dir() else ([p] if p.exists() else [])
    return out


def scan(root: Path, engine: str) -> dict[str, int]:
    """Public functions and methods under :data:`SCAN` whose name matches :data:`NAME_PATTERN`,
    plus every known entry point found: ``{"file:Name": line}``."""
    wanted = {e.name for e in ENTRY_POINTS if e.engine == engine}
    found: dict[str, int] = {}
    for f in _files(root, engine):
        rel = f.relative_to(root).as_posix()
        tree = ast.parse(f.read_text(), str(f))
        for node in tree.body:
            items = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                items.append((node.name, node))
            elif isinstance(node, ast.ClassDef):
                items += [(f"{node.name}.{m.name}", m) for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for name, n in items:
                key = f"{rel}:{name}"
                last = name.split(".")[-1]
                public = not any(part.startswith("_") for part in name.split(".")) or last == "__call__"
                if key in wanted or (public and NAME_PATTERN.search(last)):
                    found[key] = n.lineno
    return found


def inventory(engines=("sglang", "vllm")) -> dict:
    """The inventory: per engine, ``{"root", "entries": [(Entry, line)], "missing": reason}``.

    Raises:
        InventoryError: a known entry point is gone, or a function matching :data:`NAME_PATTERN`
            is neither an entry point nor a known other function (both listed).
    """
    others = {n for names in NOT_ENTRY_POINTS.values() for n in names}
    out: dict = {}
    problems = []
    for engine in engines:
        root = package_dir(engine)
        if root is None:
            why = f"{engine} is not installed here"
            if engine == "vllm":
                from .vllm import vllm_unavailable_reason

                why = vllm_unavailable_reason() or "the vLLM venv's python could not locate vllm"
            out[engine] = {"root": None, "entries": [], "missing": f"not inventoried: {why}"}
            continue
        found = scan(root, engine)
        known = [e for e in ENTRY_POINTS if e.engine == engine]
        gone = [e.name for e in known if e.name not in found]
        listed = {e.name for e in known} | {n.split(":", 1)[1] for n in others if n.startswith(engine + ":")}
        new = sorted(k for k in found if k not in listed)
        problems += [f"{engine}: known entry point {g} is gone from {root}" for g in gone]
        problems += [f"{engine}: {k} (line {found[k]}) is named like a verifier ({NAME_PATTERN.pattern}) but is "
                     "not in the inventory: add it to ENTRY_POINTS or NOT_ENTRY_POINTS" for k in new]
        out[engine] = {"root": root, "entries": [(e, found.get(e.name)) for e in known], "missing": None}
    if problems:
        raise InventoryError("the installed engines differ from the inventory:\n  " + "\n  ".join(problems))
    return out


def last_verdicts(path: Path = VERDICTS_FILE) -> dict:
    """``{"engine:rule": {"verdict", "p_value", ...}}`` from the last benchmark run, or ``{}``."""
    if not path.exists():
        return {}
    return json.loads(path.read_text()).get("rules", {})


def inventory_table(inv: dict, verdicts: dict | None = None) -> str:
    """The inventory as the markdown table of docs/ENGINES.md (with each rule's last verdict
    when ``verdicts`` is given, for ``--engine list``)."""
    head = "| engine | entry point (file:function) | role | runs | takes | lab audit |"
    if verdicts is not None:
        head += " last verdict |"
    lines = [head, "|" + " --- |" * (7 if verdicts is not None else 6)]
    for engine, info in inv.items():
        if info["missing"]:
            lines.append(f"| {engine} | ({info['missing']}) | | | | | " + ("|" if verdicts is not None else ""))
            continue
        for e, line in info["entries"]:
            row = f"| {engine} | `{e.name}` (line {line}) | {e.role} | {e.runs} | {e.takes} | {e.audit} |"
            if verdicts is not None:
                # an entry not audited here gets no verdict, even where its note names a rule
                rules = _rules_named(e, verdicts)
                row += " " + ("; ".join(f"{k}: {verdicts[k]['verdict']}" for k in rules) or "-") + " |"
            lines.append(row)
    return "\n".join(lines)


#: How vLLM's rules come into the inventory on a set-up without the vLLM venv (docs/ENGINES.md,
#: "How to run it", says the same).
VLLM_RULES_COME_IN = ("vLLM 0.33.0's rejection sampler and new model runner audit in their own venv: "
                      "`bash scripts/setup_vllm.sh` makes it (once, ~1-2 min; or set DDTREE_LAB_VLLM_VENV)")


def _rules_named(e: Entry, verdicts: dict) -> list[str]:
    """The rules of ``verdicts`` that entry ``e``'s audit note names (none for an entry not audited here)."""
    if e.audit.startswith(_NOT_HERE):
        return []
    named = set(re.findall(r"\b(?:sglang|vllm):[a-z0-9-]+", e.audit))
    return [k for k in verdicts if k in named]


def _verdict_words(rule: str, v: dict) -> str:
    """``"sglang:chain: consistent with lossless (p = 0.68; planted faults: one-hot-q p = 0)"``."""
    p = f"p = {v['p_value']:.2g}" if isinstance(v.get("p_value"), (int, float)) else ""
    faults = "; planted faults: " + ", ".join(f"{k} p = {q:.2g}" for k, q in v["faults"].items()) if v.get("faults") else ""
    more = f" ({p}{faults})" if p or faults else ""
    return f"{rule}: {v.get('verdict', '?')}{more}"


def inventory_blocks(inv: dict, verdicts: dict | None = None, width: int | None = None) -> str:
    """The inventory for a terminal (``audit --engine list``): one block per entry point (engine
    and file:function with its line, then role and where it runs, what it takes, the lab's audit
    rules, and each rule's last verdict with its p-values), wrapped to ``width`` columns (default:
    the terminal's, :func:`shutil.get_terminal_size`); an engine not inventoried here gets one
    line saying why (vLLM: how its rules come in, :data:`VLLM_RULES_COME_IN`)."""
    import shutil
    import textwrap

    width = max(40, width or shutil.get_terminal_size((100, 24)).columns)
    verdicts = verdicts or {}

    def wrap(label: str, text: str) -> list[str]:
        return textwrap.wrap(f"{label}: {text}", width, initial_indent="  ", subsequent_indent="      ",
                             break_on_hyphens=False, break_long_words=False) or [f"  {label}:"]

    blocks = []
    for engine, info in inv.items():
        if info["missing"]:
            line = f"{engine}: {info['missing']}"
            if engine == "vllm":  # no rule listed: say how they come in (once, not the reason's own pointer)
                why = re.sub(r" \(run `bash scripts/setup_vllm\.sh`[^)]*\)", "", info["missing"])
                line = f"vllm: no rules listed ({why}); {VLLM_RULES_COME_IN}"
            blocks.append("\n".join(textwrap.wrap(line, width, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False)))
            continue
        for e, line in info["entries"]:
            lines = textwrap.wrap(f"{engine}  {e.name} (line {line})", width, subsequent_indent="    ",
                                  break_on_hyphens=False, break_long_words=False)
            lines += wrap("role", f"{e.role}; runs: {e.runs}") + wrap("takes", e.takes) + wrap("audit", e.audit)
            rules = _rules_named(e, verdicts)
            for rule in rules:
                lines += wrap("verdict", _verdict_words(rule, verdicts[rule]))
            if not rules and verdicts:
                lines += wrap("verdict", "-")
            blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def write_doc_blocks(path: Path, inv: dict) -> str:
    """Replace the generated blocks ``<!-- inventory ENGINE begin --> ... end -->`` of ``path``
    (docs/ENGINES.md) with :func:`inventory_table` of each engine in ``inv``; returns the new text.

    Raises:
        ValueError: the file lacks a block for one of the engines.
    """
    text = path.read_text()
    for engine in inv:
        pattern = re.compile(rf"<!-- inventory {engine} begin -->\n.*?<!-- inventory {engine} end -->", re.S)
        if not pattern.search(text):
            raise ValueError(f"{path} has no block <!-- inventory {engine} begin --> ... <!-- inventory {engine} end -->")
        block = f"<!-- inventory {engine} begin -->\n{inventory_table({engine: inv[engine]})}\n<!-- inventory {engine} end -->"
        text = pattern.sub(lambda _m: block, text, count=1)
    path.write_text(text)
    return text
