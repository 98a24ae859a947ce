"""Write hand-made engine acceptance summaries under fixtures/engine_summaries/.

Each file has the layout a user gets by saving an engine's responses or metrics (field names
and definitions: ``ddtree_lab/io/acceptance.py``'s docstring, which cites the engine files):

  vllm_chat_summary.jsonl   3 OpenAI chat responses, metrics.speculative_decoding (summary level)
  vllm_offline_detailed.json 2 offline outputs, spec_decode_metrics with per-step arrays (detailed)
  vllm_get_metrics.json     LLM.get_metrics() spec-decode Counters and the per-position Vector
  vllm_metrics.prom         the same counters as /metrics text
  sglang_generate.jsonl     3 /generate responses; meta_info with the newer field names (2) and
                            the older spec_accept_token_num / spec_accept_histogram ones (1)

Every count comes from per-step accepted lengths drawn from ``random.Random(seed)``;
:func:`make_steps` returns them so tests can compare. Usage:
python scripts/make_engine_summary_fixture.py [--out fixtures/engine_summaries]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

K_VLLM = 7  # num_speculative_tokens
SGLANG_DRAFT_TOKENS = 8  # --speculative-num-draft-tokens (7 proposed per step)


def _steps(seed: int, n: int, k: int, p: float) -> list[int]:
    """Accepted draft tokens per step: a prefix, each position accepted with probability p."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = 0
        while a < k and rng.random() < p:
            a += 1
        out.append(a)
    return out


def make_steps() -> dict[str, list[list[int]]]:
    """Per file, per request, the accepted draft tokens of each verify step."""
    return {"vllm_chat_summary.jsonl": [_steps(10, 40, K_VLLM, 0.7), _steps(11, 25, K_VLLM, 0.5),
                                        _steps(12, 31, K_VLLM, 0.8)],
            "vllm_offline_detailed.json": [_steps(20, 12, K_VLLM, 0.6), _steps(21, 9, K_VLLM, 0.75)],
            "sglang_generate.jsonl": [_steps(30, 30, SGLANG_DRAFT_TOKENS - 1, 0.7),
                                      _steps(31, 22, SGLANG_DRAFT_TOKENS - 1, 0.55),
                                      _steps(32, 18, SGLANG_DRAFT_TOKENS - 1, 0.65)]}


def _hist(steps: list[int], k: int) -> list[int]:
    return [steps.count(j) for j in range(k + 1)]


def vllm_metrics(steps: list[int], detailed: bool) -> dict:
    acc, n = sum(steps), len(steps)
    out = {"mean_acceptance_length": 1 + acc / n, "draft_acceptance_rate": acc / (n * K_VLLM),
           "acceptance_histogram": _hist(steps, K_VLLM), "num_spec_steps": n,
           "num_accepted_draft_tokens": acc, "num_draft_tokens": n * K_VLLM, "num_spec_tokens": K_VLLM}
    if detailed:
        out["per_step_accepted"] = list(steps)
        out["per_step_drafted"] = [K_VLLM] * n
    return out


def sglang_meta(steps: list[int], rid: str, newer: bool) -> dict:
    n, acc = len(steps), sum(steps)
    completion = 1 + sum(a + 1 for a in steps)  # the prefill's token, then tau per step
    drafted = n * (SGLANG_DRAFT_TOKENS - 1)
    meta = {"id": rid, "finish_reason": {"type": "length", "length": completion}, "prompt_tokens": 57,
            "completion_tokens": completion, "cached_tokens": 0, "spec_verify_ct": n,
            "spec_accept_rate": acc / drafted, "spec_accept_length": completion / n}
    hist = [steps.count(j) for j in range(max(steps) + 1)]  # SGLang's histogram grows as needed
    if newer:
        meta.update({"spec_num_correct_drafts": acc, "spec_num_proposed_drafts": drafted,
                     "spec_correct_drafts_histogram": hist})
    else:
        meta.update({"spec_accept_token_num": acc, "spec_draft_token_num": drafted, "spec_accept_histogram": hist})
    return meta


def write(out_dir: Path) -> list[Path]:
    """Write the five files; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = make_steps()
    paths = []

    lines = []
    for i, s in enumerate(steps["vllm_chat_summary.jsonl"]):
        completion = 1 + sum(a + 1 for a in s)
        lines.append({"id": f"chatcmpl-{1000 + i}", "object": "chat.completion", "created": 1787366173 + i,
                      "model": "Qwen/Qwen3-8B",
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "..."},
                                   "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 64, "completion_tokens": completion,
                                "total_tokens": 64 + completion},
                      "metrics": {"speculative_decoding": vllm_metrics(s, detailed=False)}})
    p = out_dir / "vllm_chat_summary.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    paths.append(p)

    outs = [{"request_id": str(i), "text": "...", "finish_reason": "length",
             "spec_decode_metrics": vllm_metrics(s, detailed=True)}
            for i, s in enumerate(steps["vllm_offline_detailed.json"])]
    p = out_dir / "vllm_offline_detailed.json"
    p.write_text(json.dumps(outs, indent=1))
    paths.append(p)

    every = [a for s in steps["vllm_chat_summary.jsonl"] for a in s]
    labels = {"engine": "0", "model_name": "Qwen/Qwen3-8B"}
    per_pos = [sum(1 for a in every if a > i) for i in range(K_VLLM)]
    metrics = [{"name": "vllm:num_requests_running", "labels": labels, "value": 0.0},
               {"name": "vllm:spec_decode_num_drafts", "labels": labels, "value": len(every)},
               {"name": "vllm:spec_decode_num_draft_tokens", "labels": labels, "value": len(every) * K_VLLM},
               {"name": "vllm:spec_decode_num_accepted_tokens", "labels": labels, "value": sum(every)},
               {"name": "vllm:spec_decode_num_accepted_tokens_per_pos", "labels": labels, "values": per_pos}]
    p = out_dir / "vllm_get_metrics.json"
    p.write_text(json.dumps([m for m in metrics if m["name"].startswith("vllm:spec_decode")], indent=1))
    paths.append(p)

    lab = 'engine="0",model_name="Qwen/Qwen3-8B"'
    prom = ["# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            f"vllm:spec_decode_num_drafts_total{{{lab}}} {float(len(every))}",
            f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {float(len(every) * K_VLLM)}",
            f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {float(sum(every))}"]
    prom += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {float(v)}'
             for i, v in enumerate(per_pos)]
    prom.append(f"vllm:spec_decode_num_drafts_created{{{lab}}} 1.787366e+09")
    p = out_dir / "vllm_metrics.prom"
    p.write_text("\n".join(prom) + "\n")
    paths.append(p)

    resp = [{"text": "...", "meta_info": sglang_meta(s, f"rid{i:02d}", newer=i < 2)}
            for i, s in enumerate(steps["sglang_generate.jsonl"])]
    p = out_dir / "sglang_generate.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in resp))
    paths.append(p)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fixtures/engine_summaries", help="output directory")
    args = ap.parse_args()
    for p in write(Path(args.out)):
        print(f"wrote {p} ({p.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
