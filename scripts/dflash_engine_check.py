"""Stage 3 of ``scripts/make_dflash_engine_data.py``: check every engine shard against the lab's
own target and compute the drafter's context features (that script's docstring says how).

Kept apart so the stage runs in the lab's venv only (torch + transformers, never vLLM).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

#: sequences per lab forward (right-padded; causal attention keeps padding out of real positions)
FORWARD_BATCH = 8


def _forward(target, seqs: list[list[int]], layer_ids: list[int], want_logits: list[bool]):
    """One padded forward over ``seqs``: per sequence ``(features [T-1, k*H] fp16, logits [T, V]
    fp32 or None)``; features row ``t`` belongs to token ``t`` (the last token has none)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    attn = torch.zeros(len(seqs), width, dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        attn[b, : len(s)] = 1
    out = target.model.model(input_ids=ids, attention_mask=attn, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[l + 1] for l in layer_ids], dim=-1)
    head = target.model.get_output_embeddings()
    rows = []
    for b, s in enumerate(seqs):
        logits = head(out.last_hidden_state[b, : len(s)]).float() if want_logits[b] else None
        rows.append((feats[b, : len(s) - 1].to(torch.float16).contiguous(), logits))
    return rows


def _greedy_check(logits: torch.Tensor, seq: list[int], prompt_len: int, tol: float) -> dict:
    """Teacher-forced: the lab's argmax at every generated position against the engine's token."""
    gen = torch.tensor(seq[prompt_len:])
    lg = logits[prompt_len - 1 : len(seq) - 1]  # logits at t predict token t + 1
    top = lg.max(-1).values
    mine = lg.gather(-1, gen[:, None])[:, 0]
    gap = top - mine
    differ = lg.argmax(-1) != gen
    ties = differ & (gap <= tol)
    bad = differ & (gap > tol)
    first = int(torch.nonzero(bad)[0, 0]) if bool(bad.any()) else None
    return {"tokens": int(gen.numel()), "mismatches": int(bad.sum()), "ties": int(ties.sum()),
            "max_tie_gap": float(gap[ties].max()) if bool(ties.any()) else 0.0,
            "first_mismatch": None if first is None else {"position": first, "engine_token": int(gen[first]),
                                                          "lab_token": int(lg[first].argmax()),
                                                          "logit_gap": float(gap[first])}}


def _pit(logits: torch.Tensor, seq: list[int], prompt_len: int, temperature: float, gen: torch.Generator):
    """Randomised probability integral transform of each sampled token under the lab target's
    tempered distribution (uniform on [0, 1) when the engine samples that law), and the
    log-probability of each token with its expectation (minus the entropy)."""
    toks = torch.tensor(seq[prompt_len:])
    lg = logits[prompt_len - 1 : len(seq) - 1].double() / temperature
    logp = torch.log_softmax(lg, -1)
    p = logp.exp()
    cdf_below = torch.cumsum(p, -1).gather(-1, toks[:, None])[:, 0] - p.gather(-1, toks[:, None])[:, 0]
    u = cdf_below + torch.rand(toks.numel(), generator=gen, dtype=torch.float64) * p.gather(-1, toks[:, None])[:, 0]
    lp = logp.gather(-1, toks[:, None])[:, 0]
    expected = (p * logp).sum(-1)
    return u.clamp(0, 1), lp, expected


