"""One batched tree forward per step: equal to per-request forwards, per-path causal forwards and
per-request runs; recording levels record the same decisions."""

import pytest
import torch

import ddtree_lab as dl

pytestmark = pytest.mark.slow

PROMPTS = ["Name three rivers in Europe.", "Hi", "Write a short poem about the sea and the sky, please."]


def _trees(target, prompts, budgets, seed=0, depth=5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(prompts), depth, target.vocab_size, generator=g) * 4
    ids, lp = dl.draft_topk_from_logits(logits, k=4)
    anchors = torch.randint(0, 1000, (len(prompts),), generator=g)
    tree = dl.build_tree(ids, lp, anchors, budgets)
    return tree, dl.compile_retrieve(tree, torch.tensor([len(p) for p in prompts]))


def _path(tree, b, i):
    out = [i]
    while out[-1] > 0:
        out.append(int(tree.parents[b, out[-1]]))
    return out[::-1]


def test_batched_tree_forward_equals_per_request_and_per_path_forwards(target):
    prompts = [target.encode_prompt(p) for p in PROMPTS]
    tree, vi = _trees(target, prompts, [10, 3, 6])
    state, feats, last = target.prefill_batch(prompts, [3, 29])
    fwd = target.tree_forward_batch(state, vi, [3, 29])
    assert fwd.logits.shape == (3, vi.num_rows, target.vocab_size)
    assert fwd.hidden.shape == (3, vi.num_rows, 2 * target.hidden_size)
    worst_req = worst_path = worst_prefill = 0.0
    for b, p in enumerate(prompts):
        cache, f1, l1 = target.prefill(p, [3, 29])
        worst_prefill = max(worst_prefill, float((l1[-1] - last[b]).abs().max()), float((f1 - feats[b]).abs().max()))
        one = target.tree_forward(cache, vi, b)
        n = int(vi.num_nodes[b])
        worst_req = max(worst_req, float((one.logits - fwd.logits[b, :n]).abs().max()))
        for i in range(n):
            tokens = p + [int(tree.node_token_ids[b, j]) for j in _path(tree, b, i)]
            _, _, ref = target.prefill(tokens)
            worst_path = max(worst_path, float((fwd.logits[b, i] - ref[-1]).abs().max()))
    print(f"max |batched - per-request tree logits| {worst_req:.2e}, |batched - per-path causal| {worst_path:.2e}, "
          f"prefill logits / features {worst_prefill:.2e}")
    assert worst_req < 1e-3 and worst_path < 1e-3 and worst_prefill < 1e-3


def test_keep_paths_and_drop_rows_leave_exactly_each_accepted_path(target):
    prompts = [target.encode_prompt(p) for p in PROMPTS]
    tree, vi = _trees(target, prompts, [10, 3, 6], seed=1)
    state, _, _ = target.prefill_batch(prompts)
    target.tree_forward_batch(state, vi)
    paths = [_path(tree, b, int(tree.depths[b, : int(tree.num_nodes[b])].argmax())) for b in range(3)]
    paths[1] = [0]  # the root only
    target.keep_paths(state, paths, vi.num_rows)
    assert state.lengths.tolist() == [len(p) + len(q) for p, q in zip(prompts, paths)]
    assert state.cache.get_seq_length() == int(state.lengths.max())
    target.drop_rows(state, [2, 0])  # request 1 finished; the others keep their rows
    assert state.lengths.tolist() == [len(prompts[2]) + len(paths[2]), len(prompts[0]) + len(paths[0])]
    nxt = [42, 43]
    one = dl.compile_retrieve(dl.build_tree(torch.zeros(2, 1, 1, dtype=torch.int64), torch.zeros(2, 1, 1),
                                            torch.tensor(nxt), 0), state.lengths.clone())
    got = target.tree_forward_batch(state, one).logits[:, 0]
    for row, b in enumerate([2, 0]):
        tokens = prompts[b] + [int(tree.node_token_ids[b, j]) for j in paths[b]] + [nxt[row]]
        _, _, ref = target.prefill(tokens)
        assert float((got[row] - ref[-1]).abs().max()) < 1e-3


