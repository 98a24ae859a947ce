"""Trace files: the shipped real traces load (v2, and a v1 file), replay bit for bit, stay
small; record_step (and the deprecated make_step_trace) at every level; compare_outputs; corrupted or bad files fail clearly."""

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ddtree_lab as dl
from ddtree_lab.store.container import write_container
from ddtree_lab.record import make_step_trace, record_step
from ddtree_lab.step import DraftTopK
from ddtree_lab.replaying import Difference, compare_outputs, replay_differences
from ddtree_lab.step import LEVELS, STAGES

TRACES = Path(__file__).resolve().parent.parent / "fixtures" / "traces"
GREEDY = TRACES / "smollm2_greedy_b32.ddtrace.safetensors"
SAMPLED = TRACES / "smollm2_t08_b32.ddtrace.safetensors"
V1 = Path(__file__).resolve().parent / "data" / "v1_t08_three_steps.ddtrace.safetensors"
V2_FIELDS = {"row_logit_ids": torch.int64, "row_logits": torch.float32, "row_logsumexp": torch.float64,
             "node_logits": torch.float32}


@pytest.mark.parametrize("path", [GREEDY, SAMPLED], ids=["greedy", "t0.8"])
def test_shipped_traces_replay_bit_for_bit(path):
    run = dl.load_trace(path)
    assert run.metadata["target"]["name"] == "SmolLM2-135M-Instruct"
    assert len(run.metadata["requests"]) == 3
    for step in run.steps:
        dl.replay(step)
        dl.check_retrieve(step.verify_input(), step.node_logws[None])
    for b in range(3):
        generated = run.generated_tokens(b)
        assert len(generated) == 64 or generated[-1] == 2
        # the steps' emitted tokens rebuild the committed text (after the prefill's first token)
        emitted = [t for s in run.for_request(b) for t in s.emitted]
        assert emitted[: len(generated) - 1] == generated[1:]


@pytest.mark.parametrize("path", [GREEDY, SAMPLED], ids=["greedy", "t0.8"])
def test_shipped_traces_are_v2_full_with_the_tuner_fields(path):
    run = dl.load_trace(path)
    m, vocab = run.metadata["top_m_logits"], run.metadata["vocab_size"]
    assert (m, vocab) == (64, 49152)
    for s in run.steps:
        assert s.level == "full" and s.missing() == []
        n = s.num_nodes
        for name, dtype in V2_FIELDS.items():
            assert getattr(s, name).dtype == dtype
        assert s.row_logit_ids.shape == s.row_logits.shape == (n, m) and s.row_logsumexp.shape == (n,)
        # sorted by descending logit, ties by ascending id; the log-sum-exp bounds the row
        vals, ids = s.row_logits, s.row_logit_ids
        assert bool((vals[:, :-1] >= vals[:, 1:]).all())
        tie = vals[:, :-1] == vals[:, 1:]
        assert bool((ids[:, :-1][tie] < ids[:, 1:][tie]).all())
        top_mass = torch.exp(vals.double() - s.row_logsumexp[:, None]).sum(-1)
        assert bool((top_mass <= 1 + 1e-9).all()) and bool((top_mass > 0).all())
        # node logits lie in their parent's row: inside its top-M they equal the stored logit
        assert torch.isnan(s.node_logits[0])
        for i in range(1, n):
            row_ids = ids[s.parents[i]].tolist()
            tok = int(s.node_token_ids[i])
            if tok in row_ids:
                assert s.node_logits[i] == vals[s.parents[i], row_ids.index(tok)]
            else:
                assert s.node_logits[i] <= vals[s.parents[i], -1]
        assert set(s.timings) <= set(STAGES) and "compile" in s.timings and "record" in s.timings