def check_shard(target, doc: dict, layer_ids: list[int], args, engine: dict | None = None) -> tuple[dict, dict | None]:
    """``(verdict, tensors or None)`` for one shard document (``ddtree_lab.vllm.datagen``).
    ``engine``: the features the engine recorded (``ids.{j}``, ``features.{j}``), or None (the
    lab's forward then runs on every request and its features are the data)."""
    from scipy.stats import kstest

    temperature = float(doc["temperature"])
    reqs = doc["requests"]
    tensors: dict[str, torch.Tensor] = {}
    greedy = {"requests": 0, "tokens": 0, "mismatches": 0, "ties": 0, "max_tie_gap": 0.0, "failures": []}
    us, lps, exps = [], [], []
    gen = torch.Generator().manual_seed(1234)
    t0 = time.time()
    feature_err: list[float] = []
    feature_fail: list[dict] = []
    if engine is not None:  # the engine's features are the data; the lab's forward checks a sample
        for j, r in enumerate(reqs):
            seq = r["prompt_token_ids"] + r["generated_token_ids"]
            if engine[f"ids.{j}"].tolist() != seq:
                feature_fail.append({"request": j, "why": "the feature file's tokens are not prompt + generated"})
            tensors[f"ids.{j}"] = torch.tensor(seq)
            tensors[f"features.{j}"] = engine[f"features.{j}"]
            tensors[f"prompt_len.{j}"] = torch.tensor([len(r["prompt_token_ids"])])
        order = [j for j in range(len(reqs)) if j % args.check_every == 0]
    else:
        order = list(range(len(reqs)))
    for i in range(0, len(order), FORWARD_BATCH):
        idx = order[i : i + FORWARD_BATCH]
        seqs = [reqs[j]["prompt_token_ids"] + reqs[j]["generated_token_ids"] for j in idx]
        checked = [j % args.check_every == 0 and len(reqs[j]["generated_token_ids"]) > 0 for j in idx]
        with torch.no_grad():
            rows = _forward(target, seqs, layer_ids, checked)
        for j, s, ok, (feats, logits) in zip(idx, seqs, checked, rows):
            plen = len(reqs[j]["prompt_token_ids"])
            if engine is None:
                tensors[f"ids.{j}"] = torch.tensor(s)
                tensors[f"features.{j}"] = feats
                tensors[f"prompt_len.{j}"] = torch.tensor([plen])
            else:  # both fp16 (the lab's rounded from fp32): equal up to rounding
                e = engine[f"features.{j}"].float()
                err = float((e - feats.float()).norm() / feats.float().norm().clamp(min=1e-30))
                feature_err.append(err)
                if not err <= args.feature_tolerance:
                    feature_fail.append({"request": j, "relative_error": err})
            if not ok or logits is None:
                continue
            if temperature == 0.0:
                g = _greedy_check(logits, s, plen, args.tie_tolerance)
                greedy["requests"] += 1
                for k in ("tokens", "mismatches", "ties"):
                    greedy[k] += g[k]
                greedy["max_tie_gap"] = max(greedy["max_tie_gap"], g["max_tie_gap"])
                if g["first_mismatch"] is not None:
                    greedy["failures"].append({"request": j, "prompt": reqs[j]["prompt"], **g["first_mismatch"]})
            else:
                u, lp, ex = _pit(logits, s, plen, temperature, gen)
                us.append(u)
                lps.append(lp)
                exps.append(ex)
    verdict: dict = {"forward_seconds": round(time.time() - t0, 1), "tie_tolerance": args.tie_tolerance,
                     "features": "engine (checked on a sample)" if engine is not None else "lab forward"}
    if engine is not None:
        verdict |= {"feature_requests_checked": len(feature_err), "feature_max_relative_error": max(feature_err, default=None),
                    "feature_tolerance": args.feature_tolerance, "feature_failures": feature_fail[:8]}
    if temperature == 0.0:
        frac = greedy["mismatches"] / max(1, greedy["tokens"])
        passed = greedy["tokens"] > 0 and frac <= args.max_mismatch
        verdict |= {"check": "greedy, teacher-forced argmax", **greedy, "mismatch_fraction": frac, "passed": passed}
        if greedy["tokens"] == 0:
            verdict["why"] = "no generated token was checked"
    else:
        u = torch.cat(us) if us else torch.zeros(0)
        if u.numel() < 100:
            verdict |= {"check": "sampled, PIT uniformity", "tokens": int(u.numel()), "passed": False,
                        "why": "fewer than 100 sampled tokens checked: the check could not run"}
        else:
            ks = kstest(u.numpy(), "uniform")
            lp, ex = torch.cat(lps), torch.cat(exps)
            verdict |= {"check": "sampled, PIT uniformity (KS)", "tokens": int(u.numel()),
                        "ks_statistic": float(ks.statistic), "p_value": float(ks.pvalue),
                        "mean_logprob": float(lp.mean()), "expected_mean_logprob": float(ex.mean()),
                        "passed": bool(ks.pvalue >= args.alpha), "alpha": args.alpha}
    if feature_fail or (engine is not None and not feature_err):
        verdict["passed"] = False
        verdict["why"] = (f"{len(feature_fail)} request(s) whose engine features differ from the lab's"
                          if feature_fail else "no request's features were compared: the check could not run")
    return verdict, (tensors if verdict["passed"] else None)


def _manifest(data: Path) -> dict:
    path = data / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {"format": "ddtree-lab-engine-data", "version": 1,
                                                                 "shards": {}}


