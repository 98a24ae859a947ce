"""Tree policies (ddtree_lab.analysis.policies) and their exact counterfactuals on recorded
steps (ddtree_lab.analysis.counterfactual), issue #27."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ddtree_lab.analysis.counterfactual import (
    expected_accept_length,
    path_keys,
    recorded_node_probs,
    rescore_trees,
    run_counterfactuals,
    step_counterfactuals,
    step_prefix_ids,
    summarize,
    union_tree,
)
from ddtree_lab.analysis.policies import (
    POLICIES,
    CostModel,
    PolicyContext,
    capped_best_first_policy,
    cost_aware_policy,
    get_policy,
)
from ddtree_lab.analysis.stats import expected_accept_length as recorded_expected_accepted
from ddtree_lab.buffers import compile_retrieve, decode_retrieve
from ddtree_lab.build import build_tree_reference
from ddtree_lab.io import load
from ddtree_lab.step import DraftTopK
from ddtree_lab.verify.reference import verify_sampled
from ddtree_lab.verify.whatif import walk_request

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "traces"
SAMPLED = FIX / "smollm2_t08_b32.ddtrace.safetensors"
GREEDY = FIX / "smollm2_greedy_b32.ddtrace.safetensors"
CTX = PolicyContext(cost_model=CostModel((1, 11), {1: (1.0, 2.0)}))  # 1 s + 0.1 s per extra row


def _draft(probs, base=10):
    p = torch.tensor(probs, dtype=torch.float32)
    tok = torch.tensor([[base * (d + 1) + j for j in range(p.shape[1])] for d in range(p.shape[0])])
    return DraftTopK(tok, p.log())


# depth 1: 10 (.6), 11 (.3), 12 (.1); depth 2: 20 (.5), 21 (.4), 22 (.1); depth 3: 30 (.9), ...
PAPER = _draft([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]])


def _tree(t):
    n = int(t.num_nodes[0])
    return t.node_token_ids[0, :n].tolist(), t.parents[0, :n].tolist()


# -- each policy on a draft whose tree a reader can check on paper ------------------------------

def test_ddtree_is_the_most_probable_prefixes():
    # path weights: 10 .6, 10-20 .3, 11 .3, 10-20-30 .27, 10-21 .24 ...
    assert _tree(get_policy("ddtree")(PAPER, 5, 4, None)) == ([5, 10, 20, 11, 30], [-1, 0, 1, 0, 2])
    ref = build_tree_reference(PAPER.token_ids[None], PAPER.logprobs[None], torch.tensor([5]), 5)
    assert _tree(get_policy("ddtree")(PAPER, 5, 5, None)) == _tree(ref)


def test_chain_is_the_top1_path_and_budget_is_its_depth():
    assert _tree(get_policy("chain")(PAPER, 5, 2, None)) == ([5, 10, 20], [-1, 0, 1])
    assert _tree(get_policy("chain")(PAPER, 5, 9, None)) == ([5, 10, 20, 30], [-1, 0, 1, 2])  # L-1 = 3


def test_beams_keep_k_best_per_depth():
    # beam2: depth 1 keeps 10, 11; depth 2 the best two of {10,11} x {20,21,22}: 10-20 .3, 10-21 .24
    assert _tree(get_policy("beam2")(PAPER, 5, 4, None)) == ([5, 10, 20, 11, 21], [-1, 0, 1, 0, 1])
    # beam4 with K = 3: depth 1 takes all three, then one node at depth 2 (10-20)
    assert _tree(get_policy("beam4")(PAPER, 5, 4, None)) == ([5, 10, 20, 11, 12], [-1, 0, 1, 0, 0])


def test_capped_best_first_caps_each_depth():
    d = _draft([[0.4, 0.3, 0.3], [0.5, 0.5, 0.0]])
    # DDTree takes the three depth-1 nodes; a cap of 2 takes 10, 11 and then 10-20 (.2), in tree order
    assert _tree(get_policy("ddtree")(d, 1, 3, None)) == ([1, 10, 11, 12], [-1, 0, 0, 0])
    assert _tree(capped_best_first_policy(2)(d, 1, 3, None)) == ([1, 10, 11, 20], [-1, 0, 0, 1])


def test_cost_policy_picks_the_best_tokens_per_second():
    # rows' weights in DDTree order: .6 .3 .3 .27; round cost 1 + slope * m
    # slope .1: rates 1, 1.45, 1.58, 1.69, 1.76 -> all 4 nodes; slope .5: 1, 1.07, .95, ... -> 1 node
    cheap = cost_aware_policy(PAPER, 5, 4, CTX)
    dear = cost_aware_policy(PAPER, 5, 4, PolicyContext(cost_model=CostModel((1, 3), {1: (1.0, 2.0)})))
    assert _tree(cheap) == ([5, 10, 20, 11, 30], [-1, 0, 1, 0, 2])
    assert _tree(dear) == ([5, 10], [-1, 0])


def test_cost_model_interpolates_and_scales():
    cm = CostModel((1, 11), {1: (1.0, 2.0), 4: (2.0, 6.0)}, draft_seconds=0.5)
    assert cm.forward_seconds(6) == pytest.approx(1.5)
    assert cm.forward_seconds(21) == pytest.approx(3.0)  # the last segment extrapolated
    assert cm.forward_seconds(6, 8) == pytest.approx(8.0)  # nearest measured bs = 4, scaled x2
    assert cm.round_seconds(1) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="strictly increasing"):
        CostModel((4, 2), {1: (1.0, 1.0)})


def test_a_cost_model_round_trips_through_json_and_a_bad_file_names_its_field():
    import json

    cm = CostModel((1, 11), {1: (1.0, 2.0), 8: (2.0, 6.0)}, draft_seconds=0.5, device="cuda:0")
    back = CostModel.from_dict(json.loads(json.dumps(cm.to_dict())))
    assert back == cm and back.forward_seconds(6, 8) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="'seconds' is missing"):
        CostModel.from_dict({"num_rows": [1, 2]})
    with pytest.raises(ValueError, match="do not parse"):
        CostModel.from_dict({"num_rows": [1, 2], "seconds": {"1": ["fast", 2.0]}})
    with pytest.raises(ValueError, match="draft_seconds must be a finite number >= 0"):
        CostModel.from_dict({"num_rows": [1], "seconds": {"1": [1.0]}, "draft_seconds": -1})
    with pytest.raises(ValueError, match="batch sizes must be >= 1"):
        CostModel.from_dict({"num_rows": [1], "seconds": {"0": [1.0]}})
    with pytest.raises(ValueError, match=r"seconds\[1\] must hold 2"):
        CostModel.from_dict({"num_rows": [1, 2], "seconds": {"1": [1.0]}})
    with pytest.raises(ValueError, match="start at >= 1"):
        CostModel.from_dict({"num_rows": [0, 5], "seconds": {"1": [1.0, 2.0]}})
    with pytest.raises(ValueError, match="finite non-negative seconds"):
        CostModel.from_dict({"num_rows": [1, 5], "seconds": {"1": [1.0, float("inf")]}})
    with pytest.raises(ValueError, match="finite number"):
        CostModel.from_dict({"num_rows": [1], "seconds": {"1": [1.0]}, "draft_seconds": float("nan")})
    with pytest.raises(ValueError, match="JSON object"):
        CostModel.from_dict([1, 2])  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("budget", [0, 1, 3, 7, 20])
def test_every_policy_round_trips_compile_and_decode(name, budget):
    g = torch.Generator().manual_seed(budget)
    p = torch.rand(6, 4, generator=g).sort(dim=1, descending=True).values
    p = p / p.sum(dim=1, keepdim=True) * 0.9
    tree = get_policy(name)(DraftTopK(torch.randperm(40, generator=g)[:24].view(6, 4), p.log()), 3, budget, CTX)
    n = int(tree.num_nodes[0])
    assert n - 1 <= budget
    vi = compile_retrieve(tree, 17)
    parents, depths = decode_retrieve(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes)
    assert torch.equal(parents[0, :n], tree.parents[0, :n])
    assert torch.equal(depths[0, :n], tree.depths[0, :n])
    lw = tree.node_logws[0, :n]
    for i in range(1, n):  # parents first, siblings in descending log-weight
        assert tree.parents[0, i] < i
        sibs = [j for j in range(1, n) if tree.parents[0, j] == tree.parents[0, i]]
        assert all(lw[a] >= lw[b] for a, b in zip(sibs, sibs[1:]))


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="budget"):
        get_policy("ddtree")(PAPER, 5, -1, None)
    with pytest.raises(ValueError, match="draft.token_ids"):
        get_policy("chain")(DraftTopK(PAPER.token_ids[:, :2], PAPER.logprobs), 5, 2, None)
    with pytest.raises(KeyError, match="policy: unknown name 'wide'"):
        get_policy("wide")
    with pytest.raises(ValueError, match="cost_model"):
        get_policy("cost")(PAPER, 5, 4, None)
    with pytest.raises(ValueError, match="sorted descending"):
        get_policy("beam2")(DraftTopK(PAPER.token_ids, PAPER.logprobs.flip(1)), 5, 2, None)


# -- exact counterfactual = mean of sampled verifies -----------------------------------------------

def _rows_for(tree, table, vocab):
    """[1, N, V] target rows of ``tree``'s nodes from per-path rows ``table``."""
    keys = path_keys(tree)
    return torch.stack([table[k] for k in keys])[None]


