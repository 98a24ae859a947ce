"""The tuner's re-analysis from top-M logits (ddtree_lab.analysis.token_prob_bounds,
TunerData) against brute force on full rows; the tuner widget's state without a browser."""

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree_lab import analysis
from ddtree_lab.sampling import SamplingParams, target_probs


# -- oracle: the transform on full rows, float64, real-arithmetic rules --------------------------


def full_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``[R, V]`` float64 target distribution of full rows (the rules of ddtree_lab.sampling)."""
    l = logits.double()
    if p.is_greedy:
        out = torch.zeros_like(l)
        out.scatter_(-1, l.argmax(-1, keepdim=True), 1.0)
        return out
    s = l / p.temperature
    if 0 < p.top_k < l.shape[-1]:
        kth = s.topk(p.top_k, -1).values[:, -1:]
        s = s.masked_fill(s < kth, -math.inf)
    q = torch.softmax(s, -1)
    if p.top_p < 1.0:
        # keep t iff the mass strictly more probable than t is < top_p
        neg = torch.sort(-q, -1).values  # ascending -q: descending q
        excl = torch.cat([torch.zeros_like(neg[:, :1]), (-neg).cumsum(-1)[:, :-1]], -1)
        first = torch.searchsorted(neg.contiguous(), (-q).contiguous(), side="left")  # first of the tie group
        above = excl.gather(-1, first)
        q = q * (above < p.top_p)
        q = q / q.sum(-1, keepdim=True)
    if p.min_p:
        q = q * (q >= p.min_p * q.max(-1, keepdim=True).values)
        q = q / q.sum(-1, keepdim=True)
    return q


def top_m_fields(logits: torch.Tensor, m: int):
    """What trace format v2 stores of full rows: top-M ids / raw logits (descending, ties by
    ascending id) and the full row's log-sum-exp (float64)."""
    order = torch.sort(-logits.float(), dim=-1, stable=True).indices[:, :m]
    return order, logits.float().gather(-1, order), torch.logsumexp(logits.double(), -1)


def bounds_for(logits, m, rows, tokens, params):
    ids, top, lse = top_m_fields(logits, m)
    eq = ids[rows] == tokens[:, None]
    pos = torch.where(eq.any(-1), eq.int().argmax(-1), torch.full_like(tokens, -1))
    x = logits.float()[rows, tokens]
    return analysis.token_prob_bounds(top, lse, logits.shape[-1], rows, pos, x, params)


def _exact_expected(params: SamplingParams, m: int, logits: torch.Tensor) -> bool:
    """Cases where the stored data determine the value (module docstring of analysis)."""
    top = torch.sort(logits.float(), -1, descending=True).values
    m = min(m, logits.shape[-1])
    if params.is_greedy or m == logits.shape[-1]:
        return True
    if 0 < params.top_k <= m:
        return bool((top[:, params.top_k - 1] > top[:, m - 1]).all())
    return False


params_st = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.just(1.0), st.floats(0.05, 4.0)),
    top_k=st.one_of(st.just(0), st.integers(1, 80)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.none(), st.floats(0.001, 0.6)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=params_st, m=st.sampled_from([1, 4, 16]), vocab=st.integers(20, 120), scale=st.floats(0.3, 12.0),
       grid=st.sampled_from([0.0, 0.5]), seed=st.integers(0, 2**31 - 1))
def test_bounds_contain_the_full_row_value(params, m, vocab, scale, grid, seed):
    if params.top_k > vocab:
        params = SamplingParams(params.temperature, vocab, params.top_p, params.min_p)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=g) * scale
    if grid:  # ties, also at the M-th logit
        logits = torch.round(logits / grid) * grid
    rows = torch.arange(6).repeat_interleave(8)
    tokens = torch.randint(0, vocab, (48,), generator=g)
    lo, hi = bounds_for(logits, m, rows, tokens, params)
    truth = full_probs(logits.float(), params)[rows, tokens]
    tol = 1e-9
    assert bool((lo <= truth + tol).all() and (truth <= hi + tol).all()), (lo, truth, hi)
    if _exact_expected(params, m, logits):
        assert float((hi - lo).max()) < 1e-9


