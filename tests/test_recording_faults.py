"""Append-only recordings under faults: SIGKILL at random points, a kernel that never returns, a full disk.

Every test is bounded (timeouts on every child process) and local (files in tmp_path, pipes)."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.io import load, source_of
from ddtree_lab.io.append_trace import TraceWriter, load_append_trace
from ddtree_lab.store.segments import SegmentWriter, index_path, rebuild_index, scan
from ddtree_lab.io.synthetic import SyntheticShape, synthetic_steps
from ddtree_lab.io.lab_trace import step_json, step_tensors

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(requests=4, budget=12, vocab=20000)


def _same(a, b) -> bool:
    """Bit-exact: the stored JSON record and every stored tensor (NaN where NaN)."""
    ja, jb = step_json(a), step_json(b)
    ta, tb = step_tensors(a, ""), step_tensors(b, "")
    return ja == jb and ta.keys() == tb.keys() and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8) if x.dtype != torch.bool else x,
                                                                  y.view(torch.uint8) if y.dtype != torch.bool else y)
        for x, y in ((ta[k].contiguous(), tb[k].contiguous()) for k in ta))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["DDTREE_LAB_THREADS"] = "1"
    return env


CHILD = textwrap.dedent("""
    import sys, time
    from ddtree_lab.io.append_trace import TraceWriter
    from ddtree_lab.io.synthetic import SyntheticShape, synthetic_steps

    class Slow:  # a slow disk: each segment goes out in 2 kB writes, so kills land inside segments too
        def __init__(self, f):
            self.f = f
        def write(self, data):
            for i in range(0, len(data), 2048):
                self.f.write(data[i : i + 2048])
                self.f.flush()
                time.sleep(0.0002)
        def __getattr__(self, name):
            return getattr(self.f, name)

    shape = SyntheticShape(**{shape})
    w = TraceWriter(sys.argv[1], {{"vocab_size": shape.vocab}}, opener=lambda p, m: Slow(open(p, m)))
    print("ready", flush=True)
    for k in range(10_000):
        w.write_steps(synthetic_steps(shape, 7, k), {{}})
        print(k, flush=True)  # step k is on disk (flushed) before this line is written
