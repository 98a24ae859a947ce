"""Self-distillation data for the DFlash drafter of the embedded default target.

The target (SmolLM2-135M-Instruct, fp32, CPU) answers the training prompts of
``fixtures/drafters/dflash_prompts.json`` with batched ``model.generate`` (left padding; two
batches greedy, every third batch sampled at T = 0.7), and forward hooks on the chosen decoder
layers record their outputs while it generates, so the features of every token come for free
(layer ``l``'s output is HF ``hidden_states[l + 1]``, z-lab's convention). Each batch is written
to ``<cache>/dflash_data/batch_XXXX.safetensors`` (token ids and fp16 features, padding
stripped), so an interrupted run resumes where it stopped.

    python scripts/make_dflash_data.py [--num-prompts 320] [--new-tokens 144] [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
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
    ap.add_argument("--num-prompts", type=int, default=320)
    ap.add_argument("--new-tokens", type=int, default=144)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--num-draft-layers", type=int, default=5,
                    help="how many target layers feed the drafter (z-lab's build_target_layer_ids)")
    ap.add_argument("--held-out", type=int, default=16, help="held-out prompts to generate (greedy)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    target = load_default_target()
    n_layers = int(target.model.config.num_hidden_layers)
    layer_ids = build_target_layer_ids(n_layers, args.num_draft_layers)
    prompts = json.loads(PROMPTS.read_text())
    out_dir = data_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    jobs = [("train", prompts["train"][i : i + args.batch], i // args.batch)
            for i in range(0, args.num_prompts, args.batch)]
    jobs += [("heldout", prompts["held_out"][: args.held_out], 0)]
    for split, batch, k in tqdm(jobs, desc="target generates (batches)"):
        path = out_dir / f"{split}_{k:04d}.safetensors"
        if path.exists():
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
    print(f"data in {out_dir} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