@pytest.fixture(scope="module")
def real_rows(target):
    """``[40, V]`` real SmolLM2 logits: the rows of a prefill."""
    ids = target.encode_prompt("Explain why the sky is blue and why sunsets are red, briefly.")
    _, _, logits = target.prefill(ids)
    return logits[-40:].float()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.6, top_k=50, top_p=0.8, min_p=0.05), SamplingParams(temperature=1.3),
    SamplingParams(temperature=1.0, top_k=200), SamplingParams(temperature=0.5, min_p=0.1),
])
def test_bounds_on_real_smollm2_rows(real_rows, params):
    m = 64
    g = torch.Generator().manual_seed(1)
    r = real_rows.shape[0]
    rows = torch.arange(r).repeat_interleave(6)
    top = real_rows.topk(4, -1).indices  # two stored tokens and four random ones per row
    tokens = torch.cat([top[:, :2], torch.randint(0, real_rows.shape[1], (r, 4), generator=g)], -1).flatten()
    lo, hi = bounds_for(real_rows, m, rows, tokens, params)
    truth = full_probs(real_rows, params)[rows, tokens]
    lib = target_probs(real_rows[None], params)[0].double()[rows, tokens]  # the library's float32 transform
    assert bool((lo <= truth + 1e-9).all() and (truth <= hi + 1e-9).all())
    # float32 softmax over 49,152 entries: relative error ~3e-5
    assert bool((lo * (1 - 1e-4) <= lib + 1e-7).all() and (lib <= hi * (1 + 1e-4) + 1e-7).all())
    if _exact_expected(params, m, real_rows):
        assert float((hi - lo).max()) < 1e-9
    # informative where it is loose: the two most probable tokens keep a positive lower bound
    assert bool((lo.view(r, 6)[:, 0] > 0).all())
    assert bool(((lo > 0) == (truth > 0)).view(r, 6)[:, :2].all()) or not params.top_p == 1.0


def test_temperature_one_without_filters_is_exact_up_to_rounding(real_rows):
    rows = torch.arange(real_rows.shape[0])
    tokens = real_rows.argmin(-1)  # far outside the top M
    lo, hi = bounds_for(real_rows, 64, rows, tokens, SamplingParams(temperature=1.0))
    assert float((hi - lo).max()) < 1e-12 and float(hi.max()) > 0


# -- whole steps ---------------------------------------------------------------------------------


def make_step(logits_rows: torch.Tensor, n: int, m: int, seed: int, step: int = 0, params=SamplingParams(temperature=1.0)):
    """A step-like record in trace format v2: a random tree of ``n`` nodes in tree order whose
    node rows are ``logits_rows[:n]``; children take stored and unstored tokens."""
    g = torch.Generator().manual_seed(seed)
    vocab = logits_rows.shape[1]
    parents = torch.full((n,), -1, dtype=torch.int64)
    depths = torch.zeros(n, dtype=torch.int64)
    tokens = torch.zeros(n, dtype=torch.int64)
    used: dict[int, set] = {}
    order = torch.sort(-logits_rows, dim=-1, stable=True).indices
    for i in range(1, n):
        p = int(torch.randint(0, i, (1,), generator=g)) if i > 1 else 0
        parents[i], depths[i] = p, depths[p] + 1
        taken = used.setdefault(p, set())
        while True:
            c = int(order[p, int(torch.randint(0, 6, (1,), generator=g))]) if torch.rand(1, generator=g) < 0.75 \
                else int(torch.randint(0, vocab, (1,), generator=g))
            if c not in taken:
                break
        taken.add(c)
        tokens[i] = c
    rows = logits_rows[:n]
    ids, top, lse = top_m_fields(rows, m)
    node_logits = torch.full((n,), float("nan"))
    node_logits[1:] = rows[parents[1:], tokens[1:]]
    s = SimpleNamespace(step=step, request=0, request_id="0", params=params, parents=parents, depths=depths,
                        node_token_ids=tokens, num_nodes=n, accept_length=0, row_logit_ids=ids, row_logits=top,
                        row_logsumexp=lse, node_logits=node_logits,
                        output=SimpleNamespace(support_exhausted=torch.tensor([False])))
    probs = full_probs(rows, params)
    s.child_probs = torch.zeros(n)
    s.child_probs[1:] = probs[parents[1:], tokens[1:]].float()
    return s


