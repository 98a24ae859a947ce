"""Write hand-made DDTree reference tree traces under fixtures/ddtree_reference/.

The files have the layout ``ddtree_generate(..., save_tree_traces=True)`` of the reference
implementation (GitHub liranringel/ddtree, ``ddtree.py``) produces, without importing it:
per round ``accepted_indices`` and ``tree.node_token_ids / node_depths / parents`` (root not
stored, parents include the root's -1), ``acceptance_lengths`` = ``len(accepted_indices)``,
``stage_times`` summed per request, ``round_timestamps`` cumulative, ``output_ids`` ``[1, T]``.

The trees come from a best-first heap over made-up drafter marginals (log-probs falling with
rank, flatter with depth) and a made-up target that mostly agrees with the drafter's top
token; every number is drawn from ``random.Random(seed)``, so the files are reproducible and
:func:`make_requests` gives the tests the exact values written.

Files:
  fork_traces.json      one request, the fields research forks json.dump (dataset, sample,
                        tree_budget, acceptance_lengths, round_trees)
  generate_result.jsonl two requests, every field of the result namespace, output_ids as a list
  generate_result.pt    the same two requests, torch.save of plain dicts (output_ids a tensor)

Usage: python scripts/make_reference_fixture.py [--out fixtures/ddtree_reference]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from pathlib import Path

BLOCK_SIZE = 8  # anchor + 7 draft positions
VOCAB = 151_936  # a Qwen3-sized vocabulary (token ids only; no tokenizer involved)
STAGES = ("draft", "tree_build", "tree_compile", "verify", "commit",
          "tree_build_copy", "tree_build_heap", "tree_build_visibility")


def _marginals(rng: random.Random, depth_limit: int, topk: int) -> tuple[list[list[int]], list[list[float]]]:
    """Per depth the drafter's top-k tokens and log-probs (descending)."""
    tokens, logps = [], []
    for d in range(depth_limit):
        # the top token's probability falls with depth; the rest decays geometrically
        p0 = max(0.25, 0.9 - 0.08 * d + rng.uniform(-0.05, 0.05))
        rest = [(1 - p0) * (0.55 ** k) for k in range(1, topk)]
        probs = [p0] + rest
        logps.append([math.log(p) for p in probs])
        tokens.append(rng.sample(range(100, VOCAB), topk))
    return tokens, logps


def build_tree(tokens, logps, budget: int) -> tuple[list[int], list[int], list[int]]:
    """Best-first top-``budget`` prefixes: pop a node, push its next sibling and first child.

    Returns ``(node_token_ids [n], node_depths [n], parents [n + 1])`` in pop order, the
    reference's storage (root excluded from the first two, included in parents)."""
    topk, depth_limit = len(tokens[0]), len(tokens)
    heap = [(-logps[0][0], 0, 0, 1, 0)]  # (-logw, tiebreak, parent, depth, rank)
    node_tokens, node_depths, parents = [], [], [-1]
    counter = 1
    while heap and len(node_tokens) < budget:
        neg, _, parent, depth, rank = heapq.heappop(heap)
        logw = -neg
        index = len(node_tokens) + 1
        node_tokens.append(tokens[depth - 1][rank])
        node_depths.append(depth)
        parents.append(parent)
        if rank + 1 < topk:
            w = logw - logps[depth - 1][rank] + logps[depth - 1][rank + 1]
            heapq.heappush(heap, (-w, counter, parent, depth, rank + 1))
            counter += 1
        if depth < depth_limit:
            heapq.heappush(heap, (-(logw + logps[depth][0]), counter, index, depth + 1, 0))
            counter += 1
    return node_tokens, node_depths, parents


def _walk(rng: random.Random, node_tokens, parents, tokens_by_depth) -> tuple[list[int], int]:
    """A made-up target: at each node it emits the drafter's top token 70% of the time, the
    second 15%, else a token outside the tree. Follow the tree while the emitted token is a child."""
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(parents)):
        children.setdefault(parents[i], {})[node_tokens[i - 1]] = i
    path, node, depth = [0], 0, 0
    while True:
        u = rng.random()
        if depth < len(tokens_by_depth) and u < 0.7:
            tok = tokens_by_depth[depth][0]
        elif depth < len(tokens_by_depth) and u < 0.85:
            tok = tokens_by_depth[depth][1]
        else:
            tok = rng.randrange(100, VOCAB)
        nxt = children.get(node, {}).get(tok)
        if nxt is None:
            return path, tok
        path.append(nxt)
        node, depth = nxt, depth + 1


