"""Self-distillation data for the DFlash drafter of the embedded default target.

The target (SmolLM2-135M-Instruct, fp32, CPU) answers the training prompts of
``fixtures/drafters/dflash_prompts.json`` with batched ``model.generate`` (left padding; two
batches greedy, every third batch sampled at T = 0.7), and forward hooks on the chosen decoder
layers record their outputs while it generates, so the features of every token come for free
(layer ``l``'s output is HF ``hidden_states[l + 1]``, z-lab's convention). Each batch is written
to ``<cache>/dflash_data/batch_XXXX.safetensors`` (token ids and fp16 features, padding
stripped), so an interrupted run resumes where it stopped.

It also writes ``<cache>/dflash_data/record.json`` (prompts, tokens, seconds), which the
training script copies into the model card.

    python scripts/make_dflash_data.py [--num-prompts 620] [--new-tokens 160] [--batch 96] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ddtree_lab.models import cache_dir, load_default_target
from ddtree_lab.models.dflash import build_target_layer_ids

PROMPTS = Path(__file__).resolve().parents[1] / "fixtures" / "drafters" / "dflash_prompts.json"


def data_dir() -> Path:
    return cache_dir() / "dflash_data"


@torch.no_grad()
def generate_batch(target, prompts: list[str], layer_ids: list[int], new_tokens: int, sample: bool, seed: int):
    """Generate for ``prompts``; return per prompt ``(ids [T] int64, features [T-1, k*H] fp16,
    prompt_len)`` where ``features[t]`` belongs to token ``t`` (the last token has none)."""
    tok = target.tokenizer
    enc = [target.encode_prompt(p) for p in prompts]
    width = max(len(e) for e in enc)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 2
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
    attn = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    captured: dict[int, list[torch.Tensor]] = {l: [] for l in layer_ids}
    layers = target.model.model.layers

    def hook_for(l):
        def hook(_module, _inp, out):
            h = out[0] if isinstance(out, tuple) else out
            captured[l].append(h.detach().to(torch.float16))
        return hook

    handles = [layers[l].register_forward_hook(hook_for(l)) for l in layer_ids]
    try:
        torch.manual_seed(seed)
        kw = dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
        out = target.model.generate(ids, attention_mask=attn, max_new_tokens=new_tokens, pad_token_id=pad, **kw)
    finally:
        for h in handles:
            h.remove()
    feats = torch.cat([torch.cat(captured[l], dim=1) for l in layer_ids], dim=-1)  # [B, width+steps, k*H]
    eos = target.eos_token_ids
    rows = []
    for b, e in enumerate(enc):
        gen = out[b, width:].tolist()
        n = len(gen)
        for i, t in enumerate(gen):
            if t in eos:
                n = i + 1
                break
        seq = e + gen[:n]
        start = width - len(e)
        f = feats[b, start : start + len(seq) - 1]
        rows.append((torch.tensor(seq), f.contiguous(), len(e)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=620)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=96, help="prompts per generate call (larger is faster on CPU)")
    ap.add_argument("--num-draft-layers", type=int, default=5,
                    help="how many target layers feed the drafter (z-lab's build_target_layer_ids)")
    ap.add_argument("--held-out", type=int, default=16, help="held-out prompts to generate (greedy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: ddtree_lab.threads' choice for this machine)")
    args = ap.parse_args()
    for name in ("num_prompts", "new_tokens", "batch", "num_draft_layers", "held_out"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    else:
        from ddtree_lab.threads import configure_threads
        configure_threads()
    prompts = json.loads(PROMPTS.read_text())
    for flag, n, have in (("--num-prompts", args.num_prompts, len(prompts["train"])),
                          ("--held-out", args.held_out, len(prompts["held_out"]))):
        if n > have:
            ap.error(f"{flag} {n}: {PROMPTS.name} has only {have}")
    t0 = time.time()
    target = load_default_target()
    n_layers = int(target.model.config.num_hidden_layers)
    if args.num_draft_layers > n_layers - 3:
        ap.error(f"--num-draft-layers {args.num_draft_layers}: the target has {n_layers} layers "
                 f"(at most {n_layers - 3} distinct layers from 1 to N-3)")
    layer_ids = build_target_layer_ids(n_layers, args.num_draft_layers)
    out_dir = data_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    jobs = [("train", prompts["train"][i : i + args.batch], i // args.batch)
            for i in range(0, args.num_prompts, args.batch)]
    jobs += [("heldout", prompts["held_out"][: args.held_out], 0)]
    for split, batch, k in tqdm(jobs, desc="target generates (batches)"):
        path = out_dir / f"{split}_{k:04d}.safetensors"
        if path.exists():  # resume, but only data made the same way
            with safe_open(str(path), framework="pt") as h:
                old = h.metadata() or {}
            if (old.get("layer_ids"), old.get("new_tokens"), old.get("target")) != \
                    (json.dumps(layer_ids), str(args.new_tokens), target.name):
                raise SystemExit(f"{path} was made with layers {old.get('layer_ids')}, {old.get('new_tokens')} new "
                                 f"tokens, target {old.get('target')}: not this run's settings; move {out_dir} "
                                 "away to start afresh")
            continue
        sample = split == "train" and k % 3 == 2
        rows = generate_batch(target, batch, layer_ids, args.new_tokens, sample, args.seed * 1000 + k)
        tensors = {}
        for j, (seq, f, plen) in enumerate(rows):
            tensors[f"ids.{j}"] = seq
            tensors[f"features.{j}"] = f
            tensors[f"prompt_len.{j}"] = torch.tensor([plen])
        meta = {"layer_ids": json.dumps(layer_ids), "sampled": str(sample), "temperature": "0.7" if sample else "0",
                "new_tokens": str(args.new_tokens), "target": target.name}
        save_file(tensors, str(path.with_suffix(".partial")), metadata=meta)
        path.with_suffix(".partial").rename(path)
    seconds = time.time() - t0
    record_path = out_dir / "record.json"
    previous = json.loads(record_path.read_text()) if record_path.exists() else {"seconds": 0.0}
    counts = {"train": [0, 0], "heldout": [0, 0]}  # sequences, tokens
    for f in sorted(out_dir.glob("*_*.safetensors")):
        split = f.name.split("_")[0]
        with safe_open(str(f), framework="pt") as h:
            keys = [k for k in h.keys() if k.startswith("ids.")]
            counts[split][0] += len(keys)
            counts[split][1] += sum(h.get_slice(k).get_shape()[0] for k in keys)
    record = {"target": target.name, "layer_ids": layer_ids, "num_prompts": args.num_prompts,
              "new_tokens": args.new_tokens, "batch": args.batch, "threads": torch.get_num_threads(),
              "decoding": "2 of 3 batches greedy, 1 of 3 sampled at T=0.7; held-out greedy",
              "train_sequences": counts["train"][0], "train_tokens": counts["train"][1],
              "heldout_sequences": counts["heldout"][0], "heldout_tokens": counts["heldout"][1],
              # a resumed run adds its time to the earlier runs' (the data's total cost)
              "seconds": round(previous.get("seconds", 0.0) + seconds, 1)}
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"data in {out_dir} ({seconds:.0f} s): {json.dumps(record)}")


if __name__ == "__main__":
    main()