@pytest.fixture(scope="module")
def real_steps(real_rows):
    return [make_step(real_rows[8 * k:], 24, 64, seed=k, step=k) for k in range(3)]


def brute_force(step, full_rows, params, budget):
    probs = full_probs(full_rows[: step.num_nodes], params)
    n = min(step.num_nodes, budget + 1)
    child = torch.zeros(n, dtype=torch.float64)
    child[1:] = probs[step.parents[1:n], step.node_token_ids[1:n]]
    reach = analysis.reach_probabilities(step.parents[:n], child)
    cover = torch.zeros(int(step.depths.max()), dtype=torch.float64)
    for i in range(1, n):
        cover[int(step.depths[i]) - 1] += reach[i]
    return float(reach[1:].sum()), cover


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=10),
                                    SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.2),
                                    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02)])
def test_tuner_data_matches_brute_force_per_step_and_budget(real_rows, real_steps, params):
    steps = real_steps
    data = analysis.TunerData.from_steps(steps, real_rows.shape[1])
    for budget in (23, 7, 1, 0):
        res = data.analyse(params, budget)
        for k, s in enumerate(steps):
            exp, cover = brute_force(s, real_rows[8 * k:], params, budget)
            assert float(res.expected_lo[k]) - 1e-9 <= exp <= float(res.expected_hi[k]) + 1e-9
            d = cover.shape[0]
            assert bool((res.cover_lo[k, :d] <= cover + 1e-9).all() and (cover <= res.cover_hi[k, :d] + 1e-9).all())
            assert torch.allclose(res.cover_lo[k].sum(), res.expected_lo[k])
        if params.is_greedy or params.top_k:
            assert res.max_error < 1e-9
    lo, hi = data.analyse(params).mean_tau
    assert lo <= hi and lo >= 1.0


def test_tuner_data_refuses_v1_steps():
    s = SimpleNamespace(step=3, request=1, num_nodes=2, row_logit_ids=None)
    with pytest.raises(ValueError, match="step 3, request 1: no 'row_logit_ids'"):
        analysis.TunerData.from_steps([s], 100)
    with pytest.raises(ValueError, match="budget"):
        analysis.TunerData.from_steps([make_step(torch.randn(4, 50), 4, 8, 0)], 50).analyse(SamplingParams(), -1)


# -- the tuner widget, without a browser -------------------------------------------------------


@pytest.fixture(scope="module")
def small_run():
    from ddtree_lab.step import Run

    g = torch.Generator().manual_seed(5)
    steps = []
    for k in range(6):
        rows = torch.randn(20, 300, generator=g) * 2.5
        s = make_step(rows, 12 + k, 16, seed=k, step=k, params=SamplingParams(temperature=0.8))
        s.accept_length = k % 3
        steps.append(s)
    return Run(metadata={"vocab_size": 300}, steps=steps, token_texts={i: f"t{i}" for i in range(300)})