""")


def test_every_finished_step_survives_sigkill_at_random_points(tmp_path):
    rng = random.Random(17)
    shape = SyntheticShape(**SHAPE)
    expected: dict[int, list] = {}
    lost, tails = 0, []
    for trial in range(20):
        path = tmp_path / f"kill{trial}.ddtrace"
        child = subprocess.Popen([sys.executable, "-c", CHILD.format(shape=SHAPE), str(path)], env=_env(),
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.4))
        finally:
            child.send_signal(signal.SIGKILL)
            out, _ = child.communicate(timeout=60)
        acked = [int(x) for x in out.split()]
        run = load(path)  # never raises for a cut tail
        assert run.metadata["source"] == "lab trace (append-only)"
        have = {(s.step, s.request): s for s in run.steps}
        for k in range(max(acked, default=-1) + 1):
            want = expected.setdefault(k, synthetic_steps(shape, 7, k))
            for s in want:
                got = have.get((k, s.request))
                lost += got is None
                assert got is None or _same(got, s), f"trial {trial}: step {k} request {s.request} differs"
        assert len(run.problems) == 1, run.problems  # the tail, named in one line
        tails.append(run.problems[0])
    assert lost == 0
    assert all(("partial" in t or "not closed" in t) for t in tails)
    print(f"20 SIGKILLs: {sum('partial' in t for t in tails)} mid-segment, {sum('not closed' in t for t in tails)} "
          f"between segments; {len(expected)} distinct steps checked, 0 lost")


def test_a_cut_at_every_byte_of_the_last_segment_loads_the_others(tmp_path):
    path = tmp_path / "t.ddtrace"
    shape = SyntheticShape(requests=2, budget=6, vocab=300)
    w = TraceWriter(path, {"vocab_size": 300})
    steps = [synthetic_steps(shape, 1, k) for k in range(3)]
    for st in steps:
        w.write_steps(st, {})
    w.close()
    data = path.read_bytes()
    entries, _ = scan(path)
    last = entries[-2]  # the last steps segment (the end segment follows it)
    for cut in range(last.offset, entries[-1].offset, 97):
        p = tmp_path / "cut.ddtrace"
        p.write_bytes(data[:cut])
        index_path(p).write_text(index_path(path).read_text())  # a stale index: the reader must not trust it
        run = load_append_trace(p)
        assert [(s.step, s.request) for s in run.steps] == [(k, b) for k in range(2) for b in range(2)]
        assert len(run.problems) == 1 and "partial" in run.problems[0] or "not closed" in run.problems[0]
    p.write_bytes(data[: last.offset + 40] + b"\0" * 8 + data[last.offset + 48 :])  # corrupt its header
    rebuild_index(p)
    run = load_append_trace(p)
    assert len(run.steps) == 4 and "checksum" in run.problems[0]


def test_existing_files_and_damaged_middles(tmp_path):
    shape = SyntheticShape(requests=2, budget=6, vocab=300)
    steps = [s for k in range(3) for s in synthetic_steps(shape, 2, k)]
    old = tmp_path / "old.ddtrace.safetensors"
    dl.save_trace(dl.step.Run(metadata={"vocab_size": 300}, steps=steps), old)
    assert source_of(old) == "lab trace" and len(load(old).steps) == 6
    new = tmp_path / "new.ddtrace"
    w = TraceWriter(new, {"vocab_size": 300})
    for k in range(3):
        w.write_steps(steps[2 * k : 2 * k + 2], {})
    w.close()
    assert source_of(new) == "lab trace (append-only)" and dl.load_trace(new).closed
    raw = bytearray(new.read_bytes())
    entries, _ = scan(new)
    raw[entries[2].end - 5] ^= 0xFF  # a tensor byte of the second steps segment
    new.write_bytes(bytes(raw))
    run = load(new)
    assert [(s.step, s.request) for s in run.steps] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert any("checksum mismatch" in p and "left out" in p for p in run.problems)


def _greedy_kernel(hang_at: int | None):
    """A callable with SGLang's verify_tree_greedy_func signature that runs the lab's greedy
    verifier (and sleeps forever on call ``hang_at``)."""
    from ddtree_lab.sglang.buffers import from_sglang_buffers  # noqa: F401 (the layout's module)
    from ddtree_lab.sglang.buffers import verify_input_from_retrieve, verify_output_to_sglang

    calls = {"n": 0}

    def verify_tree_greedy_func(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                retrive_next_token, retrive_next_sibling, target_predict):
        if calls["n"] == hang_at:
            print("hanging", flush=True)
            time.sleep(3600)
        calls["n"] += 1
        bs, n = candidates.shape
        vi = verify_input_from_retrieve(candidates, retrive_next_token, retrive_next_sibling, retrive_index, 0)
        logits = torch.zeros(bs, n, int(max(target_predict.max(), candidates.max())) + 1)
        logits.scatter_(-1, target_predict.reshape(bs, n, 1), 1.0)
        out = dl.verify_tree_greedy(vi, logits)
        p, a, t = verify_output_to_sglang(out, n, accept_index.shape[1])
        predicts.copy_(p)
        accept_index.copy_(a)
        accept_token_num.copy_(t)

    return verify_tree_greedy_func


def _greedy_call(seed):
    g = torch.Generator().manual_seed(seed)
    ids, lp = dl.draft_topk_from_logits(torch.randn(2, 3, 30, generator=g) * 2, k=3)
    vi = dl.compile_retrieve(dl.build_tree(ids, lp, torch.tensor([1, 2]), 8), 5)
    return vi, torch.randn(2, vi.num_rows, 30, generator=g)


HANG = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_recording_faults import _greedy_kernel, _greedy_call
    from ddtree_lab.sglang import SGLangRecorder
    from ddtree_lab.sglang.append import AppendSink
    from ddtree_lab.sglang.kernels import sglang_verify_greedy
    rec = SGLangRecorder()
    rec.sink = AppendSink(sys.argv[1], rec.run_metadata())
    fn = rec.wrap(_greedy_kernel(hang_at=2), "greedy")
    for k in range(3):
        vi, logits = _greedy_call(k)
        sglang_verify_greedy(vi, logits, kernel=fn)
        print("returned", k, flush=True)
""")


def test_a_kernel_that_never_returns_leaves_its_inputs_on_disk(tmp_path, capsys):
    from ddtree_lab.diagnosis import check
    from ddtree_lab.sglang.pending import replay_pending

    path = tmp_path / "hang.ddrec"
    child = subprocess.Popen([sys.executable, "-c", HANG.format(tests=str(ROOT / "tests")), str(path)], env=_env(),
                             stdout=subprocess.PIPE, text=True)
    try:
        lines = [child.stdout.readline().strip() for _ in range(3)]
        assert lines == ["returned 0", "returned 1", "hanging"], lines
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=1.0)  # it does hang: the timeout ends it
    finally:
        child.kill()
        child.communicate(timeout=60)
    run = load(path)
    assert run.metadata["source"] == "sglang recording (append-only)"
    assert run.metadata["did_not_return"] == [2] and not run.problems, run.problems
    hung = [s for s in run.steps if s.extra.get("did_not_return")]
    done = [s for s in run.steps if not s.extra.get("did_not_return")]
    assert len(hung) == 2 and len(done) == 4 and all(s.output is None for s in hung)
    vi, logits = _greedy_call(2)
    want = dl.verify_tree_greedy(vi, logits)
    for b, s in enumerate(hung):
        assert check(s) == []  # the stored buffers are whole
        assert torch.equal(s.node_token_ids, vi.node_token_ids[b, : s.num_nodes])
        for backend in ("reference", "torch-lazy"):
            out = replay_pending(s, backend)
            assert out.accept_index[0].tolist() == [i for i in want.accept_index[b].tolist()][: out.accept_index.shape[1]]
            assert out.emitted_tokens[0].tolist()[: int(out.accept_length[0]) + 1] == \
                want.emitted_tokens[b].tolist()[: int(want.accept_length[b]) + 1]
    assert dl.sglang.load_recording(path).metadata["did_not_return"] == [2]
    from ddtree_lab.cli import main

    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "did not return: step 2, request 0" in out and "did not return: step 2, request 1" in out