def test_exact_expected_tau_equals_mean_of_sampled_verifies():
    vocab = 40
    trees = {name: get_policy(name)(PAPER, 5, 6, CTX) for name in POLICIES}
    union = union_tree(list(trees.values()))
    g = torch.Generator().manual_seed(27)
    table = {}
    for k in path_keys(union):  # rows that put real mass on the drafted tokens
        row = torch.rand(vocab, generator=g) ** 4
        d = len(k)  # the drafted tokens of the next depth (10 (d + 1) + j) get most of the mass
        if d < PAPER.token_ids.shape[0]:
            row[PAPER.token_ids[d]] += 8 * torch.rand(3, generator=g)
        table[k] = row / row.sum()
    for name, tree in trees.items():
        n = int(tree.num_nodes[0])
        rows = _rows_for(tree, table, vocab)
        tok, par = tree.node_token_ids[0].tolist(), tree.parents[0].tolist()
        child = [0.0] + [float(rows[0, par[i], tok[i]]) for i in range(1, n)]
        exact = expected_accept_length(tree, child)
        vi = compile_retrieve(tree, 0)
        cg = torch.Generator().manual_seed(1)
        taus = []
        for _ in range(2000):
            out = verify_sampled(vi, rows, torch.rand(1, n, generator=cg), torch.rand(1, generator=cg), validate=False)
            taus.append(float(out.tau()[0]))
        t = torch.tensor(taus, dtype=torch.float64)
        se = float(t.std()) / math.sqrt(len(t))
        assert abs(float(t.mean()) - exact) <= 4 * se + 1e-9, (name, exact, float(t.mean()), se)
        assert exact > 1.3 and se > 0.01  # trees that accept: the walk's length does vary