def _write_manifest(data: Path, manifest: dict) -> None:
    tmp = data / "manifest.json.partial"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.rename(data / "manifest.json")


def cmd_check(args) -> None:
    """Check and featurise every generated shard that has neither ``.safetensors`` nor
    ``.rejected.json`` (resumable); update ``manifest.json``."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from ddtree_lab.models import load_default_target
    from ddtree_lab.models.dflash import build_target_layer_ids

    torch.set_num_threads(args.threads)
    data = Path(args.data)
    plan = json.loads((data / "plan.json").read_text())
    target = load_default_target()
    layer_ids = build_target_layer_ids(int(target.model.config.num_hidden_layers), 5)
    manifest = _manifest(data)
    manifest |= {"target": target.name, "layer_ids": layer_ids, "plan": plan["prompts"],
                 "shard_size": plan["shard_size"]}
    todo = [s for s in plan["shards"] if (data / f"{s['name']}.json").exists()
            and not (data / f"{s['name']}.safetensors").exists() and not (data / f"{s['name']}.rejected.json").exists()]
    for s in tqdm(todo, desc="lab checks shards"):
        doc = json.loads((data / f"{s['name']}.json").read_text())
        engine = None
        if (data / f"{s['name']}.features.safetensors").exists():
            from safetensors.torch import load_file

            engine = load_file(str(data / f"{s['name']}.features.safetensors"))
            if doc.get("features", {}).get("layer_ids") != layer_ids:
                raise SystemExit(f"{s['name']}: the engine recorded layers {doc.get('features')}, the drafter reads {layer_ids}")
        verdict, tensors = check_shard(target, doc, layer_ids, args, engine)
        entry = {"split": s["split"], "temperature": doc["temperature"], "requests": len(doc["requests"]),
                 "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in doc["requests"]),
                 "generated_tokens": doc["generated_tokens"], "engine": doc["engine"],
                 "vllm_version": doc["vllm_version"], "engine_threads": doc.get("threads"),
                 "generate_seconds": round(doc["generate_seconds"], 1), "verdict": verdict}
        if tensors is not None:
            meta = {"layer_ids": json.dumps(layer_ids), "sampled": str(doc["temperature"] > 0),
                    "temperature": str(doc["temperature"]), "new_tokens": "160-256", "target": target.name,
                    "engine": f"vllm {doc['vllm_version']}"}
            path = data / f"{s['name']}.safetensors"
            save_file(tensors, str(path.with_suffix(".partial")), metadata=meta)
            path.with_suffix(".partial").rename(path)
            if engine is not None:  # the shard file holds them now
                (data / f"{s['name']}.features.safetensors").unlink()
        else:
            (data / f"{s['name']}.rejected.json").write_text(json.dumps(entry, indent=1) + "\n")
        manifest["shards"][s["name"]] = entry
        _write_manifest(data, manifest)
        tqdm.write(f"{s['name']}: {'passed' if verdict['passed'] else 'REJECTED'} "
                   + json.dumps({k: v for k, v in verdict.items() if k not in ("failures",)}))
    cmd_status(args)


def cmd_status(args) -> None:
    """Print what the data directory holds: shards generated, passed, rejected, tokens, seconds."""
    data = Path(args.data)
    manifest = _manifest(data)
    plan = json.loads((data / "plan.json").read_text()) if (data / "plan.json").exists() else {"shards": []}
    sh = manifest["shards"]
    ok = [v for k, v in sh.items() if v["verdict"]["passed"] and v["split"] == "train"]
    bad = {k: v["verdict"].get("why") or "failed" for k, v in sh.items() if not v["verdict"]["passed"]}
    generated = sum(1 for s in plan["shards"] if (data / f"{s['name']}.json").exists())
    summary = {"planned": len(plan["shards"]), "generated": generated, "checked": len(sh),
               "passed_train_shards": len(ok), "rejected": bad,
               "train_tokens": sum(v["prompt_tokens"] + v["generated_tokens"] for v in ok),
               "train_generated_tokens": sum(v["generated_tokens"] for v in ok),
               "engine_seconds": round(sum(v["generate_seconds"] for v in sh.values()), 1),
               "check_seconds": round(sum(v["verdict"]["forward_seconds"] for v in sh.values()), 1)}
    manifest["summary"] = summary
    if data.exists() and sh:
        _write_manifest(data, manifest)
    print(json.dumps(summary), flush=True)
    if not math.isfinite(summary["engine_seconds"]):
        raise SystemExit("manifest holds a non-finite time")
