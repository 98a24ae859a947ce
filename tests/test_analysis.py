"""ddtree_lab.analysis: exact expected accept length, calibration, per-depth statistics,
sibling-conditioned drafter quality and the looks-greedy flag."""

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddtree_lab import analysis, load_trace
from ddtree_lab.buffers import compile_retrieve
from ddtree_lab.sampling import SamplingParams
from ddtree_lab.build import DDTreeBuildResult
from ddtree_lab.verify import draw_coins, make_generators, verify_sampled

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "traces"


@pytest.fixture(scope="module")
def sampled_run():
    return load_trace(FIX / "smollm2_t08_b32.ddtrace.safetensors")


@pytest.fixture(scope="module")
def greedy_run():
    return load_trace(FIX / "smollm2_greedy_b32.ddtrace.safetensors")


def test_reach_and_expected_on_a_hand_made_tree():
    parents = torch.tensor([-1, 0, 0, 1, 3])
    probs = torch.tensor([0.0, 0.5, 0.3, 0.4, 0.25])
    reach = analysis.reach_probabilities(parents, probs)
    assert torch.allclose(reach, torch.tensor([1, 0.5, 0.3, 0.2, 0.05], dtype=torch.float64))
    step = SimpleNamespace(parents=parents, child_probs=probs, node_logws=torch.log(torch.tensor([1, .6, .2, .3, .1])))
    assert analysis.expected_accept_length(step) == pytest.approx(1.05)
    assert analysis.drafter_estimate(step) == pytest.approx(1.2)
    with pytest.raises(ValueError, match="precede"):
        analysis.reach_probabilities(torch.tensor([-1, 2, 0]), torch.zeros(3))


def test_expected_accept_length_matches_the_verifier_in_the_mean():
    """Monte Carlo through the real sampled verifier: the mean accept length over many coin
    sets equals the exact sum of path products (4 standard errors)."""
    torch.manual_seed(0)
    vocab = 6
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 4, 2])
    n = parents.shape[0]
    depths = torch.zeros(n, dtype=torch.int64)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    tokens = torch.tensor([5, 0, 1, 2, 0, 3, 4, 1])
    rows = torch.distributions.Dirichlet(torch.full((vocab,), 0.7)).sample((n,))
    child = torch.zeros(n)
    child[1:] = rows[parents[1:], tokens[1:]]
    exact = float(analysis.reach_probabilities(parents, child)[1:].sum())
    bs = 4000
    tree = DDTreeBuildResult(node_token_ids=tokens.expand(bs, n).clone(), parents=parents.expand(bs, n).clone(),
                             depths=depths.expand(bs, n).clone(), ranks=torch.zeros(bs, n, dtype=torch.int64),
                             node_logws=-torch.arange(n, dtype=torch.float32).expand(bs, n).clone(),
                             num_nodes=torch.full((bs,), n))
    vi = compile_retrieve(tree, torch.zeros(bs, dtype=torch.int64))
    coins, final = draw_coins(make_generators([SamplingParams(seed=b) for b in range(bs)]), n)
    out = verify_sampled(vi, rows.expand(bs, n, vocab).contiguous(), coins, final)
    acc = out.accept_length.double()
    se = float(acc.std()) / math.sqrt(bs)
    assert abs(float(acc.mean()) - exact) < 4 * se, (float(acc.mean()), exact)


def test_greedy_steps_expect_exactly_what_they_accept(greedy_run):
    table = analysis.step_table(greedy_run.steps)
    assert len(table) == len(greedy_run.steps)
    for row in table:
        assert row["expected"] == pytest.approx(row["observed"])
        assert row["setting"] == "greedy" and row["tau"] == row["observed"] + 1


def test_sampled_fixture_calibration(sampled_run):
    table = analysis.step_table(sampled_run.steps)
    exp = torch.tensor([r["expected"] for r in table])
    obs = torch.tensor([r["observed"] for r in table], dtype=torch.float64)
    # the observed mean is an unbiased sample of the exact expectation (122 steps)
    se = float((obs - exp).std()) / math.sqrt(len(table))
    assert abs(float(obs.mean() - exp.mean())) < 4 * se
    assert all(r["drafter"] > 0 for r in table) and all(r["setting"] == "T=0.8" for r in table)