# -- recorded steps, no model ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sampled_run():
    return load(SAMPLED)


@pytest.fixture(scope="module")
def greedy_run():
    return load(GREEDY)


def test_ddtree_at_the_recorded_budget_rebuilds_the_recorded_tree_and_uses_its_rows(sampled_run):
    budget = int(sampled_run.metadata["budget"])
    for s in sampled_run.steps[:10]:
        (r,) = step_counterfactuals(s, ["ddtree"], [budget])
        assert r.covered and r.reason is None
        assert _tree(r.tree) == _tree(s.tree)
        assert r.tau_sampled == pytest.approx(1.0 + recorded_expected_accepted(s), abs=1e-9)
        # the walk at the recorded coins, from the rows the counterfactual used, gives the recorded τ
        rec = recorded_node_probs(s)
        cp = [0.0] + [rec.sampled[k] for k in path_keys(s.tree)[1:]]
        ev = walk_request(s.retrieve_next_token, s.retrieve_next_sibling, s.node_token_ids, cp, s.coins.tolist(),
                          s.final_coin)
        assert sum(e.kind == "move" for e in ev) == s.accept_length


def test_greedy_run_expected_tau_is_the_recorded_accept_length(greedy_run):
    budget = int(greedy_run.metadata["budget"])
    for s in greedy_run.steps[:10]:
        (r,) = step_counterfactuals(s, ["ddtree"], [budget])
        assert r.tau_greedy == r.tau_sampled == s.accept_length + 1


def test_uncovered_trees_say_they_could_not_run(sampled_run):
    s = sampled_run.steps[0]
    rs = step_counterfactuals(s, ["chain", "ddtree"], [64], context=CTX)
    chain, dd = rs
    assert dd.tau_sampled is None and dd.reason and "no model" in dd.reason  # 64 nodes > the recorded 32
    rows = summarize(rs)
    assert rows[1].steps == 0 and rows[1].tau_sampled is None and "not scored" in rows[1].reason
    # a subtree of the recorded tree needs no forward
    (small,) = step_counterfactuals(s, ["ddtree"], [4])
    assert small.covered and small.tau_sampled is not None