def test_greedy_batch_of_different_lengths_equals_plain_greedy_at_every_level(target, drafter):
    ids = [target.encode_prompt(p) for p in PROMPTS]
    plain = target.greedy_decode_batch(ids, 12)
    assert plain == [target.greedy_decode(p, 12) for p in ids]
    for level in ("off", "light"):
        session = dl.LiveSession(target, drafter, budget=8, record=level)
        run = session.run(PROMPTS, max_new_tokens=12)
        assert [run.generated_tokens(b) for b in range(3)] == plain, level
        assert (len(run.steps) == 0) == (level == "off")
        assert set(session.stage_totals) == set(dl.session.STAGES) and session.num_steps > 0
        for s in run.steps:
            assert set(s.timings) == set(dl.session.STAGES)
            dl.replay(s)


def test_mixed_batch_records_the_decisions_of_per_request_runs(target, drafter):
    params = [dl.SamplingParams(temperature=0.8, seed=11), dl.SamplingParams(temperature=0.0, seed=12),
              dl.SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=13)]
    batch = dl.LiveSession(target, drafter, budget=8, sampling=params).run(PROMPTS, max_new_tokens=10)
    for b, p in enumerate(params):
        alone = dl.LiveSession(target, drafter, budget=8, sampling=[p]).run([PROMPTS[b]], max_new_tokens=10)
        assert alone.generated_tokens(0) == batch.generated_tokens(b)
        mine = batch.for_request(b)
        assert len(mine) == len(alone.steps)
        worst = 0.0
        for s, a in zip(mine, alone.steps):
            assert torch.equal(s.coins, a.coins) and s.final_coin == a.final_coin
            assert [(d.node, d.token, d.verdict) for d in s.decisions] == [(d.node, d.token, d.verdict) for d in a.decisions]
            worst = max([worst] + [abs(d.target_prob - e.target_prob) for d, e in zip(s.decisions, a.decisions)])
        print(f"request {b}: {len(mine)} steps, same decisions; max |target p| difference {worst:.2e}")


def test_light_level_records_the_rows_the_verifier_read(target, drafter):
    params = [dl.SamplingParams(temperature=0.9, seed=5), dl.SamplingParams(temperature=0.0, seed=6)]
    full = dl.LiveSession(target, drafter, budget=8, sampling=params, record="full").run(PROMPTS[:2], max_new_tokens=8)
    light = dl.LiveSession(target, drafter, budget=8, sampling=params, record="light")
    assert light.verify_backend == "torch-lazy"
    run = light.run(PROMPTS[:2], max_new_tokens=8)
    assert len(run.steps) == len(full.steps)
    for s, f in zip(run.steps, full.steps):
        assert [(d.node, d.verdict) for d in s.decisions] == [(d.node, d.verdict) for d in f.decisions]
        read = {d.parent for d in s.decisions} | {s.bonus.node}
        # light stores no top-M rows (make_step_trace): those fields are None and named missing;
        # child_probs hold the rows the walk read (children of visited nodes), NaN elsewhere
        assert s.top_probs is None and s.top_token_ids is None and "top_probs" in s.missing()
        for i in range(1, s.num_nodes):
            if int(s.parents[i]) in read:
                assert abs(float(s.child_probs[i]) - float(f.child_probs[i])) < 1e-4
            else:
                assert torch.isnan(s.child_probs[i])
        if s.bonus_token >= 0:
            torch.testing.assert_close(s.final_row_prefix, f.final_row_prefix, atol=1e-4, rtol=1e-3)
        for d in s.decisions:
            assert abs(float(s.child_probs[d.node]) - float(f.child_probs[d.node])) < 1e-4
        dl.replay(s)
    with pytest.raises(ValueError, match="record must be one of"):
        dl.LiveSession(target, drafter, record="some")