def make_request(seed: int, rounds: int, budget: int, prompt_len: int, extra: dict | None = None) -> dict:
    """Every field ``ddtree_generate`` returns, as plain Python (``output_ids`` a ``[1, T]`` list)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(100, VOCAB) for _ in range(prompt_len)]
    first = rng.randrange(100, VOCAB)  # the token the prefill sampled: round 0's root
    out = prompt + [first]
    round_trees, lengths, stamps = [], [], []
    stage_times = {s: 0.0 for s in STAGES}
    clock = 0.0
    for r in range(rounds):
        tokens, logps = _marginals(rng, BLOCK_SIZE - 1, topk=min(budget, 4))
        node_tokens, node_depths, parents = build_tree(tokens, logps, budget)
        accepted, bonus = _walk(rng, node_tokens, parents, tokens)
        out.extend(node_tokens[a - 1] for a in accepted[1:])
        out.append(bonus)  # the next round's root
        times = {"draft": rng.uniform(0.004, 0.006), "tree_build": rng.uniform(0.0008, 0.0012),
                 "tree_compile": rng.uniform(0.0002, 0.0003), "verify": rng.uniform(0.011, 0.014),
                 "commit": rng.uniform(0.0005, 0.0008)}
        sub = {"tree_build_copy": times["tree_build"] * 0.3, "tree_build_heap": times["tree_build"] * 0.5,
               "tree_build_visibility": times["tree_build"] * 0.15}
        for k, v in {**times, **sub}.items():
            if not (k == "draft" and r == 0):  # the reference does not count round 0's draft (its prefill)
                stage_times[k] += v
        clock += sum(times.values())
        stamps.append(round(clock, 9))
        lengths.append(len(accepted))
        round_trees.append({"accepted_indices": accepted,
                            "tree": {"node_token_ids": node_tokens, "node_depths": node_depths, "parents": parents}})
    n_out = len(out) - prompt_len
    decode_time = stamps[-1]
    result = {"output_ids": [out], "num_input_tokens": prompt_len, "num_output_tokens": n_out,
              "time_to_first_token": round(rng.uniform(0.03, 0.05), 6),
              "time_per_output_token": decode_time / n_out, "acceptance_lengths": lengths,
              "decode_rounds": len(lengths), "stage_times": stage_times, "round_timestamps": stamps,
              "round_trees": round_trees}
    result.update(extra or {})
    return result


def make_requests() -> dict[str, list[dict]]:
    """The requests of each file, keyed by file name (the JSON fork file keeps only its fields)."""
    a = make_request(seed=1, rounds=4, budget=12, prompt_len=9)
    b = make_request(seed=2, rounds=5, budget=16, prompt_len=6)
    c = make_request(seed=3, rounds=3, budget=10, prompt_len=7)
    fork = {"dataset": "gsm8k", "sample": 0, "tree_budget": 10,
            "acceptance_lengths": c["acceptance_lengths"], "round_trees": c["round_trees"]}
    return {"fork_traces.json": [fork], "generate_result.jsonl": [a, b], "generate_result.pt": [a, b]}


def write(out_dir: Path) -> list[Path]:
    """Write the three files; returns their paths."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    reqs = make_requests()
    paths = []
    p = out_dir / "fork_traces.json"
    p.write_text(json.dumps(reqs["fork_traces.json"][0]))
    paths.append(p)
    p = out_dir / "generate_result.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in reqs["generate_result.jsonl"]))
    paths.append(p)
    p = out_dir / "generate_result.pt"
    plain = [{**r, "output_ids": torch.tensor(r["output_ids"], dtype=torch.long)} for r in reqs["generate_result.pt"]]
    torch.save({"responses": [{"ddtree_tb12": plain[0]}, {"ddtree_tb16": plain[1]}], "block_size": BLOCK_SIZE,
                "args": {"temperature": 0.0, "tree_budget": "12,16", "dataset": "gsm8k"}}, p)
    paths.append(p)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fixtures/ddtree_reference", help="output directory")
    args = ap.parse_args()
    for p in write(Path(args.out)):
        print(f"wrote {p} ({p.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