def test_acceptance_by_depth_counts(sampled_run):
    steps = sampled_run.steps
    a = analysis.acceptance_by_depth(steps)
    assert a["accepted"][0] == sum(s.accept_length >= 1 for s in steps)
    assert a["offered"][0] == sum(int((s.parents[1:] == 0).any()) for s in steps)
    assert all(acc <= off for acc, off in zip(a["accepted"], a["offered"]))
    assert a["accepted"] == sorted(a["accepted"], reverse=True)


def test_sibling_ranks_and_accepted_ranks():
    parents = torch.tensor([-1, 0, 0, 1, 0, 1, 3])
    assert analysis.sibling_ranks(parents).tolist() == [-1, 0, 1, 0, 2, 1, 0]


def test_accepted_sibling_ranks_on_fixture(sampled_run):
    rows = analysis.accepted_sibling_ranks(sampled_run.steps)
    assert len(rows) == sum(s.accept_length for s in sampled_run.steps)
    assert {r["depth"] for r in rows if r["step"] == sampled_run.steps[0].step and r["request"] == 0} <= set(range(1, 16))
    assert any(r["sibling_rank"] > 0 for r in rows)  # T=0.8 accepts lower siblings sometimes


def _fake_step(ranks, path, emitted, draft_top, params=SamplingParams(temperature=0.7), step=0):
    accept = torch.full((1, 16), -1)
    accept[0, : len(path)] = torch.tensor(path)
    em = torch.full((1, 16), -1)
    em[0, : len(emitted)] = torch.tensor(emitted)
    dt = torch.zeros(15, 2, dtype=torch.int64)
    dt[: len(draft_top), 0] = torch.tensor(draft_top)
    out = SimpleNamespace(accept_index=accept, emitted_tokens=em)
    s = SimpleNamespace(step=step, request=0, params=params, ranks=torch.tensor(ranks), draft_token_ids=dt, output=out)
    s.accepted_path = path
    s.emitted = emitted
    return s


def test_sibling_conditioned_quality_counts():
    # path root -> node 1 (rank 0) -> node 2 (rank 1); emitted = [10, 21, 30 (bonus)]
    s = _fake_step([-1, 0, 1], [0, 1, 2], [10, 21, 30], [10, 20, 30])
    rows = {(r["after"], r["depth"]): (r["hits"], r["total"]) for r in analysis.sibling_conditioned_quality([s])}
    assert rows[("root", 0)] == (1, 1)        # emitted[0] == drafter best at depth 1
    assert rows[("rank 0", 1)] == (0, 1)      # after a rank-0 node, target took 21 not 20
    assert rows[("rank > 0", 2)] == (1, 1)    # after the rank-1 node, bonus 30 == drafter best
    assert rows[("rank 0", "all")] == (0, 1)


def test_sibling_conditioned_quality_on_fixture(sampled_run):
    rows = analysis.sibling_conditioned_quality(sampled_run.steps)
    total = {r["after"]: r["total"] for r in rows if r["depth"] == "all"}
    assert total["root"] == len(sampled_run.steps)
    assert total["rank 0"] + total.get("rank > 0", 0) == sum(s.accept_length for s in sampled_run.steps)


def test_throughput_counts_batch_time_once(sampled_run):
    t = analysis.throughput(sampled_run.steps)
    tokens = sum(len(s.emitted) for s in sampled_run.steps)
    assert sum(r["tokens"] for r in t["per_request"]) == tokens
    secs = {s.step: analysis.step_seconds(s) for s in sampled_run.steps}
    assert t["batch_tokens_per_s"] == pytest.approx(tokens / sum(secs.values()))