def test_tuner_widget_state_follows_simulated_slider_moves(small_run):
    from ddtree_lab.views import tuner as tv

    t = tv.Tuner(small_run)
    assert "ddtree-expected-tau" in t.expected_tau._dom_classes
    assert t.top_p.description == "top-p" and t.temperature.description == "temperature"
    data = t.state.data
    first = t.expected_tau.value
    assert first == tv.expected_tau_text(data, SamplingParams(temperature=0.8), 16)
    t.top_p.value = 0.5  # as a browser slider move would
    after = t.expected_tau.value
    assert after == tv.expected_tau_text(small_run, tv.params_from_controls(0.8, 0, 0.5, 0.0), 16)
    assert after == tv.expected_tau_text(data, tv.params_from_controls(0.8, 0, 0.5, 0.0), 16)
    assert after != first
    t.top_k.value = 3  # inside the stored top-M: exact
    assert "±" not in t.expected_tau.value and "exact" in t.summary.value
    t.top_k.value = 0
    t.top_p.value = 1.0
    t.temperature.value = 0.5  # tail outside the stored top-16 of 300: bounded
    assert "±" in t.expected_tau.value and "bounded" in t.summary.value
    lo, hi = data.analyse(SamplingParams(temperature=0.5), 16).mean_tau
    mid, half = (float(x) for x in t.expected_tau.value.split(" ± "))
    assert mid - half <= lo + 1e-3 and hi - 1e-3 <= mid + half
    t.budget.value = 3
    assert "#3 " in t.tree.value and "#4 " not in t.tree.value
    before = t.tree.value
    t.step.value = 4
    assert t.tree.value != before and "step 4" in t.tree.value
    assert 'data-selected="4"' in t.per_step.value  # the chart follows the step slider alone (issue 18.1)
    assert not t.top_k.disabled and not t.top_p.disabled and not t.min_p.disabled
    t.temperature.value = 0.0
    assert t.expected_tau.value == tv.expected_tau_text(data, SamplingParams(temperature=0.0), 3)
    # at T = 0 the filters cannot change the argmax: their sliders are greyed, with a reason
    assert t.top_k.disabled and t.top_p.disabled and t.min_p.disabled and "greedy" in t.top_p.tooltip
    t.temperature.value = 0.7
    assert not t.top_p.disabled


def test_tuner_live_button_calls_the_given_function(small_run):
    from ddtree_lab.views import tuner as tv

    calls = []

    def live(params, budget):
        calls.append((params, budget))
        return small_run.steps[:2]

    t = tv.Tuner(small_run, live=live)
    t.top_p.value = 0.9
    t.live_button.click()
    assert calls == [(tv.params_from_controls(0.8, 0, 0.9, 0.0), 16)]
    assert "observed mean τ <b>1.500</b>" in t.live_out.value  # accept lengths 0 and 1, + bonus
    assert t.expected_tau.value in t.live_out.value
    assert tv.Tuner(small_run).live_button.disabled


def test_tuner_refuses_a_v1_run():
    from ddtree_lab import load_trace
    from ddtree_lab.views import tuner as tv
    from pathlib import Path

    run = load_trace(Path(__file__).resolve().parent / "data" / "v1_t08_three_steps.ddtrace.safetensors")
    with pytest.raises(ValueError, match="format v1|vocab_size"):
        tv.Tuner(run)
    with pytest.raises(ValueError, match=r"step \d+, request \d+: no 'row_logit_ids' \(a trace format v1 step\)"):
        analysis.TunerData.from_steps(run.steps, 49152)


# -- a real recorded run (trace format v2) --------------------------------------------------------


@pytest.fixture(scope="module")
def live_v2_run(target, drafter):
    from ddtree_lab import LiveSession

    torch.set_num_threads(1)
    session = LiveSession(target, drafter, budget=32, sampling=[
        SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.0, top_p=0.9, seed=4),
        SamplingParams(temperature=0.6, top_k=20, seed=5), SamplingParams(temperature=0.0)])
    return session.run(["Explain why the sky is blue in two sentences."] * 4, max_new_tokens=8)