def test_prefix_ids_end_at_the_root(sampled_run):
    s = sampled_run.steps[5]
    prefix = step_prefix_ids(sampled_run, s)
    assert len(prefix) == s.prefix_len
    no_ids = type(sampled_run)(metadata={"requests": []}, steps=[s])
    assert step_prefix_ids(no_ids, s) is None


# -- the real model -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_rescored_rows_match_the_recorded_ones_and_reproduce_the_walk(target, sampled_run):
    for s in sampled_run.steps[:3]:
        prefix = step_prefix_ids(sampled_run, s)
        fresh = rescore_trees(target, prefix, [s.tree], s.params)
        keys = path_keys(s.tree)
        got = torch.tensor([0.0] + [fresh.sampled[k] for k in keys[1:]], dtype=torch.float64)
        want = s.child_probs.double()
        assert torch.allclose(got[1:], want[1:], atol=2e-3), float((got - want)[1:].abs().max())
        ev = walk_request(s.retrieve_next_token, s.retrieve_next_sibling, s.node_token_ids, got.tolist(),
                          s.coins.tolist(), s.final_coin)
        assert sum(e.kind == "move" for e in ev) == s.accept_length
        assert expected_accept_length(s.tree, got.tolist()) == pytest.approx(
            1.0 + recorded_expected_accepted(s), abs=5e-3)


@pytest.mark.slow
def test_policies_outside_the_recording_are_scored_with_the_model(target, sampled_run):
    sub = type(sampled_run)(metadata=sampled_run.metadata, steps=sampled_run.steps[:2])
    res = run_counterfactuals(sub, ["chain", "beam4", "ddtree"], [8, 64], target=target, context=CTX)
    assert all(r.tau_sampled is not None and r.tau_greedy is not None for r in res)
    assert all(1.0 <= r.tau_sampled <= 1.0 + r.num_nodes for r in res)
    # DDTree's 64-node tree holds its 8-node tree: E[τ] cannot drop
    by = {(r.step, r.request, r.policy, r.budget): r for r in res}
    for s in sub.steps:
        assert by[(s.step, s.request, "ddtree", 64)].tau_sampled >= by[(s.step, s.request, "ddtree", 8)].tau_sampled - 1e-12


@pytest.mark.slow
def test_live_session_verifies_the_policy_tree_and_its_counterfactual_reproduces_the_run(target, drafter):
    from ddtree_lab.session import LiveSession
    from ddtree_lab.sampling import SamplingParams

    budget = 8
    session = LiveSession(target, drafter, budget=budget, sampling=SamplingParams(temperature=0.8, seed=3),
                          policy="beam4")
    run = session.run("Tell me something interesting about lighthouses.", max_new_tokens=8)
    assert run.metadata["policy"] == "beam4" and run.steps
    beam4 = get_policy("beam4")
    for s in run.steps:
        anchor = int(s.node_token_ids[0])
        assert s.tree.equals(beam4(s.draft, anchor, budget, None)), s.step  # the tree verified is the policy's
        assert s.extra == {"policy": "beam4", "policy_budget": budget}
        assert s.num_nodes - 1 == int(beam4(s.draft, anchor, budget, None).num_nodes[0]) - 1
        # the counterfactual of the policy that ran is the recorded step: covered, no forward
        (r,) = step_counterfactuals(s, ["beam4"], [budget])
        assert r.covered and _tree(r.tree) == _tree(s.tree)
        assert r.tau_sampled == pytest.approx(1.0 + recorded_expected_accepted(s), abs=1e-9)
        # re-scored by a fresh forward at the step's prefix: the recorded rows again, and the walk
        # at the recorded coins takes the recorded path
        fresh = rescore_trees(target, step_prefix_ids(run, s), [s.tree], s.params)
        got = torch.tensor([0.0] + [fresh.sampled[k] for k in path_keys(s.tree)[1:]], dtype=torch.float64)
        assert torch.allclose(got[1:], s.child_probs.double()[1:], atol=2e-3), float((got - s.child_probs)[1:].abs().max())
        ev = walk_request(s.retrieve_next_token, s.retrieve_next_sibling, s.node_token_ids, got.tolist(),
                          s.coins.tolist(), s.final_coin)
        assert [e.node for e in ev if e.kind == "move"] == s.accepted_path[1:]
        assert sum(e.kind == "move" for e in ev) == s.accept_length