class _FullDisk:
    """A file whose writes raise ENOSPC once ``budget`` bytes were written (a full disk)."""

    def __init__(self, f, budget):
        self.f, self.budget = f, budget

    def write(self, data):
        if len(data) > self.budget.get("left", 0):
            part = data[: max(self.budget.get("left", 0), 0)]
            self.f.write(part)  # a full disk takes what fits, then refuses
            self.budget["left"] = 0
            raise OSError(28, "No space left on device")
        self.budget["left"] -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_disk_stops_the_recording_and_the_engine_goes_on(tmp_path, capsys):
    from ddtree_lab.sglang import SGLangRecorder
    from ddtree_lab.sglang.append import AppendSink
    from ddtree_lab.sglang.kernels import sglang_verify_greedy

    budget = {"left": 6000}

    def opener(p, mode):
        f = open(p, mode)
        return _FullDisk(f, budget) if not str(p).endswith(".index") else f

    rec = SGLangRecorder()
    rec.sink = AppendSink(tmp_path / "full.ddrec", rec.run_metadata(), opener=opener)
    fn = rec.wrap(_greedy_kernel(hang_at=None), "greedy")
    for k in range(6):  # every call returns the right answer whether it was recorded or not
        vi, logits = _greedy_call(k)
        out = sglang_verify_greedy(vi, logits, kernel=fn).output
        assert out.accept_index.tolist() == dl.verify_tree_greedy(vi, logits).accept_index.tolist()
    assert rec.sink.stopped is not None and "No space left on device" in rec.sink.stopped
    assert any("stopped recording" in e for e in rec.errors)
    assert "SGLang goes on" in capsys.readouterr().err
    run = load(tmp_path / "full.ddrec")
    assert len(run.problems) >= 1 and "partial" in run.problems[0]

    budget["left"] = 20000  # the lab's own writer: stops, says why, keeps what it wrote
    shape = SyntheticShape(requests=2, budget=6, vocab=3000)
    w = TraceWriter(tmp_path / "full.ddtrace", {"vocab_size": 3000}, opener=opener)
    ok = [w.write_steps(synthetic_steps(shape, 3, k), {}) for k in range(8)]
    assert ok[0] and not ok[-1] and "No space left on device" in w.stopped
    run = load_append_trace(tmp_path / "full.ddtrace")
    assert len(run.steps) == 2 * sum(ok) and "partial" in run.problems[0]


def test_appending_after_a_crash_cuts_the_partial_tail(tmp_path):
    path = tmp_path / "s.seg"
    w = SegmentWriter(path)
    w.append("run", {"format": "x"}, {"a": torch.arange(5)})
    w.append("steps", {"k": 1}, {"b": torch.ones(3)})
    w.close()
    with open(path, "ab") as f:
        f.write(b"DDSG\x10\x00")  # a crash mid-header
    assert scan(path)[1].why is not None
    w = SegmentWriter(path, append=True)
    w.append("steps", {"k": 2}, {"b": torch.zeros(2, dtype=torch.bfloat16)})
    w.close()
    entries, tail = scan(path)
    assert [e.kind for e in entries] == ["run", "steps", "steps"] and tail.why is None
    assert json.loads(index_path(path).read_text().splitlines()[-1])["k"] == "steps"


def test_info_after_a_kill_names_what_it_left_out(tmp_path, capsys):
    """Issue 26.12: after `kill -9` (a recording never closed, its last segment cut) `info`
    printed "(named above)" with nothing named on stdout; it names each problem on stdout."""
    from ddtree_lab.cli import main

    path = tmp_path / "killed.ddtrace"
    shape = SyntheticShape(requests=2, budget=6, vocab=300)
    w = TraceWriter(path, {"vocab_size": 300})
    for k in range(3):
        w.write_steps(synthetic_steps(shape, 1, k), {})
    data = path.read_bytes()
    entries, _ = scan(path)
    path.write_bytes(data[:entries[-1].offset + 40])  # killed inside the last segment, never closed
    index_path(path).unlink(missing_ok=True)
    run = load(path)
    assert run.problems
    main(["info", str(path)])
    out = capsys.readouterr().out
    assert "named above" not in out
    (partial,) = [x for x in out.splitlines() if x.startswith("partial: ")]  # issue 34.6: one line says what it lacks
    for problem in run.problems:  # each named on stdout: the cut in the partial line, any other as a problem
        assert problem.removeprefix(f"{path}: ") in partial or f"problem: {problem}" in out
