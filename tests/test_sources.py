"""The two outside sources: DDTree reference tree traces and engine acceptance summaries.

Fixtures parse to exactly what their scripts wrote; damaged inputs name request, round and
field; the conversions give Steps with only what the source holds; the run summary says what
is missing.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import types
from pathlib import Path

import pytest
import torch

from ddtree_lab.io.acceptance import AcceptanceSummaryError, read_acceptance_summaries
from ddtree_lab.io.ddtree_reference import ReferenceTraceError, read_reference_traces
from ddtree_lab.views import run_summary as rs

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "fixtures" / "ddtree_reference"
ENG = ROOT / "fixtures" / "engine_summaries"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ref_script = _script("make_reference_fixture")
eng_script = _script("make_engine_summary_fixture")


# -- reference traces: fixtures ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["fork_traces.json", "generate_result.jsonl", "generate_result.pt"])
def test_reference_fixture_matches_script(name):
    want = ref_script.make_requests()[name]
    got = read_reference_traces(REF / name)
    assert got.problems == []
    assert len(got.requests) == len(want)
    for req, w in zip(got.requests, want):
        assert len(req.rounds) == len(w["round_trees"])
        assert req.acceptance_lengths == w["acceptance_lengths"]
        for rnd, wr in zip(req.rounds, w["round_trees"]):
            assert list(rnd.accepted_indices) == wr["accepted_indices"]
            assert list(rnd.node_token_ids) == wr["tree"]["node_token_ids"]
            assert list(rnd.node_depths) == wr["tree"]["node_depths"]
            assert list(rnd.parents) == wr["tree"]["parents"]
            assert rnd.tau == len(wr["accepted_indices"])
        if "output_ids" in w:
            assert req.stage_times == pytest.approx(w["stage_times"])
            assert req.round_timestamps == pytest.approx(w["round_timestamps"])
            ids, start = w["output_ids"][0], w["num_input_tokens"]
            for rnd, length in zip(req.rounds, w["acceptance_lengths"]):
                assert rnd.prefix_len == start and rnd.root_token == ids[start]
                assert rnd.bonus_token == ids[start + length]
                start += length
            assert req.missing == []
        else:
            assert req.output_ids is None and req.stage_times is None
            assert all(r.root_token is None and r.prefix_len is None for r in req.rounds)
            assert "stage_times" in req.missing and "output_ids" in req.missing


def test_reference_fixture_files_are_the_scripts_output(tmp_path):
    ref_script.write(tmp_path)
    for name in ("fork_traces.json", "generate_result.jsonl"):
        assert (tmp_path / name).read_text() == (REF / name).read_text(), name


def test_reference_sibling_rank_is_the_heap_rank():
    # children appear in pop order, so a node's sibling rank is its token's rank at its depth
    for req in read_reference_traces(REF / "generate_result.jsonl").requests:
        for rnd in req.rounds:
            for i in range(1, rnd.num_nodes):
                earlier = [j for j in range(1, i) if rnd.parents[j] == rnd.parents[i]]
                assert rnd.sibling_ranks[i] == len(earlier)


# -- reference traces: damaged input ----------------------------------------------------------

def _one_request():
    return copy.deepcopy(ref_script.make_requests()["generate_result.jsonl"][0])


def _damaged(tmp_path, damage) -> Path:
    obj = _one_request()
    damage(obj)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(obj))
    return p


def _swap_parent(o):
    t = o["round_trees"][2]["tree"]
    t["parents"][3] = 5  # node 3 now names a later node as its parent


DAMAGES = [
    ("missing parents", lambda o: o["round_trees"][1]["tree"].pop("parents"), 1, "tree.parents"),
    ("missing accepted", lambda o: o["round_trees"][0].pop("accepted_indices"), 0, "accepted_indices"),
    ("float depth", lambda o: o["round_trees"][3]["tree"]["node_depths"].__setitem__(2, 2.0), 3, "tree.node_depths"),
    ("string token", lambda o: o["round_trees"][1]["tree"]["node_token_ids"].__setitem__(0, "17"), 1,
     "tree.node_token_ids"),
    ("short parents", lambda o: o["round_trees"][2]["tree"]["parents"].pop(), 2, "tree.parents"),
    ("parent after child", _swap_parent, 2, "tree.parents"),
    ("depth vs parent", lambda o: o["round_trees"][1]["tree"]["node_depths"].__setitem__(4, 9), 1, "tree.node_depths"),
    ("path not a child", lambda o: o["round_trees"][0]["accepted_indices"].__setitem__(1, 12), 0, "accepted_indices"),
    ("tau disagrees", lambda o: o["acceptance_lengths"].__setitem__(2, 99), 2, "acceptance_lengths"),
    ("output disagrees", lambda o: o["output_ids"][0].__setitem__(o["num_input_tokens"] + 1, 3), 0, "output_ids"),
]


@pytest.mark.parametrize("label,damage,rnd,fld", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_reference_damage_names_round_and_field(tmp_path, label, damage, rnd, fld):
    p = _damaged(tmp_path, damage)
    with pytest.raises(ReferenceTraceError) as e:
        read_reference_traces(p)
    assert (e.value.request, e.value.round, e.value.field) == (0, rnd, fld), str(e.value)
    assert f"round {rnd}" in str(e.value) and repr(fld) in str(e.value)
    # not strict: that round is named and left out, the other rounds stay readable
    t = read_reference_traces(p, strict=False)
    assert [(x.round, x.field) for x in t.problems] == [(rnd, fld)]
    assert [r.round for r in t.requests[0].rounds] == [r for r in range(4) if r != rnd]
    # later rounds keep their offsets, unless the damaged field is the tau they come from
    w = _one_request()
    starts = [w["num_input_tokens"] + sum(w["acceptance_lengths"][:k]) for k in range(4)]
    for r in t.requests[0].rounds:
        want = None if fld == "acceptance_lengths" and r.round > rnd else starts[r.round]
        assert r.prefix_len == want, (r.round, r.prefix_len, want)


def test_reference_per_request_field_and_missing_round_trees(tmp_path):
    p = _damaged(tmp_path, lambda o: o["stage_times"].__setitem__("verify", -1.0))
    with pytest.raises(ReferenceTraceError, match="stage 'verify'") as e:
        read_reference_traces(p)
    assert (e.value.round, e.value.field) == (None, "stage_times")
    p = _damaged(tmp_path, lambda o: o.pop("round_trees"))
    with pytest.raises(ReferenceTraceError, match="save_tree_traces=True"):
        read_reference_traces(p)


def test_reference_torch_tensors_checked_and_namespaces_refused(tmp_path):
    obj = _one_request()
    obj["output_ids"] = torch.tensor(obj["output_ids"])
    obj["round_trees"][1]["tree"]["node_depths"] = torch.tensor(obj["round_trees"][1]["tree"]["node_depths"],
                                                                dtype=torch.float32)
    torch.save({"responses": [{"ddtree_tb12": obj}]}, tmp_path / "dtype.pt")
    with pytest.raises(ReferenceTraceError, match="dtype torch.float32") as e:
        read_reference_traces(tmp_path / "dtype.pt")
    assert (e.value.round, e.value.field) == (1, "tree.node_depths")
    obj["round_trees"][1]["tree"]["node_depths"] = torch.tensor([obj["round_trees"][0]["tree"]["node_depths"]])
    torch.save([obj], tmp_path / "shape.pt")
    with pytest.raises(ReferenceTraceError, match=r"shape \[1, 12\]"):
        read_reference_traces(tmp_path / "shape.pt")
    # the reference's own benchmark file: SimpleNamespace results, refused by weights_only
    ns = types.SimpleNamespace(**_one_request())
    torch.save({"responses": [{"ddtree_tb12": ns}], "block_size": 8}, tmp_path / "bench.pt")
    with pytest.raises(ReferenceTraceError, match="types.SimpleNamespace.*vars\\(result\\)"):
        read_reference_traces(tmp_path / "bench.pt")


# -- engine summaries --------------------------------------------------------------------------

def test_vllm_summaries_match_script():
    steps = eng_script.make_steps()
    chat = read_acceptance_summaries(ENG / "vllm_chat_summary.jsonl")
    assert chat.engine == "vllm" and len(chat.requests) == 3
    for rec, s in zip(chat.requests, steps["vllm_chat_summary.jsonl"]):
        assert rec.num_steps == len(s) and rec.num_accepted_draft_tokens == sum(s)
        assert rec.accept_histogram == [s.count(j) for j in range(eng_script.K_VLLM + 1)]
        assert rec.tau_mean() == pytest.approx(1 + sum(s) / len(s)) == pytest.approx(rec.reported_accept_length)
        assert rec.per_step_accepted is None and "per_step_accepted" in rec.missing and rec.taus() is None
    det = read_acceptance_summaries(ENG / "vllm_offline_detailed.json")
    for rec, s in zip(det.requests, steps["vllm_offline_detailed.json"]):
        assert rec.per_step_accepted == s and rec.taus() == [a + 1 for a in s]
        assert rec.per_step_drafted == [eng_script.K_VLLM] * len(s)
    pooled = [a for s in steps["vllm_chat_summary.jsonl"] for a in s]
    for name in ("vllm_get_metrics.json", "vllm_metrics.prom"):
        (agg,) = read_acceptance_summaries(ENG / name).requests
        assert agg.level == "engine aggregate" and agg.num_steps == len(pooled)
        assert agg.accept_histogram == [pooled.count(j) for j in range(eng_script.K_VLLM + 1)], name
        assert agg.accepted_per_position == [sum(a > i for a in pooled) for i in range(eng_script.K_VLLM)]


def test_sglang_summaries_old_and_new_names():
    steps = eng_script.make_steps()["sglang_generate.jsonl"]
    recs = read_acceptance_summaries(ENG / "sglang_generate.jsonl").requests
    assert [r.source_fields["accept_histogram"] for r in recs] == ["spec_correct_drafts_histogram"] * 2 + [
        "spec_accept_histogram"]
    for rec, s in zip(recs, steps):
        assert rec.engine == "sglang" and rec.num_steps == len(s)
        assert rec.num_accepted_draft_tokens == sum(s)
        assert rec.accept_histogram == [s.count(j) for j in range(max(s) + 1)]
        assert rec.num_spec_tokens == eng_script.SGLANG_DRAFT_TOKENS - 1
        # SGLang's own number counts the prefill token: above the mean tau by 1 / steps
        assert rec.reported_accept_length == pytest.approx(rec.tau_mean() + 1 / len(s))


def _vllm_line(mutate):
    obj = json.loads((ENG / "vllm_chat_summary.jsonl").read_text().splitlines()[1])
    mutate(obj["metrics"])
    return obj


@pytest.mark.parametrize("mutate,fld", [
    (lambda m: m["speculative_decoding"]["acceptance_histogram"].__setitem__(0, 99), "acceptance_histogram"),
    (lambda m: m["speculative_decoding"].__setitem__("num_spec_steps", "25"), "num_spec_steps"),
    (lambda m: m["speculative_decoding"].__setitem__("mean_acceptance_length", 3.0), "mean_acceptance_length"),
    (lambda m: m["speculative_decoding"]["acceptance_histogram"].pop(), "acceptance_histogram"),
    (lambda m: m.__setitem__("speculative_decoding", None), "metrics.speculative_decoding"),
])
def test_vllm_damage_names_request_and_field(tmp_path, mutate, fld):
    good = json.loads((ENG / "vllm_chat_summary.jsonl").read_text().splitlines()[0])
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(good) + "\n" + json.dumps(_vllm_line(mutate)) + "\n")
    with pytest.raises(AcceptanceSummaryError) as e:
        read_acceptance_summaries(p)
    assert (e.value.request, e.value.field) == (1, fld), str(e.value)


def test_engine_damage_per_step_and_aliases(tmp_path):
    outs = json.loads((ENG / "vllm_offline_detailed.json").read_text())
    outs[1]["spec_decode_metrics"]["per_step_accepted"].pop()
    (tmp_path / "d.json").write_text(json.dumps(outs))
    with pytest.raises(AcceptanceSummaryError) as e:
        read_acceptance_summaries(tmp_path / "d.json")
    assert (e.value.request, e.value.field) == (1, "per_step_accepted")
    resp = json.loads((ENG / "sglang_generate.jsonl").read_text().splitlines()[0])
    resp["meta_info"]["spec_accept_histogram"] = [0] + resp["meta_info"]["spec_correct_drafts_histogram"]
    (tmp_path / "s.json").write_text(json.dumps(resp))
    with pytest.raises(AcceptanceSummaryError, match="disagrees") as e:
        read_acceptance_summaries(tmp_path / "s.json")
    assert e.value.field == "spec_correct_drafts_histogram"
    (tmp_path / "n.json").write_text(json.dumps({"text": "x", "meta_info": {"id": "a"}}))
    with pytest.raises(AcceptanceSummaryError, match="spec_verify_ct"):
        read_acceptance_summaries(tmp_path / "n.json", engine="sglang")


# -- views ---------------------------------------------------------------------------------------

def test_reference_stats_count_what_the_script_wrote():
    want = ref_script.make_requests()["generate_result.jsonl"]
    st = rs.reference_stats(read_reference_traces(REF / "generate_result.jsonl"))
    lengths = [t for w in want for t in w["acceptance_lengths"]]
    assert st["tau"] == lengths and st["tau_mean"] == pytest.approx(sum(lengths) / len(lengths))
    # accepted at depth d = rounds whose path reached depth d
    assert st["by_depth"]["accepted"] == [sum(t > d for t in lengths) for d in range(1, len(st["by_depth"]["depth"]) + 1)]
    assert sum(st["rank_totals"].values()) == sum(t - 1 for t in lengths)
    assert st["stage_times"]["verify"] == pytest.approx(sum(w["stage_times"]["verify"] for w in want))


def test_summary_text_names_what_is_missing():
    text = rs.run_summary_text(read_reference_traces(REF / "fork_traces.json"))
    assert "stage times: missing" in text and "target rows" in text and "verify replay" in text
    assert "accepted draft tokens + 1" in text
    html = rs.run_summary_html(read_reference_traces(REF / "generate_result.jsonl"))
    assert "acceptance by depth" in html and "verify replay" in html and "tree_build_heap" in html
    text = rs.run_summary_text(read_acceptance_summaries(ENG / "vllm_chat_summary.jsonl"))
    assert "missing: trees" in text and "no step order" in text and "acceptance by sibling rank" in text
    assert "no step order" not in rs.run_summary_text(read_acceptance_summaries(ENG / "vllm_offline_detailed.json"))


def test_serving_beside_lab():
    serving = read_acceptance_summaries(ENG / "vllm_chat_summary.jsonl")
    data = rs.serving_vs_lab(serving, {"greedy (T=0)": [3, 4, 1, 8], "T=1": [1, 2, 2]})
    first, greedy, sampled = data["series"]
    pooled = [a + 1 for s in eng_script.make_steps()["vllm_chat_summary.jsonl"] for a in s]
    assert first["steps"] == len(pooled) and first["tau_mean"] == pytest.approx(sum(pooled) / len(pooled))
    assert dict(zip(first["tau"], first["count"])) == {t: pooled.count(t) for t in set(pooled)}
    assert sum(greedy["fraction"]) == pytest.approx(1) and sampled["tau_mean"] == pytest.approx(5 / 3)
    fig = rs.serving_vs_lab_figure(data)
    assert len(fig.data) == 3 and list(fig.data[2].x) == [1, 2]
    with pytest.raises(ValueError, match="lab side"):
        rs.serving_vs_lab(serving, {})



def test_sources_told_apart():
    from ddtree_lab.io import source_of
    from ddtree_lab.io.acceptance import looks_like_summary
    from ddtree_lab.io.ddtree_reference import looks_like_reference

    for name in ("fork_traces.json", "generate_result.jsonl", "generate_result.pt"):
        assert looks_like_reference(REF / name) and not looks_like_summary(REF / name), name
        assert source_of(REF / name) == "ddtree reference"
    for p in sorted(ENG.iterdir()):
        assert looks_like_summary(p) and not looks_like_reference(p), p.name
        assert source_of(p) == "engine summary", p.name
    rec = ROOT / "fixtures" / "sglang_cpu_recording.json"
    assert not looks_like_reference(rec) and not looks_like_summary(rec)
    assert source_of(rec) == "sglang recording"


def test_round_tree_text_marks_the_accepted_path():
    want = ref_script.make_requests()["generate_result.jsonl"][0]["round_trees"][3]
    traces = read_reference_traces(REF / "generate_result.jsonl")
    text = rs.round_tree_text(traces, step=3, request=0)
    marked = [int(line.split("[")[1].split("]")[0]) for line in text.splitlines() if "✓" in line and "[" in line
              and "accepted)" not in line]
    assert marked == want["accepted_indices"][1:]
    assert len([ln for ln in text.splitlines() if "─" in ln]) == len(want["tree"]["node_token_ids"])
    dot = rs.round_tree_dot(traces, step=3, request=0)
    assert dot.count("fillcolor") == len(want["accepted_indices"]) and dot.count("->") == len(want["tree"]["parents"]) - 1
    assert "root (not recorded)" in rs.round_tree_text(read_reference_traces(REF / "fork_traces.json"), 0, 0)
    with pytest.raises(KeyError, match="no round 9"):
        rs.round_tree_text(traces, step=9, request=0)


def test_a_json_file_that_is_not_json_is_named_so(tmp_path):
    """An empty, cut or non-JSON .json file is refused as that, not as 'JSON that is neither ...'."""
    import ddtree_lab as dl

    rec = (ROOT / "fixtures" / "sglang_cpu_recording.json").read_text()
    cases = {"empty.json": ("", "an empty file"), "cut.json": (rec[: len(rec) // 2], "not valid JSON at line"),
             "text.jsonl": ('{"a": 1}\ngarbage\n', "not valid JSON at record 2")}
    for name, (text, want) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(Exception, match=want):
            dl.load(tmp_path / name)
    (tmp_path / "other.json").write_text('{"a": 1}')
    with pytest.raises(Exception, match="JSON that is neither an SGLang recording"):
        dl.load(tmp_path / "other.json")
