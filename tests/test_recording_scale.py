"""Append-only recordings of live runs and at scale: LiveSession(record_to=...), record on Ctrl-C,
lazy opening, the Parquet export, DuckDB's acceptance by depth, and the scale benchmark at its
smallest size."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.analysis import acceptance_by_depth
from ddtree_lab.cli import main
from ddtree_lab.io import load
from ddtree_lab.io.append_trace import TraceWriter, load_append_trace
from ddtree_lab.io.synthetic import SyntheticShape, synthetic_steps
from ddtree_lab.replaying import compare_outputs

ROOT = Path(__file__).resolve().parent.parent


def _need(module):
    """pyarrow / duckdb (extra ``scale``): skipped where not installed, a failure in CI (setup installs them)."""
    import os

    if os.environ.get("CI"):
        __import__(module)
    else:
        pytest.importorskip(module)


def _synthetic_file(path, steps=6, shape=SyntheticShape(requests=3, budget=10, vocab=400)):
    w = TraceWriter(path, {"vocab_size": shape.vocab})
    made = []
    for k in range(steps):
        st = synthetic_steps(shape, 5, k)
        made += st
        w.write_steps(st, {})
    w.close()
    return made


def test_live_session_writes_each_step_as_it_goes(target, drafter, tmp_path):
    from ddtree_lab.diagnosis import check
    from ddtree_lab.io.append_trace import replay_inputs

    path = tmp_path / "live.ddtrace"
    s = dl.LiveSession(target, drafter, budget=4, record="light", record_to=path, inputs_first="rows",
                       sampling=dl.SamplingParams(temperature=0.8))
    s.start(["Say hi.", "Name a colour."])
    s.step(4)
    s.step(4)
    mid = load(path)  # the session is still running: two steps on disk, no end segment
    assert [(x.step, x.request) for x in mid.steps] == [(x.step, x.request) for x in s.steps]
    assert any("not closed" in p for p in mid.problems)
    for _ in range(20):
        if all(r.finished for r in s.requests):
            break
        s.step(4)
    s.close_recording()
    run = load(path)
    assert run.closed and not run.problems and len(run.steps) == len(s.steps)
    for a, b in zip(s.steps, run.steps):
        assert compare_outputs(a.output, b.output) == []
        assert torch.equal(a.child_probs.nan_to_num(-1), b.child_probs.nan_to_num(-1))
        assert torch.equal(a.final_row_prefix, b.final_row_prefix) and a.timings == b.timings
    assert dl.replay(run.steps[0]).accept_length.tolist() == run.steps[0].output.accept_length.tolist()
    assert run.metadata["requests"][0]["generated_token_ids"] == s.requests[0].generated
    # a step whose verifier never returned: its inputs (written first) are a checkable, replayable step
    s2 = dl.LiveSession(target, drafter, budget=4, record="light", record_to=tmp_path / "hang.ddtrace",
                        inputs_first="rows", sampling=dl.SamplingParams(temperature=0.8))
    s2.start(["Say hi."])
    s2.step(8)
    real = dl.verify_tree

    def hang(*a, **k):
        raise RuntimeError("the kernel died")

    import ddtree_lab.verify as verify

    verify.verify_tree = hang
    try:
        with pytest.raises(RuntimeError):
            s2.step(8)
    finally:
        verify.verify_tree = real
    run2 = load(tmp_path / "hang.ddtrace")
    dnr = [x for x in run2.steps if x.extra.get("did_not_return")]
    assert len(dnr) == 1 and dnr[0].output is None and dnr[0].step == 1 and check(dnr[0]) == []
    out = replay_inputs(dnr[0], "torch-lazy")
    assert int(out.accept_length[0]) >= 0 and out.accept_index[0, 0] == 0
    lines = run2.info_lines()
    assert any(x.startswith("partial: step 1, request 0 did not finish: the process stopped") for x in lines), lines


def test_record_on_ctrl_c_keeps_what_it_has(tmp_path, capsys, monkeypatch):
    from ddtree_lab.session import LiveSession

    real = LiveSession.step
    calls = {"n": 0}

    def step(self, max_new_tokens):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, max_new_tokens)

    monkeypatch.setattr(LiveSession, "step", step)
    out = tmp_path / "r.ddtrace"
    assert main(["record", "--prompt", "Name a colour.", "--budget", "4", "--max-new-tokens", "12", "--quiet",
                 "--level", "light", "-o", str(out)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddtree-lab record: interrupted; kept 2 finished steps"), err
    run = load(out)
    assert len(run.steps) == 2 and run.closed and not run.problems
    assert run.metadata["threads"]


def test_lazy_open_reads_steps_on_demand(tmp_path):
    path = tmp_path / "big.ddtrace"
    made = _synthetic_file(path)
    run = load_append_trace(path, lazy=True)
    assert run.metadata["lazy"] and len(run.steps) == len(made) and not run._cache  # nothing decoded yet
    s = run.find_step(4, 2)
    assert len(run._cache) == 1 and s.accept_length == made[4 * 3 + 2].accept_length
    assert [x.step for x in run.for_request(1)] == list(range(6))
    assert len(run._cache) <= run.CACHE
    with pytest.raises(KeyError, match="request 1 has no step 9"):
        run.find_step(9, 1)


def test_export_and_duckdb_acceptance_by_depth_match_the_in_memory_numbers(tmp_path, capsys):
    _need("pyarrow")
    _need("duckdb")
    from ddtree_lab.analysis.large import acceptance_by_depth_sql, query

    path = tmp_path / "run.ddtrace"
    made = _synthetic_file(path)
    assert main(["export", str(path), "--parquet", str(tmp_path / "pq")]) == 0
    assert "18 step records" in capsys.readouterr().out
    assert acceptance_by_depth_sql(tmp_path / "pq") == acceptance_by_depth(made)
    n = sum(s.num_nodes for s in made)
    assert query(tmp_path / "pq", "SELECT count(*), sum(accepted::INT) FROM nodes")[0] == \
        (n, sum(len(s.accepted_path) for s in made))
    s = made[7]
    (p, q, tok) = query(tmp_path / "pq", f"SELECT target_p, drafter_q, token FROM nodes WHERE step = {s.step} AND "
                                         f"request = {s.request} AND node = 1")[0]
    assert tok == int(s.node_token_ids[1]) and p == pytest.approx(float(s.child_probs[1]), abs=0)
    assert q == pytest.approx(float((s.node_logws[1] - s.node_logws[0]).exp()), rel=1e-6)
    # any source exports: a v2 trace file
    dl.save_trace(dl.step.Run(metadata={"vocab_size": 400}, steps=made), tmp_path / "v2.ddtrace.safetensors")
    assert main(["export", str(tmp_path / "v2.ddtrace.safetensors"), "--parquet", str(tmp_path / "pq2")]) == 0
    assert acceptance_by_depth_sql(tmp_path / "pq2") == acceptance_by_depth(made)


def test_info_of_a_large_append_only_file_reads_the_index(tmp_path, capsys, monkeypatch):
    import ddtree_lab.io.append_trace as at

    path = tmp_path / "run.ddtrace"
    _synthetic_file(path)
    assert main(["info", str(path)]) == 0  # a small file: the usual info, every step read
    assert "request 2 (id 2): 6 steps" in capsys.readouterr().out
    monkeypatch.setattr(at, "EAGER_BYTES", 0)  # as a file larger than memory would be
    decoded = []
    monkeypatch.setattr(at, "_decode", lambda *a: decoded.append(a) or [])
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "18 records in 8 segments, 3 requests" in out and "request 2 (id 2): 6 steps" in out
    assert decoded == []  # from the index alone


def test_scale_benchmark_at_its_smallest_size(tmp_path):
    _need("pyarrow")
    _need("duckdb")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--sizes", "0.01", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "size 0.01 (10 tokens/request)" in done.stdout and "query" in done.stdout