def test_a_session_refuses_a_policy_it_cannot_run():
    from types import SimpleNamespace

    from ddtree_lab.session import LiveSession

    target, drafter = SimpleNamespace(device="cpu"), SimpleNamespace(block_size=16)
    with pytest.raises(KeyError, match="unknown name 'wide'"):
        LiveSession(target, drafter, policy="wide")
    with pytest.raises(TypeError, match="policy must be a policy function"):
        LiveSession(target, drafter, policy=3)
    with pytest.raises(ValueError, match="top1_spine and min_prob"):
        LiveSession(target, drafter, policy="chain", min_prob=0.1)
    with pytest.raises(ValueError, match="policy_context.max_depth 3 != max_depth 4"):
        LiveSession(target, drafter, policy="chain", max_depth=4, policy_context=PolicyContext(max_depth=3))
    with pytest.raises(ValueError, match="without a policy"):
        LiveSession(target, drafter, policy_context=CTX)


def test_policy_trees_are_stacked_as_a_batch_and_checked_against_their_budget():
    from ddtree_lab.analysis.policies import build_policy_trees, stack_trees

    ids = torch.stack([PAPER.token_ids, PAPER.token_ids + 100])
    lps = torch.stack([PAPER.logprobs, PAPER.logprobs])
    tree = build_policy_trees(get_policy("chain"), ids, lps, torch.tensor([5, 6]), [1, 3])
    assert tree.num_nodes.tolist() == [2, 4] and tree.node_token_ids.tolist() == [[5, 10, -1, -1], [6, 110, 120, 130]]
    assert tree.parents[0].tolist() == [-1, 0, -1, -1] and tree.node_logws[0, 2:].isneginf().all()
    vi = compile_retrieve(tree, torch.tensor([7, 9]))
    parents, _ = decode_retrieve(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes)
    assert parents[1].tolist() == [-1, 0, 1, 2]

    def greedy_overshoot(draft, anchor, budget, context=None):  # one node too many at anchor 6
        return get_policy("ddtree")(draft, anchor, budget + (anchor == 6), context)

    with pytest.raises(ValueError, match="request 1: policy greedy_overshoot built 4 draft nodes for budget 3"):
        build_policy_trees(greedy_overshoot, ids, lps, torch.tensor([5, 6]), [9, 3])
    with pytest.raises(ValueError, match="batch of one"):
        stack_trees([build_policy_trees(get_policy("chain"), ids, lps, torch.tensor([5, 6]), [1, 1])])


# -- the CLI verb -------------------------------------------------------------------------------------