def test_reanalysis_at_the_recorded_parameters_contains_what_the_verifier_read(live_v2_run):
    """Each request's own parameters: the re-analysed node probabilities bound the recorded
    ``child_probs`` (the library's float32 rows) and the expected accept length bounds the
    value computed from them; greedy and top-k <= M are exact."""
    run = live_v2_run
    for r in range(4):
        steps = run.for_request(r)
        data = analysis.TunerData.from_steps(steps, run.metadata["vocab_size"])
        p = steps[0].params
        res = data.analyse(p)
        rec = torch.cat([s.child_probs[1:] for s in steps]).double()
        draft = data.node_local > 0
        lo, hi = res.node_lo[draft], res.node_hi[draft]
        assert bool(((lo * (1 - 1e-4) - 1e-7 <= rec) & (rec <= hi * (1 + 1e-4) + 1e-7)).all()), p
        exp = torch.tensor([analysis.expected_accept_length(s) for s in steps], dtype=torch.float64)
        assert bool((res.expected_lo - 1e-3 <= exp).all() and (exp <= res.expected_hi + 1e-3).all())
        if p.is_greedy or 0 < p.top_k <= data.top_m:
            assert res.max_error < 1e-9
    # a smaller budget from the same recording is the tree's prefix
    data = analysis.TunerData.from_run(run)
    full, half = data.analyse(SamplingParams(temperature=0.8)), data.analyse(SamplingParams(temperature=0.8), 16)
    assert bool((half.expected_hi <= full.expected_hi + 1e-12).all())