def test_looks_greedy_flags_a_sampled_request_verified_greedily(greedy_run, sampled_run):
    # An engine that verified greedily while the request asked for T=1: the argmax path is
    # emitted, and the recorded probabilities are the request's (T=1 softmax) ones.
    faulty = []
    for s in greedy_run.steps:
        child = torch.zeros(s.num_nodes)
        for i in range(1, s.num_nodes):
            ids = s.top_token_ids[int(s.parents[i])].tolist()
            tok = int(s.node_token_ids[i])
            child[i] = s.top_probs[int(s.parents[i]), ids.index(tok)] if tok in ids else 0.0
        faulty.append(s.replace(params=SamplingParams(temperature=1.0), child_probs=child))
    flags = analysis.looks_greedy(faulty)
    assert all(f.flagged for f in flags), [f.message for f in flags]
    assert all(f.argmax_tokens == f.tokens and f.log10_p < -3 for f in flags)
    honest = analysis.looks_greedy(sampled_run.steps)
    assert not any(f.flagged for f in honest)
    assert not any(f.flagged for f in analysis.looks_greedy(greedy_run.steps))  # greedy is greedy
    assert "looks greedy" in flags[0].message


# -- the greedy-vs-sampling figures read traces only ----------------------------------------------


def test_compare_figures_on_fixture_traces(sampled_run, greedy_run):
    from ddtree_lab.views import compare

    steps = sampled_run.steps + [dataclasses.replace(s, request=s.request + 10) for s in greedy_run.steps]
    assert compare.settings_of(steps) == ["T=0.8", "greedy"]
    fig = compare.calibration_figure(steps)
    exact = [t for t in fig.data if t.name == "exact expected"]
    assert len(exact) == 2 and list(exact[1].y) == [r["expected"] for r in analysis.step_table(
        sorted(greedy_run.steps, key=lambda s: (s.step, s.request)))]
    acc = compare.acceptance_figure(steps)
    by_depth = analysis.acceptance_by_depth(sampled_run.steps)
    assert list(acc.data[0].y) == [r for r, o in zip(by_depth["rate"], by_depth["offered"]) if o]
    ranks = compare.sibling_rank_figure(steps)
    assert sum(sum(t.y) for t in ranks.data) == sum(s.accept_length for s in steps)
    tau = compare.tau_distribution_figure(steps)
    assert sorted(tau.data[1].x) == sorted(analysis.tau(s) for s in greedy_run.steps)
    q = compare.sibling_quality_figure(steps)
    assert [t.name for t in q.data] == ["T=0.8", "greedy"]
    assert len(compare.throughput_figure(steps).data[0].y) == 6
    rows = {r["setting"]: r for r in compare.summary_rows(steps)}
    assert rows["greedy"][compare.OBSERVED] == rows["greedy"][compare.EXPECTED]
    html = compare.trees_html(sampled_run, step=2)
    assert html.count("<svg") == len([s for s in sampled_run.steps if s.step == 2])
    with pytest.raises(ValueError, match="no request has decoding step 999"):
        compare.trees_html(sampled_run, step=999)
    table = compare.looks_greedy_html(steps)
    assert "LOOKS GREEDY" not in table and table.count("<tr>") == 1 + 6


def test_compare_table_says_it_counts_accepted_draft_tokens_and_the_depth_axis_fits_the_data(sampled_run):
    """Issue 26.12: notebook 03's table names its accept-length columns τ − 1 (mean τ beside
    them is one more), and acceptance by depth ends its axis where a depth was last offered."""
    from ddtree_lab.views import compare

    row = compare.summary_rows(sampled_run)[0]
    assert {compare.OBSERVED, compare.EXPECTED, compare.DRAFTER} <= set(row) and "τ − 1" in compare.OBSERVED
    assert row["mean τ"] == pytest.approx(row[compare.OBSERVED] + 1, abs=2e-3)
    assert "(τ − 1)" in compare.summary_html(sampled_run)
    by_depth = analysis.acceptance_by_depth(sampled_run.steps)
    offered = max(d for d, o in zip(by_depth["depth"], by_depth["offered"]) if o)
    assert max(by_depth["depth"]) > offered  # the fixture's trees are deeper than any walk went
    fig = compare.acceptance_figure(sampled_run)
    assert tuple(fig.layout.xaxis.range) == (0.5, offered + 0.5) and max(fig.data[0].x) == offered
    assert f"the trees reach depth {max(by_depth['depth'])}" in fig.layout.title.text
    assert any(a.text == analysis.OFFERED_DEFINITION for a in fig.layout.annotations)  # offered defined under the axis