def test_compare_policies_verb(capsys, tmp_path):
    from ddtree_lab.cli import main

    assert main(["compare-policies", str(SAMPLED), "--policy", "ddtree", "--budgets", "4,32",
                 "--max-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "ddtree" in out and "3/3" in out
    # a tree outside the recording without --model: nothing checked, so the could-not-check status 2
    # (not 1, "a check found something", issue 34.10); the row and a line on stderr say it was not scored
    assert main(["compare-policies", str(SAMPLED), "--policy", "chain", "--budgets", "8", "--max-steps", "2"]) == 2
    io = capsys.readouterr()
    assert "not scored" in io.out and "2 of 2 rows not scored" in io.err and "--model" in io.err
    assert main(["compare-policies", str(SAMPLED), "--policy", "wide"]) == 2
    assert "--policy wide: unknown policy" in capsys.readouterr().err
    assert main(["compare-policies", str(SAMPLED), "--budgets", "4,x"]) == 2


def test_compare_policies_parquet_has_one_row_per_step_policy_and_budget(capsys, tmp_path, sampled_run):
    import pyarrow.parquet as pq

    from ddtree_lab.cli import main

    out = tmp_path / "cf.parquet"
    # chain at 8 lies outside the recording (no model): its rows are written with null E[tau] (exit 2: not scored)
    assert main(["compare-policies", str(SAMPLED), "--policy", "ddtree", "--policy", "chain", "--budgets", "4,8",
                 "--max-steps", "3", "--parquet", str(out)]) == 2
    assert "12 rows ->" in capsys.readouterr().out
    table = pq.read_table(out).to_pylist()
    assert [(r["step"], r["request"], r["policy"], r["budget"]) for r in table] == [
        (s.step, s.request, p, b) for s in sampled_run.steps[:3] for p in ("ddtree", "chain") for b in (4, 8)]
    assert {r["run"] for r in table} == {str(SAMPLED)}
    by = {(s.step, s.request): s for s in sampled_run.steps[:3]}
    for row in table:
        s = by[(row["step"], row["request"])]
        (want,) = step_counterfactuals(s, [row["policy"]], [row["budget"]])
        assert (row["tau_greedy"], row["tau_sampled"], row["covered"], row["num_nodes"]) == (
            want.tau_greedy, want.tau_sampled, want.covered, want.num_nodes)
        assert (row["tau_sampled"] is None) == (row["reason"] is not None)
    assert any(r["covered"] for r in table) and any(r["tau_sampled"] is None for r in table)
    # nothing is replaced, the name says what it is, the directory must exist: refused before loading
    for bad, why in [(out, "exists"), (tmp_path / "cf.csv", "ending in .parquet"),
                     (tmp_path / "no" / "x.parquet", "does not exist")]:
        assert main(["compare-policies", str(SAMPLED), "--parquet", str(bad)]) == 2
        assert why in capsys.readouterr().err
    for steps in ("0", "-1"):  # a negative count once ran all steps but the last
        assert main(["compare-policies", str(SAMPLED), "--max-steps", steps]) == 2
        assert "--max-steps" in capsys.readouterr().err


@pytest.mark.slow
def test_measured_cost_model_drives_the_cost_policy(target, sampled_run):
    from ddtree_lab.analysis.counterfactual import measure_cost_model

    s = sampled_run.steps[0]
    prefix = step_prefix_ids(sampled_run, s) + [int(s.node_token_ids[0])]
    cm = measure_cost_model(target, prefix, s.draft, (1, 9, 33), repeats=1)
    assert all(t > 0 for t in cm.seconds[1]) and cm.seconds[1][2] > cm.seconds[1][0]
    tree = cost_aware_policy(s.draft, int(s.node_token_ids[0]), 32, PolicyContext(cost_model=cm))
    assert 1 <= int(tree.num_nodes[0]) <= 33


# -- the views (read results, never a model) ----------------------------------------------------------

def test_policy_views_draw_the_results_they_are_given(sampled_run):
    from ddtree_lab.views.policies import PolicyPicker, mean_accept_by_depth, policy_tree_dot, tokens_per_second_figure

    res = [r for s in sampled_run.steps[:3] for r in step_counterfactuals(s, ["ddtree", "capped4", "beam2"], [4, 8])]
    scored = [r for r in res if r.tau_sampled is not None]
    assert len(scored) < len(res)  # beam2 at 8 leaves the recorded tree (no model here)
    for r in scored:  # P(accepted >= d) sums to E[tau] - 1; the reach of the root is 1
        assert sum(r.accept_by_depth) == pytest.approx(r.tau_sampled - 1.0, abs=1e-12) and r.reach[0] == 1.0
    for r in res:
        assert (r.accept_by_depth is None) == (r.reach is None) == (r.tau_sampled is None)
    by = mean_accept_by_depth(res)  # groups with an unscored step are left out, not averaged over a subset
    unscored = {(r.policy, r.budget) for r in res if r.tau_sampled is None}
    assert set(by) == {(r.policy, r.budget) for r in res} - unscored and unscored
    dot = policy_tree_dot(res[0], sampled_run)
    assert dot.count("reach=") == res[0].num_nodes and "ddtree · B=4" in dot
    picker = PolicyPicker(res, texts=sampled_run)
    picker.policy.value, picker.budget.value = "capped4", 4
    assert [r.policy for r in picker.chosen()] == ["capped4", "ddtree"]
    assert "capped4 at B = 4: mean exact E[τ]" in picker.summary.value
    assert picker.trees_out.value.count("<svg") == 2
    rows = [{"temperature": 0.0, "policy": p, "budget": b, "expected_tok_s": v, "live_tau_tok_s": None}
            for p, b, v in [("ddtree", 4, 8.0), ("ddtree", 8, 9.0), ("chain", 4, 7.0), ("chain", 8, 6.5)]]
    fig = tokens_per_second_figure(rows, 18.0)
    lines = {t.name: t for t in fig.data}
    assert lines["plain decoding"].y == (18.0, 18.0) and lines["chain (best budget)"].y == (7.0, 7.0)
    assert lines["ddtree"].y == (8.0, 9.0)