def test_tuner_on_the_v2_fixture_trace():
    """The notebook's set-up: the T = 0.8 fixture; moving top-p left changes the shown value,
    which equals expected_tau_text for the controls (what the browser test compares)."""
    from pathlib import Path

    from ddtree_lab import load_trace
    from ddtree_lab.views import tuner as tv

    run = load_trace(Path(__file__).resolve().parent.parent / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors")
    t = tv.Tuner(run)
    assert (t.temperature.value, t.top_k.value, t.top_p.value, t.budget.value) == (0.8, 0, 1.0, 32)
    before = t.expected_tau.value
    t.top_p.value = 0.95
    assert t.expected_tau.value != before
    assert t.expected_tau.value == tv.expected_tau_text(run, tv.params_from_controls(0.8, 0, 0.95, 0.0), 32)
    # the recorded parameters predict the observed mean tau of the recording within sampling noise
    res = t.state.data.analyse(SamplingParams(temperature=0.8), 32)
    obs = t.state.data.observed.double()
    se = float((obs - (res.expected_lo + res.expected_hi) / 2).std()) / len(obs) ** 0.5
    assert abs(float(obs.mean()) - sum(res.mean_expected) / 2) < 4 * se


def _two_request_run(small_run):
    from ddtree_lab.step import Run

    steps = []
    for k, s in enumerate(small_run.steps):  # interleaved as a batch records them: r0 s0, r1 s0, r0 s1 ...
        t = SimpleNamespace(**vars(s))
        t.request, t.request_id, t.step = k % 2, f"r{k % 2}", k // 2
        steps.append(t)
    return Run(metadata={"vocab_size": 300}, steps=steps, token_texts=small_run.token_texts)


def test_tuner_step_controls_are_request_and_step_and_the_chart_follows(small_run):
    """Issue 18.1: the step slider moves the per-step chart's selected bar, and it is the
    stepper's request + step (a position in the request), not a record index."""
    from ddtree_lab.views import tuner as tv

    t = tv.Tuner(_two_request_run(small_run))
    assert [o[0] for o in t.request.options] == ["request r0", "request r1"]
    assert t.step.max == 2 and t.state.step == 0
    t.step.value = 2  # request 0's third step: packed index 4
    assert t.state.step == 4 and t.state.data.steps[4].step == 2
    assert 'data-selected="4"' in t.per_step.value and "step 2 of request r0" in t.per_step.value
    assert "step 2 · request r0" in t.tree.value
    t.request.value = 1
    assert t.step.value == 0 and t.state.step == 1 and 'data-selected="1"' in t.per_step.value
    t.step.value = 1
    assert t.state.step == 3 and "step 1 · request r1" in t.tree.value
    with pytest.raises(ValueError, match="outside 0..2"):
        t.state.select(1, 3)


def test_tuner_chart_has_a_fixed_y_scale_request_labels_and_the_tree_style_of_the_views(small_run):
    """Issue 18.8: the per-step chart's y axis does not jump between settings, requests are
    labelled and separated, and the tree draws as the other views do (#i, grey edges)."""
    from ddtree_lab.views import tuner as tv

    t = tv.Tuner(_two_request_run(small_run))
    top = f">{t.state.data.max_depth + 1:.3g}</text>"
    assert top in t.per_step.value
    t.temperature.value = 1.5
    assert top in t.per_step.value
    assert "req r0" in t.per_step.value and "req r1" in t.per_step.value
    assert "#0 " in t.tree.value and "[0]" not in t.tree.value
    dot = tv.reach_tree_dot(t.state.data, t.result, 0, t.run)
    assert '[color="#bdbdbd"]' in dot and "#1 't" in dot and "fontsize=10" in dot
    capped = tv.reach_tree_dot(t.state.data, t.result, 0, t.run, max_children=1)
    root_kids = [i for i in range(1, t.state.data.steps[0].num_nodes) if int(t.state.data.steps[0].parents[i]) == 0]
    assert len(root_kids) > 1 and "more\\ntotal reach=" in capped
    assert capped.count("  n0 -> n") == 1 and "  n0 -> c" in capped  # one child, then the note
    # request by request on the x axis: one run of bars per request, the selected bar by its packed index
    assert t.state.chart_order() == [0, 2, 4, 1, 3, 5] and t.state.groups() == [(0, 3, "req r0"), (3, 6, "req r1")]


def test_sliders_that_change_nothing_are_off_with_the_reason_beside_them(small_run):
    """Issue 26.12: at top-k = 1 (temperature > 0) only the argmax survives, so temperature,
    top-p and min-p change nothing: they are off with a note; the expected τ does not move."""
    from ddtree_lab.views import tuner as tv

    t = tv.Tuner(small_run)
    assert t.params_note.value == "" and not t.temperature.disabled
    t.top_k.value = 1
    assert t.temperature.disabled and t.top_p.disabled and t.min_p.disabled and not t.top_k.disabled
    assert "top-k = 1" in t.params_note.value and "temperature, top-p, min-p change nothing" in t.params_note.value
    assert "ddtree-tuner-params-note" in t.params_note._dom_classes and "top-k = 1" in t.top_p.tooltip
    one = t.expected_tau.value
    data = t.state.data
    for p in (tv.params_from_controls(1.7, 1, 0.3, 0.2), tv.params_from_controls(0.0, 0, 1.0, 0.0)):
        assert tv.expected_tau_text(data, p, 16) == one  # what the note claims: the argmax alone
    t.top_k.value = 2
    assert not t.temperature.disabled and not t.top_p.disabled and t.params_note.value == ""
    t.temperature.value = 0.0
    assert not t.temperature.disabled and t.top_k.disabled and "temperature 0" in t.params_note.value


def test_the_tuner_tree_scrolls_in_its_own_box(small_run):
    """Issue 26.10: the tree sits in its own scrolling box (never shrunk, never widening the
    tuner), not clipped with the only scrollbar under the whole tuner."""
    from ddtree_lab.views import tuner as tv

    t = tv.Tuner(small_run)
    assert t.tree.value.startswith(f'<div class="{tv.TREE_CLASS}" style="overflow:auto;max-width:100%;')
    assert '<svg style="max-width:none" ' in t.tree.value and t.tree.layout.width == "100%"
