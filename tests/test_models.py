"""The target adapter on the embedded default (SmolLM2-135M-Instruct, fp32, CPU)."""

import pytest
import torch

import ddtree_lab as dl

pytestmark = pytest.mark.slow


def _random_tree(target, prefix_len, seed, budget=24, depth=6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, depth, target.vocab_size, generator=g) * 4
    ids, lp = dl.draft_topk_from_logits(logits, k=4)
    tree = dl.build_tree(ids, lp, torch.tensor([int(torch.randint(0, 1000, (1,), generator=g))]), budget)
    return tree, dl.compile_retrieve(tree, prefix_len)


def _path(tree, i):
    out = [i]
    while out[-1] > 0:
        out.append(int(tree.parents[0, out[-1]]))
    return out[::-1]


def test_tree_forward_equals_causal_forward_of_every_path(target):
    prompt = target.encode_prompt("Name three rivers in Europe.")
    cache, _, _ = target.prefill(prompt)
    tree, vi = _random_tree(target, len(prompt), seed=0)
    fwd = target.tree_forward(cache, vi)
    worst = 0.0
    for i in range(int(tree.num_nodes[0])):
        path = _path(tree, i)
        tokens = prompt + [int(tree.node_token_ids[0, j]) for j in path]
        _, _, ref = target.prefill(tokens)
        worst = max(worst, float((fwd.logits[i] - ref[-1]).abs().max()))
    print(f"max |tree logits - causal logits| over {int(tree.num_nodes[0])} nodes: {worst:.2e}")
    assert worst < 1e-3


def test_keep_path_leaves_exactly_the_accepted_path_in_the_cache(target):
    prompt = target.encode_prompt("Count to five.")
    cache, _, _ = target.prefill(prompt)
    tree, vi = _random_tree(target, len(prompt), seed=1)
    target.tree_forward(cache, vi)
    deepest = int(tree.depths[0].argmax())
    path = _path(tree, deepest)
    target.keep_path(cache, len(prompt), path)
    assert cache.get_seq_length() == len(prompt) + len(path)
    nxt = 42
    with torch.no_grad():
        step = target.model(torch.tensor([[nxt]]), **target._cache_arg(cache), use_cache=True).logits[0, -1]
    _, _, ref = target.prefill(prompt + [int(tree.node_token_ids[0, j]) for j in path] + [nxt])
    assert float((step - ref[-1]).abs().max()) < 1e-3


def test_tree_forward_rejects_a_stale_cache(target):
    prompt = target.encode_prompt("Hi")
    cache, _, _ = target.prefill(prompt)
    _, vi = _random_tree(target, len(prompt) + 3, seed=2)
    with pytest.raises(ValueError, match="request 0: root position"):
        target.tree_forward(cache, vi)


def test_default_target_facts(target):
    meta = target.metadata()
    assert meta["vocab_size"] == 49152 and meta["num_layers"] == 30 and meta["hidden_size"] == 576
    assert sum(p.numel() for p in target.model.parameters()) == pytest.approx(134.5e6, rel=0.01)
