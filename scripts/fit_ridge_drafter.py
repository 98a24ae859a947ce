"""Fit the ridge drafter of the embedded default target and write it to fixtures/drafters/.

1. The target (SmolLM2-135M-Instruct) writes its own training text: it answers the prompts
   below by sampling (temperature 0.7, fixed seed), up to --new-tokens tokens each.
2. One forward per sequence gives the last-layer hidden states; `fit_ridge_heads` fits the
   per-offset heads in closed form; a temperature per offset is chosen on the training
   sequences (grid search on the log-likelihood of the real next tokens).
3. The last --held-out sequences measure the top-1 / top-8 hit rate per draft position.

    python scripts/fit_ridge_drafter.py [--out fixtures/drafters/smollm2_ridge_b16.safetensors]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm.auto import tqdm

from ddtree_lab.models import RidgeDrafter, default_drafter_path, fit_ridge_heads
from ddtree_lab.models import cache_dir, load_default_target

PROMPTS = [
    "Explain how photosynthesis works.", "Write a short story about a lighthouse keeper.",
    "What are the main causes of inflation?", "Give me three tips for learning a new language.",
    "Describe the water cycle to a child.", "Write a Python function that reverses a string.",
    "What is the difference between a virus and a bacterium?", "Summarize the plot of Romeo and Juliet.",
    "How do airplanes stay in the air?", "Write a poem about autumn leaves.",
    "What are the benefits of regular exercise?", "Explain what a neural network is.",
    "How does a refrigerator keep food cold?", "Write a letter thanking a teacher.",
    "What is the capital of France and why is it famous?", "Describe a healthy breakfast.",
    "Explain the rules of chess briefly.", "What causes earthquakes?",
    "Write a recipe for pancakes.", "How do vaccines work?",
    "Describe the solar system.", "What is climate change?",
    "Give advice for a job interview.", "Explain how the internet works.",
    "Write a dialogue between a cat and a dog.", "What is the Pythagorean theorem?",
    "How do bees make honey?", "Describe the city of Tokyo.",
    "Why is sleep important?", "Explain what DNA is.",
    "Write a haiku about the ocean.", "How does a bicycle work?",
    "What are prime numbers?", "Describe how to plant a tree.",
    "What is the history of the printing press?", "Explain supply and demand.",
    "List five fun facts about elephants.", "How do you make a cup of tea?",
    "What is machine learning used for?", "Describe a rainy day in the mountains.",
]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(default_drafter_path()))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--ridge", type=float, default=1e-3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--held-out", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 behaves best on a busy 2-core machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    target = load_default_target()
    tok = target.tokenizer
    # The generated text is cached: re-fitting (other rank / ridge) does not regenerate it.
    text_cache = cache_dir() / f"ridge_fit_text_seed{args.seed}_{args.new_tokens}.json"
    sequences = json.loads(text_cache.read_text()) if text_cache.exists() else []
    for i, prompt in enumerate(tqdm(PROMPTS[len(sequences):], desc="target writes its training text"),
                               start=len(sequences)):
        torch.manual_seed(args.seed * 1000 + i)
        ids = target.encode_prompt(prompt)
        out = target.model.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=True,
                                    temperature=0.7, top_k=0, top_p=1.0, pad_token_id=tok.eos_token_id)
        sequences.append(out[0].tolist())
        text_cache.parent.mkdir(parents=True, exist_ok=True)
        text_cache.write_text(json.dumps(sequences))
    hidden, embeds = [], []
    with torch.no_grad():
        for seq in tqdm(sequences, desc="target features"):
            _, h, _ = target.prefill(seq)
            hidden.append(h)
            embeds.append(target.embed(torch.tensor(seq)))
    train = slice(0, len(sequences) - args.held_out)
    test = slice(len(sequences) - args.held_out, len(sequences))
    basis, heads = fit_ridge_heads(hidden[train], embeds[train], args.block_size, args.rank, args.ridge)
    steps = args.block_size - 1

    def predicted(seq_h, seq_e, j):
        x = torch.cat([seq_h[:-1], seq_e[1:], torch.ones(seq_h.shape[0] - 1, 1)], 1) @ basis
        return target.lm_head(x @ heads[j])  # row t-1 predicts token t + j (t from 1)

    temperatures = torch.ones(steps)
    grid = torch.tensor([0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0])
    hits1, hits8, counts = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    for j in range(steps):
        nll = torch.zeros(len(grid))
        for seq, h, e in zip(sequences[train], hidden[train], embeds[train]):
            labels = torch.tensor(seq[1 + j + 1 :])  # token t + j + 1 ... for rows t = 1..
            logits = predicted(h, e, j)[: len(labels)]
            for g, temp in enumerate(grid):
                nll[g] += torch.nn.functional.cross_entropy(logits / temp, labels, reduction="sum")
        temperatures[j] = grid[int(nll.argmin())]
        for seq, h, e in zip(sequences[test], hidden[test], embeds[test]):
            labels = torch.tensor(seq[1 + j + 1 :])
            top = predicted(h, e, j)[: len(labels)].topk(8, -1).indices
            hits1[j] += (top[:, 0] == labels).sum()
            hits8[j] += (top == labels[:, None]).any(-1).sum()
            counts[j] += len(labels)
    record = {
        "what": "per-offset ridge heads for SmolLM2-135M-Instruct (scripts/fit_ridge_drafter.py)",
        "inputs": "[last-layer post-norm hidden before the anchor; anchor embedding; 1] -> rank-r basis",
        "targets": "last-layer post-norm hidden state predicting each of the L-1 positions after the anchor",
        "block_size": args.block_size, "rank": args.rank, "ridge": args.ridge,
        "training_text": f"{len(PROMPTS) - args.held_out} prompts answered by the target itself, temperature 0.7, "
                         f"up to {args.new_tokens} new tokens, seed {args.seed}",
        "training_tokens": sum(len(s) for s in sequences[train]),
        "held_out_tokens": sum(len(s) for s in sequences[test]),
        "temperatures": [round(float(t), 3) for t in temperatures],
        "held_out_top1_hit_rate": [round(float(a / c), 3) for a, c in zip(hits1, counts)],
        "held_out_top8_hit_rate": [round(float(a / c), 3) for a, c in zip(hits8, counts)],
        "seconds": round(time.time() - t0, 1),
        "torch": torch.__version__,
    }
    drafter = RidgeDrafter(target, basis, heads, temperatures, name="smollm2-ridge-b16")
    drafter.save(args.out, record)
    print(f"wrote {args.out}")
    print("top-8 hit rate per draft position:", record["held_out_top8_hit_rate"])
    print("top-1 hit rate per draft position:", record["held_out_top1_hit_rate"])


if __name__ == "__main__":
    main()