def test_a_version_1_trace_still_loads_and_replays():
    run = dl.load_trace(V1)
    assert len(run.steps) == 3
    for s in run.steps:
        assert s.level == "full" and s.missing() == list(V2_FIELDS)
        assert "compile" in s.timings and "retrieve" not in s.timings
        dl.replay(s)
        assert s.thresholds == (1.0, 1.0) and s.lossy is False  # written before thresholds were stored
    assert run.metadata["vocab_size"] == 49152 and run.metadata["top_m_logits"] is None


def test_trace_size_goal_64_tokens_at_b32():
    # goal: <= 5 MB for 64 generated tokens at B = 32 (the files hold 3 prompts x 64 tokens)
    for path in (GREEDY, SAMPLED):
        run = dl.load_trace(path)
        tokens = sum(len(r["generated_token_ids"]) for r in run.metadata["requests"])
        per_64 = path.stat().st_size / tokens * 64
        print(f"{path.name}: {path.stat().st_size / 1e6:.2f} MB for {tokens} tokens, {per_64 / 1e6:.3f} MB per 64")
        assert per_64 <= 5e6


def test_replay_detects_a_tampered_step():
    run = dl.load_trace(SAMPLED)
    step = next(s for s in run.steps if s.decisions)
    step.coins[step.decisions[0].parent] = 0.9999 if step.decisions[0].verdict == "accept" else 0.0
    with pytest.raises(dl.ReplayMismatch, match=f"step {step.step}, request {step.request}: request 0: decision 0 "):
        dl.replay(step)


def test_truncation_bound_covers_every_child_outside_the_display_rows():
    """The bound is the mass outside a row's display top-m: every child token the display row
    leaves out carries at most that much, summed over the row's children."""
    run = dl.load_trace(SAMPLED)
    checked = 0
    for step in run.steps[:20]:
        bound = step.truncation_bound()
        assert bound.shape == (step.num_nodes,)
        torch.testing.assert_close(bound, (1.0 - step.top_probs.double().sum(-1)).clamp(min=0.0))
        outside: dict[int, float] = {}
        for i in range(1, step.num_nodes):
            parent = int(step.parents[i])
            if int(step.node_token_ids[i]) not in step.top_token_ids[parent].tolist():
                outside[parent] = outside.get(parent, 0.0) + float(step.child_probs[i])
        for parent, mass in outside.items():
            assert mass <= float(bound[parent]) + 1e-6, (step.step, step.request, parent, mass, float(bound[parent]))
            checked += 1
    assert checked > 0  # some children lie outside their parent's display rows


# -- record_step on synthetic steps --------------------------------------------------------


def _synthetic(params, vocab=300, budget=12, seed=0, **thresholds):
    """A verified batch of two requests on random (tied) target logits (``thresholds``:
    ``threshold_single`` / ``threshold_acc`` for the verifier)."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(2, 4, vocab, generator=g) * 3
    ids, lps = dl.draft_topk_from_logits(draft, k=6)
    tree = dl.build_tree(ids, lps, torch.tensor([1, 2]), budget)
    vi = dl.compile_retrieve(tree, torch.tensor([5, 9]))
    logits = (torch.randn(2, vi.num_rows, vocab, generator=g) * 2).round()  # many exact ties
    logits[:, :, 7] = float("-inf")  # a banned token
    probs = dl.target_probs(logits, params, num_nodes=vi.num_nodes)
    coins, final = dl.draw_coins(dl.make_generators([dl.SamplingParams(seed=seed), dl.SamplingParams(seed=seed + 1)]),
                                 vi.num_rows)
    out = dl.verify_sampled(vi, probs, coins, final, **thresholds)
    return tree, vi, ids, lps, logits, probs, coins, final, out


def _make(b, level, data, params, with_probs=True):
    from ddtree_lab.session import _request_output

    tree, vi, ids, lps, logits, probs, coins, final, out = data
    return record_step(
        step=3, request=b, params=params, output=_request_output(out, b), level=level, prefix_len=5,
        tree=tree.request(b), buffers=vi.request(b), draft=DraftTopK(ids[b], lps[b]), coins=coins[b],
        final_coin=float(final[b]), logits=logits[b], probs=probs[b] if with_probs else None,
        top_m_logits=20, timings={"draft": 0.5, "retrieve": 0.1})


def _make_flat(b, level, data, params):
    """The same step through the deprecated flat-field constructor."""
    from ddtree_lab.session import _request_output

    tree, vi, ids, lps, logits, probs, coins, final, out = data
    n = int(tree.num_nodes[b])
    local = vi.request(b)
    return make_step_trace(
        step=3, request=b, params=params, output=_request_output(out, b), level=level, prefix_len=5,
        node_token_ids=tree.node_token_ids[b, :n], parents=tree.parents[b, :n], depths=tree.depths[b, :n],
        ranks=tree.ranks[b, :n], node_logws=tree.node_logws[b, :n],
        retrieve_next_token=local.retrieve_next_token[0, :n], retrieve_next_sibling=local.retrieve_next_sibling[0, :n],
        positions=vi.positions[b, :n], draft_token_ids=ids[b], draft_logprobs=lps[b], coins=coins[b, :n],
        final_coin=float(final[b]), logits=logits[b, :n], probs=probs[b, :n],
        top_m_logits=20, timings={"draft": 0.5, "retrieve": 0.1})


@pytest.mark.parametrize("level", ["full", "light", "off"])
def test_record_step_keeps_the_stage_objects_and_the_flat_constructor_agrees(level):
    params = dl.SamplingParams(temperature=0.7, top_p=0.9)
    data = _synthetic(params, budget=9)
    tree, vi = data[0], data[1]
    for b in range(2):
        s = _make(b, level, data, params)
        n = int(tree.num_nodes[b])
        assert s.num_nodes == n
        if level == "off":
            assert s.tree is None and s.buffers is None and s.rows is None
        else:
            # the tree and the buffers the stages produced, cut to the request's nodes: nothing rebuilt
            assert s.tree.equals(tree.request(b).compact()) and s.tree.num_rows == n
            local = vi.request(b)
            assert torch.equal(s.buffers.tree_mask, local.tree_mask[:, :n, :n])
            assert torch.equal(s.retrieve_next_sibling, local.retrieve_next_sibling[0, :n])
            assert s.buffers.node_token_ids.data_ptr() != vi.node_token_ids.data_ptr()  # a copy, on the host
        with pytest.warns(DeprecationWarning, match="record_step"):
            f = _make_flat(b, level, data, params)
        assert f.missing() == s.missing() and f.decisions == s.decisions and f.emitted == s.emitted
        for name in ("node_token_ids", "parents", "depths", "ranks", "node_logws", "retrieve_next_token", "positions",
                     "coins", "child_probs", "top_probs", "final_row_prefix", "row_logits", "node_logits"):
            a, c = getattr(s, name), getattr(f, name)
            assert (a is None) == (c is None), name
            if a is not None:
                assert torch.equal(a.nan_to_num(-7.0), c.nan_to_num(-7.0)), name


def test_old_names_warn_at_the_front_door_only():
    import ddtree_lab.step as step_module

    for old, new in (("StepTrace", dl.Step), ("RunTrace", dl.Run)):
        with pytest.warns(DeprecationWarning, match=old):
            assert getattr(dl, old) is new
        assert not hasattr(step_module, old)
    with pytest.warns(DeprecationWarning):
        assert dl.make_step_trace is make_step_trace
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        getattr(dl, "NoSuchName")


@pytest.mark.parametrize("params", [dl.SamplingParams(temperature=0.0), dl.SamplingParams(temperature=0.7, top_p=0.9)],
                         ids=["greedy", "t0.7"])
def test_make_step_trace_full_fields_are_exact(params):
    data = _synthetic(params)
    logits = data[4]
    for b in range(2):
        s = _make(b, "full", data, params)
        n = s.num_nodes
        rows = logits[b, :n]
        # top-M by descending logit, ties by ascending id: a stable sort of the ids does the same
        order = torch.sort(-rows, dim=-1, stable=True).indices[:, :20]
        assert torch.equal(s.row_logit_ids, order)
        assert torch.equal(s.row_logits, rows.gather(-1, order))
        assert torch.equal(s.row_logsumexp, torch.logsumexp(rows.double(), -1))
        assert torch.equal(s.node_logits[1:], rows[s.parents[1:], s.node_token_ids[1:]])
        assert s.timings == {"draft": 0.5, "compile": 0.1}
        dl.replay(s)
        # without the verify rows given, they are computed from the logits: same trace
        t = _make(b, "full", data, params, with_probs=False)
        assert torch.equal(t.child_probs, s.child_probs) and torch.equal(t.final_row_prefix, s.final_row_prefix)


@pytest.mark.parametrize("params", [dl.SamplingParams(temperature=0.0), dl.SamplingParams(temperature=1.3, top_k=40)],
                         ids=["greedy", "t1.3"])
def test_make_step_trace_light_and_off(params, tmp_path):
    data = _synthetic(params, seed=4)
    steps = []
    for b in range(2):
        full = _make(b, "full", data, params)
        light = _make(b, "light", data, params, with_probs=False)
        off = _make(b, "off", data, params)
        assert light.level == "light" and set(light.missing()) == {"top_token_ids", "top_probs", *V2_FIELDS}
        assert off.missing() == [k for k in __import__("ddtree_lab.io.lab_trace", fromlist=["x"]).TENSOR_FIELDS if k not in ("accept_index", "emitted_tokens")]
        # light keeps exactly the rows the walk read: children of visited nodes
        visited = set(full.accepted_path)
        for i in range(1, full.num_nodes):
            if int(full.parents[i]) in visited:
                assert light.child_probs[i] == full.child_probs[i]
            else:
                assert torch.isnan(light.child_probs[i])
        assert torch.equal(light.final_row_prefix, full.final_row_prefix)
        dl.replay(light)
        with pytest.raises(ValueError, match="level 'off'"):
            dl.replay(off)
        assert off.num_nodes == full.num_nodes and off.emitted == full.emitted
        steps += [light, off]
    path = dl.save_trace(dl.Run({"target": {"vocab_size": 300}}, steps), tmp_path / "levels.ddtrace.safetensors")
    back = dl.load_trace(path)
    assert [s.level for s in back.steps] == ["light", "off"] * 2
    for a, s in zip(back.steps, steps):
        assert a.missing() == s.missing() and a.decisions == s.decisions and a.emitted == s.emitted
        if s.level == "light":
            dl.replay(a)


def test_make_step_trace_refuses_bad_input():
    params = dl.SamplingParams(temperature=1.0)
    data = _synthetic(params)
    with pytest.raises(ValueError, match="level must be one of"):
        _make(0, "medium", data, params)
    tree, vi, ids, lps, logits, probs, coins, final, out = data
    with pytest.raises(ValueError, match="output must be a VerifyOutput of one request"):
        record_step(step=0, request=0, params=params, tree=tree.request(0), buffers=vi.request(0), output=out,
                    coins=coins[0], final_coin=float(final[0]), logits=logits[0])
    with pytest.raises(ValueError, match="step 0, request 0: tree must be a batch of one request, got 2"):
        from ddtree_lab.session import _request_output

        record_step(step=0, request=0, params=params, tree=tree, buffers=vi, output=_request_output(out, 0),
                    coins=coins[0], final_coin=float(final[0]), logits=logits[0])
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="output must be a VerifyOutput of one"):
        make_step_trace(step=0, request=0, params=params, output=out)
    bad = list(data)
    bad[4] = logits.clone()
    bad[4][0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="step 3, request 0: logits of node 1 have NaN"):
        _make(0, "full", bad, params)
    path = [i for i in out.accept_index[0].tolist() if i >= 0]
    bad[4] = logits.clone()
    bad[4][0, path[-1], 5] = float("nan")  # a row the walk read
    with pytest.raises(ValueError, match=f"step 3, request 0: logits of node {path[-1]} have NaN"):
        _make(0, "light", bad, params, with_probs=False)


# -- compare_outputs ---------------------------------------------------------------------------


def test_compare_outputs_names_each_difference():
    import dataclasses

    run = dl.load_trace(SAMPLED)
    step = next(s for s in run.steps if len(s.decisions) >= 2)
    rec = step.output
    assert compare_outputs(rec, dl.replay(step)) == []
    d = rec.decisions[0][0]
    flipped = dataclasses.replace(d, verdict="reject" if d.verdict == "accept" else "accept")
    nudged = dataclasses.replace(rec.decisions[0][1], target_prob=rec.decisions[0][1].target_prob + 1e-7)
    other = dataclasses.replace(rec, decisions=[[flipped, nudged, *rec.decisions[0][2:]]],
                                bonus_token=rec.bonus_token + 1)
    diffs = compare_outputs(rec, other)
    assert [x.field for x in diffs] == ["decision 0 verdict", "decision 1 target_prob", "bonus_token"]
    assert diffs[0] == Difference(0, "decision 0 verdict", d.verdict, flipped.verdict, 0, d.node)
    assert str(diffs[0]) == f"request 0: decision 0 verdict (node {d.node}): recorded {d.verdict!r} != replayed {flipped.verdict!r}"
    # within a kernel tolerance the nudged probability agrees; verdicts and tokens never do
    assert [x.field for x in compare_outputs(rec, other, tolerance=(2e-6, 2e-5))] == ["decision 0 verdict", "bonus_token"]
    shorter = dataclasses.replace(rec, decisions=[rec.decisions[0][:1]])
    assert [x.field for x in compare_outputs(rec, shorter)][:1] == ["decision 1"]
    assert compare_outputs(rec, shorter, decisions=False) == []


# -- files others hand you ---------------------------------------------------------------------


def _data_offset(path: Path, key: str) -> int:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    return 8 + size + header[key]["data_offsets"][0]


def test_a_corrupted_data_region_is_refused_naming_step_and_field(tmp_path):
    bad = tmp_path / "flipped.ddtrace.safetensors"
    raw = bytearray(GREEDY.read_bytes())
    at = _data_offset(GREEDY, "3.node_token_ids")
    raw[at + 5] ^= 0x7F  # a token id becomes ~1e14: replay would try to allocate petabytes
    bad.write_bytes(bytes(raw))
    with pytest.raises(dl.TraceFormatError) as err:
        dl.load_trace(bad)
    msg = str(err.value)
    assert msg == f"{bad}: step 3: field 'node_token_ids': checksum mismatch: the file is corrupted"
    assert "\n" not in msg


def test_an_edited_document_or_a_shape_the_document_does_not_declare_is_refused(tmp_path):
    with safe_open(str(GREEDY), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    doc = json.loads(meta["ddtree_lab"])
    edited = tmp_path / "edited.safetensors"
    save_file(tensors, str(edited), metadata={**meta, "ddtree_lab": meta["ddtree_lab"].replace('"accept"', '"reject"', 1)})
    with pytest.raises(dl.TraceFormatError, match="JSON document fails its checksum"):
        dl.load_trace(edited)
    # a consistent file whose tensor disagrees with its own tree: shape checked before use
    doc.pop("tensors")
    tensors["2.coins"] = torch.zeros(3)
    shaped = tmp_path / "shaped.safetensors"
    write_container(shaped, doc, tensors)
    with pytest.raises(dl.TraceFormatError, match=r"step 2: field 'coins': shape \(3,\), expected \[\d+\]"):
        dl.load_trace(shaped)


def test_save_trace_creates_no_directories(tmp_path):
    run = dl.load_trace(V1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        dl.save_trace(run, tmp_path / "no" / "dir" / "x.ddtrace.safetensors")
    assert not (tmp_path / "no").exists()
    out = dl.save_trace(run, tmp_path / "x.ddtrace.safetensors")
    assert [s.step for s in dl.load_trace(out).steps] == [s.step for s in run.steps]


def _resigned(path: Path, tmp_path: Path, edit) -> Path:
    """A consistent copy of a v2 trace whose JSON document was edited (and checksummed again)."""
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        doc = json.loads(f.metadata()["ddtree_lab"])
    edit(doc, tensors)
    doc.pop("tensors")
    out = tmp_path / "edited.ddtrace.safetensors"
    write_container(out, doc, tensors)
    return out


def test_bad_files_fail_with_clear_errors(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(dl.TraceFormatError, match="not a safetensors file"):
        dl.load_trace(junk)
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(dl.TraceFormatError, match="not a ddtree-lab trace"):
        dl.load_trace(plain)
    future = tmp_path / "future.safetensors"
    save_file({"x": torch.zeros(2)}, str(future),
              metadata={"ddtree_lab": json.dumps({"format": "ddtree-lab-trace", "version": 99, "steps": []})})
    with pytest.raises(dl.TraceFormatError, match="trace version 99"):
        dl.load_trace(future)
    with pytest.raises(FileNotFoundError):
        dl.load_trace(tmp_path / "absent.safetensors")
    missing = _resigned(GREEDY, tmp_path, lambda doc, t: t.pop("3.coins"))
    with pytest.raises(dl.TraceFormatError, match="step 3: tensor field 'coins' is missing"):
        dl.load_trace(missing)
    # version 1: no checksums, still every field and shape checked
    with safe_open(str(V1), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "1.coins"}
        meta = f.metadata()
    broken = tmp_path / "broken_v1.safetensors"
    save_file(tensors, str(broken), metadata=meta)
    with pytest.raises(dl.TraceFormatError, match="step 1: tensor field 'coins' is missing"):
        dl.load_trace(broken)


def test_a_trace_with_invalid_params_or_broken_buffers_is_refused(tmp_path):
    def edit(doc, tensors):
        doc["steps"][2]["params"]["temperature"] = -1

    bad = _resigned(GREEDY, tmp_path, edit)
    with pytest.raises(dl.TraceFormatError, match="step 2: params: temperature must be finite and >= 0"):
        dl.load_trace(bad)
    run = dl.load_trace(GREEDY)
    step = next(s for s in run.steps if s.num_nodes > 2)
    step.retrieve_next_token[1] = 0  # points back at the root
    with pytest.raises(dl.ReplayMismatch, match="recorded buffers are broken"):
        dl.replay(step)


def test_replay_differences_lists_every_difference():
    run = dl.load_trace(SAMPLED)
    step = next(s for s in run.steps if s.accept_length >= 1)
    out, diffs = replay_differences(step)
    assert diffs == [] and out.accept_length.tolist() == [step.accept_length]
    k, first = next((k, d) for k, d in enumerate(step.decisions) if d.verdict == "accept")
    step.child_probs[first.node] = 0.0  # the accepted child now has no mass: the walk changes
    _, diffs = replay_differences(step)
    assert diffs and diffs[0].field == f"decision {k} target_prob" and diffs[0].node == first.node
    assert any(d.field == "accept_index" for d in diffs)


def test_levels_and_stages_are_named_once():
    assert LEVELS == ("full", "light", "off")
    assert STAGES == ("draft", "build", "compile", "target", "verify", "record", "commit")


def test_top_logits_order_equals_a_stable_sort_with_and_without_ties():
    from ddtree_lab.record import _top_logits

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        vocab, n, m = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 300), (1, 5), (1, 80)))
        x = torch.randn(n, vocab, generator=g) if trial % 3 == 0 else torch.randint(-3, 3, (n, vocab), generator=g).float()
        ids, vals = _top_logits(x, m)
        order = torch.sort(-x, dim=-1, stable=True).indices[:, : min(m, vocab)]
        assert torch.equal(ids, order) and torch.equal(vals, x.gather(-1, order))


def test_a_live_light_recording_replays_and_names_what_it_lacks(target, drafter, tmp_path):
    params = [dl.SamplingParams(temperature=0.0), dl.SamplingParams(temperature=0.9, top_p=0.9, seed=5)]
    session = dl.LiveSession(target, drafter, budget=8, sampling=params, record="light")
    run = session.run(["Name a colour.", "Count to three."], max_new_tokens=6)
    assert run.steps and {s.level for s in run.steps} == {"light"}
    back = dl.load_trace(dl.save_trace(run, tmp_path / "light.ddtrace.safetensors"))
    for s in back.steps:
        assert set(s.missing()) == {"top_token_ids", "top_probs", *V2_FIELDS}
        assert s.backend == session.verify_backend
        dl.replay(s)


def test_lossy_thresholds_round_trip_and_show_in_the_views(tmp_path):
    from ddtree_lab.views import decisions_table_html, decisions_text, step_view, to_dot, to_text

    params = dl.SamplingParams(temperature=1.0)
    tree, vi, ids, lps, logits, probs, coins, final, _ = _synthetic(params, seed=2)
    p1 = float(probs[0, 0, tree.node_token_ids[0, 1]])
    assert 0 < p1 < 0.5
    coins[0, 0] = 1.5 * p1  # S_1 <= u < S_1 / 0.5: the exact rule rejects node 1, threshold_acc = 0.5 accepts it
    outs = [dl.verify_sampled(vi, probs, coins, final, threshold_acc=t) for t in (0.5, 1.0)]
    lossy, exact = (_make(0, "full", (tree, vi, ids, lps, logits, probs, coins, final, o), params) for o in outs)
    assert lossy.thresholds == (1.0, 0.5) and lossy.lossy
    assert exact.thresholds == (1.0, 1.0) and not exact.lossy
    path = dl.save_trace(dl.Run({"target": {"vocab_size": 300}}, [lossy, exact]), tmp_path / "t.ddtrace.safetensors")
    back = dl.load_trace(path)
    assert [(s.thresholds, s.lossy) for s in back.steps] == [((1.0, 0.5), True), ((1.0, 1.0), False)]
    for s in back.steps:
        dl.replay(s)  # a lossy step replays under its own thresholds
    assert lossy.decisions[0].verdict == "accept" and exact.decisions[0].verdict == "reject"
    mark = "LOSSY: threshold_acc=0.5"
    view, plain = step_view(back.steps[0]), step_view(back.steps[1])
    assert view.lossy and view.lossy_mark == mark and mark in view.title
    assert mark in to_dot(view) and 'fontcolor="#c00000"' in to_dot(view)
    assert mark in to_text(view) and decisions_text(view).startswith(mark)
    assert mark in decisions_table_html(view) and "#c00000" in decisions_table_html(view)
    for text in (to_dot(plain), to_text(plain), decisions_text(plain), decisions_table_html(plain)):
        assert "LOSSY" not in text and "#c00000" not in text


def test_a_step_with_bad_thresholds_is_refused(tmp_path):
    src = dl.save_trace(dl.load_trace(V1), tmp_path / "v2.ddtrace.safetensors")

    def edit(value, lossy=None):
        def f(doc, tensors):
            doc["steps"][1]["thresholds"] = value
            if lossy is not None:
                doc["steps"][1]["lossy"] = lossy
        return f

    for value, lossy, why in (([1.0, -0.5], None, "thresholds must be"), ([1.0], None, "thresholds must be"),
                              ([1.0, 0.5], False, "disagrees with thresholds")):
        bad = _resigned(src, tmp_path, edit(value, lossy))
        with pytest.raises(dl.TraceFormatError, match=f"step 1: .*{why}"):
            dl.load_trace(bad)
