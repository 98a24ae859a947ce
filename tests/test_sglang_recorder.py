"""The recorder inside SGLang: wrapping SGLang's Triton kernels on a CPU, filters, files, replay,
the environment hook in a subprocess, the fixture and labs/06_sglang.ipynb."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab import sglang as sr
from ddtree_lab.sglang import kernels as sb
from ddtree_lab.sglang.recorder import _PatchFinder
from ddtree_lab.replaying import compare_outputs

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "sglang_cpu_recording"
REASON = sb.sglang_unavailable_reason()


def _fixture_recipe():
    """scripts/make_sglang_fixture.py, imported as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("make_sglang_fixture", ROOT / "scripts" / "make_sglang_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.record_cpu_demo
needs_sglang = pytest.mark.skipif(REASON is not None, reason=f"sglang's kernels cannot be imported here: {REASON}")
SPEC_TREE = "sglang.kernels.ops.speculative.spec_tree"


def _greedy_batch(seed, bs=3, vocab=30):
    g = torch.Generator().manual_seed(seed)
    ids, lp = dl.draft_topk_from_logits(torch.randn(bs, 4, vocab, generator=g) * 2, k=3)
    tree = dl.build_tree(ids, lp, torch.randint(0, vocab, (bs,), generator=g), 10)
    vi = dl.compile_retrieve(tree, 4)
    logits = torch.randn(bs, vi.num_rows, vocab, generator=g)
    for b in range(bs):
        for i in range(1, int(tree.num_nodes[b])):
            if torch.rand(1, generator=g) < 0.6:
                logits[b, int(tree.parents[b, i]), int(tree.node_token_ids[b, i])] += 5
    return vi, logits


def _chain_batch(seed, bs=3, vocab=30, length=5):
    g = torch.Generator().manual_seed(seed)
    ids, lp = dl.draft_topk_from_logits(torch.randn(bs, length - 1, vocab, generator=g) * 2, k=1)
    tree = dl.build_tree(ids, lp, torch.randint(0, vocab, (bs,), generator=g), length - 1)
    vi = dl.compile_retrieve(tree, 4)
    logits = torch.randn(bs, length, vocab, generator=g)
    for b in range(bs):
        for i in range(1, length):
            logits[b, i - 1, int(tree.node_token_ids[b, i])] += 3
    probs = dl.target_probs(logits, dl.SamplingParams(0.9, top_k=12))
    return vi, probs, torch.rand(bs, length, generator=g), torch.rand(bs, generator=g)


def test_recorder_is_off_until_installed_and_uninstall_restores():
    import importlib

    if REASON is None:
        sb.sglang_kernels()
        module = importlib.import_module(SPEC_TREE)
        original = module.verify_tree_greedy_triton
        rec = sr.SGLangRecorder()
        assert module.verify_tree_greedy_triton is original  # constructing patches nothing
        with rec.install({SPEC_TREE: {"verify_tree_greedy_triton": "greedy"}}):
            assert module.verify_tree_greedy_triton is not original
            assert rec.installed == [f"{SPEC_TREE}.verify_tree_greedy_triton"]
        assert module.verify_tree_greedy_triton is original
    assert sr.install_from_env({}) is None  # no DDTREE_LAB_SGLANG_RECORD: nothing installed


@needs_sglang
def test_recorded_greedy_and_chain_steps_replay_equal_with_request_ids():
    kernels = sb.sglang_kernels()
    rec = sr.SGLangRecorder()
    rec.set_context(["r0", "r1", "r2"], torch.tensor([4, 4, 4]), {"temperature": [0.0, 0.0, 0.0]})
    vi, logits = _greedy_batch(1)
    direct = sb.sglang_verify_greedy(vi, logits)
    wrapped = sb.sglang_verify_greedy(vi, logits, kernel=rec.wrap(kernels["verify_tree_greedy_triton"], "greedy"))
    assert compare_outputs(direct.output, wrapped.output, decisions=False) == []  # recording changes nothing
    vi, probs, coins, final = _chain_batch(2)
    sb.sglang_verify_chain(vi, probs, coins, final, kernel=rec.wrap(kernels["chain_speculative_sampling_triton"], "chain"))
    assert rec.errors == [] and [s["kind"] for s in rec.steps] == ["greedy", "chain"]
    assert rec.steps[0]["request_ids"] == ["r0", "r1", "r2"]
    assert rec.steps[0]["sampling"] == {"temperature": [0.0, 0.0, 0.0]}
    results = sr.replay_recording(rec.recording())
    assert len(results) == 6 and all(r.agrees for r in results), [r.differences for r in results]


@needs_sglang
def test_filters_bound_what_is_recorded():
    kernels = sb.sglang_kernels()
    vi, logits = _greedy_batch(3)

    def run(f, calls=3, context=True):
        rec = sr.SGLangRecorder(f)
        kernel = rec.wrap(kernels["verify_tree_greedy_triton"], "greedy")
        if context:
            rec.set_context(["a", "b", "c"])
        for _ in range(calls):
            sb.sglang_verify_greedy(vi, logits, kernel=kernel)
        return rec

    assert len(run(sr.RecordFilter(max_steps=2)).steps) == 2
    assert [s["call"] for s in run(sr.RecordFilter(calls=(1, 2))).steps] == [1]
    rec = run(sr.RecordFilter(requests=frozenset({"c", "a"})), calls=1)
    assert rec.steps[0]["request_ids"] == ["a", "c"] and rec.steps[0]["rows"] == [0, 2]
    assert rec.steps[0]["tensors"]["candidates"].shape[0] == 2
    assert run(sr.RecordFilter(requests=frozenset({"a"})), calls=1, context=False).steps == []  # no ids known
    assert run(sr.RecordFilter(max_rows=1), calls=1).steps[0]["rows"] == [0]
    assert run(sr.RecordFilter(rank=1), calls=1).steps == []  # this process is rank 0
    assert run(sr.RecordFilter(kinds=("chain",)), calls=1).steps == []
    assert all(r.agrees for r in sr.replay_recording(run(sr.RecordFilter(requests=frozenset({"c"})), calls=1).steps))


@needs_sglang
def test_path_prob_rows_replay_like_all_rows_and_are_smaller():
    kernels = sb.sglang_kernels()
    vi, probs, coins, final = _chain_batch(5, length=7)
    recs = {}
    for mode in ("path", "all"):
        rec = sr.SGLangRecorder(sr.RecordFilter(prob_rows=mode))
        sb.sglang_verify_chain(vi, probs, coins, final, kernel=rec.wrap(kernels["chain_speculative_sampling_triton"], "chain"))
        recs[mode] = rec
    path_rows = recs["path"].steps[0]["tensors"]["target_prob_nodes"]
    assert (path_rows >= 0).sum() < (recs["all"].steps[0]["tensors"]["target_prob_nodes"] >= 0).sum()
    a = [r.lab.emitted_tokens for r in sr.replay_recording(recs["path"].steps)]
    b = [r.lab.emitted_tokens for r in sr.replay_recording(recs["all"].steps)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_recorder_errors_never_reach_the_caller():
    rec = sr.SGLangRecorder()

    def kernel(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
               retrive_next_sibling, target_predict):
        return "ran"

    wrapped = rec.wrap(kernel, "greedy")
    assert wrapped(None, None, None, None, None, None, None, None) == "ran"
    assert rec.steps == [] and len(rec.errors) == 1 and "call 0" in rec.errors[0]


def test_import_hook_patches_a_module_imported_after_install(tmp_path, monkeypatch):
    (tmp_path / "fake_sglang_consumer.py").write_text(textwrap.dedent("""
        def verify_tree_greedy_func(predicts, accept_index, accept_token_num, candidates, retrieve_index,
                                    retrieve_next_token, retrieve_next_sibling, target_predict, topk=-1):
            accept_index[:, 0] = retrieve_index[:, 0]
            accept_token_num.zero_()
            for b in range(candidates.shape[0]):
                predicts[int(retrieve_index[b, 0])] = target_predict[b, 0]
            return predicts, accept_index, accept_token_num
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    rec = sr.SGLangRecorder().install({"fake_sglang_consumer": {"verify_tree_greedy_func": "greedy"}})
    try:
        import fake_sglang_consumer

        vi, logits = _greedy_batch(4, bs=2)
        sb.sglang_verify_greedy(vi, logits, kernel=fake_sglang_consumer.verify_tree_greedy_func)
    finally:
        rec.uninstall()
        sys.modules.pop("fake_sglang_consumer", None)
    assert len(rec.steps) == 1 and rec.steps[0]["kernel"] == "verify_tree_greedy_func"
    results = sr.replay_recording(rec.steps)
    assert all(r.differences for r in results if int(r.lab.accept_length[0]) > 0)  # the fake accepts nothing


@needs_sglang
def test_save_and_load_round_trip_as_json_plus_safetensors(tmp_path):
    rec = _fixture_recipe()(tmp_path / "rec")
    json_path, st_path = tmp_path / "rec.json", tmp_path / "rec.safetensors"
    doc = json.loads(json_path.read_text())
    assert doc["format"] == "ddtree-lab/sglang-recording" and doc["version"] == 2
    assert st_path.read_bytes()[:8] != b"\x80\x04\x95"[:8]  # not a pickle
    loaded = sr.load_recording(tmp_path / "rec")
    assert len(loaded) == len(rec)
    for a, b in zip(rec.steps, loaded.steps):
        assert a["tensors"].keys() == b["tensors"].keys()
        assert all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])
        assert {k: v for k, v in a.items() if k != "tensors"} == {k: v for k, v in b.items() if k != "tensors"}
    doc["format"] = "something-else"
    json_path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="not a ddtree-lab/sglang-recording"):
        sr.load_recording(tmp_path / "rec")


def test_fixture_replays_with_only_named_differences():
    results = sr.replay_recording(sr.load_recording(FIXTURE))
    kinds = {r.kind for r in results}
    assert kinds == {"greedy", "chain"}
    unexplained = [r for r in results if r.replayable and r.differences and not r.explanation]
    assert unexplained == []
    differing = [r for r in results if r.differences]
    assert [(r.step, r.row) for r in differing] == [(2, 1)]
    assert "hold all of its row's mass" in differing[0].explanation and differing[0].by_design
    assert sum(not r.replayable for r in results) == 3  # the real-draft-probability chain
    assert any(int(r.sglang.accept_length[0]) >= 2 for r in results)


#: Softmax outputs of the recipe: torch picks its CPU exp / softmax kernels by instruction set
#: (ATEN_CPU_CAPABILITY: scalar, AVX2, AVX-512), and they round differently (measured: up to
#: 1.04e-6 relative, scalar against AVX2). Zeros (filtered tokens) and everything else are exact.
SOFTMAX_TENSORS = {"target_prob_rows", "draft_probs"}


@needs_sglang
def test_fixture_is_what_record_cpu_demo_makes():
    made = _fixture_recipe()()
    saved = sr.load_recording(FIXTURE)
    assert len(made) == len(saved)
    for k, (a, b) in enumerate(zip(made.steps, saved.steps)):
        assert set(a["tensors"]) == set(b["tensors"]), k
        for name, got in a["tensors"].items():
            want = b["tensors"][name]
            if name in SOFTMAX_TENSORS:
                assert got.dtype == want.dtype and torch.equal(got == 0, want == 0), (k, name)
                torch.testing.assert_close(got, want, rtol=4e-6, atol=0.0, msg=f"step {k} {a['kind']} {name}")
            else:
                assert torch.equal(got, want), (k, a["kind"], name)


def test_lab_views_draw_every_converted_row():
    """No SGLang-specific views: a recording becomes lab StepTraces and the lab's views draw them."""
    from ddtree_lab import views

    run = sr.recording_to_trace(sr.load_recording(FIXTURE))
    assert [(s.step, s.request_id) for s in run.steps if s.extra["verdict"] == "differs"] == [(2, "req-4")]
    for step in run.steps:
        assert "digraph" in views.to_dot(views.step_view(step, run))
        assert "<table" in views.decisions_table_html(views.step_view(step, run))


def test_to_trace_of_an_empty_recorder_is_an_empty_run():
    run = sr.SGLangRecorder().to_trace()
    assert run.steps == [] and run.metadata["source"] == "sglang recording"


@needs_sglang
def test_environment_hook_records_in_a_fresh_process(tmp_path):
    script = textwrap.dedent("""
        import torch, ddtree_lab as dl
        from ddtree_lab.sglang import kernels as sb
        g = torch.Generator().manual_seed(0)
        ids, lp = dl.draft_topk_from_logits(torch.randn(2, 3, 20, generator=g), k=2)
        vi = dl.compile_retrieve(dl.build_tree(ids, lp, torch.tensor([1, 2]), 6), 3)
        for _ in range(3):
            sb.sglang_verify_greedy(vi, torch.randn(2, vi.num_rows, 20, generator=g))
    """)
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join([sr.hook_dir(), str(ROOT), env.get("PYTHONPATH", "")]),
        "DDTREE_LAB_SGLANG_RECORD": str(tmp_path),
        "DDTREE_LAB_SGLANG_RECORD_TARGETS": f"{SPEC_TREE}:verify_tree_greedy_triton=greedy",
        "DDTREE_LAB_SGLANG_RECORD_MAX_STEPS": "2",
        "DDTREE_LAB_SGLANG_RECORD_FLUSH": "1",
    })
    for layout, pattern in (("append", "sglang-rank0-pid*.ddrec"), ("files", "sglang-rank0-pid*.json")):
        out = tmp_path / layout
        env.update({"DDTREE_LAB_SGLANG_RECORD": str(out), "DDTREE_LAB_SGLANG_RECORD_FORMAT": layout})
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        files = sorted(out.glob(pattern))
        assert len(files) == 1, (list(out.iterdir()), done.stderr)
        recording = sr.load_recording(files[0])  # either layout
        assert len(recording) == 2 and recording.metadata["calls_seen"] >= 2
        assert all(r.agrees for r in sr.replay_recording(recording))


def test_notebook_06_runs_top_to_bottom(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(ROOT / "labs" / "06_sglang.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "labs")}})
    client.execute()
    text = "".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/html", ""))
                   for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "8 agree, 1 differs (1 by design), 3 not replayable" in text
    assert "hold all of its row's mass" in text


@needs_sglang
def test_eagle_sample_context_gives_request_ids_even_when_imported_by_name(monkeypatch):
    """SGLang's workers import eagle_sample by name; the recorder patches it there too and takes
    request ids, seq_lens and sampling parameters from the batch it is given."""
    import types

    kernels = sb.sglang_kernels()
    utils = types.ModuleType("fake_eagle_utils")
    utils.verify_tree_greedy_func = kernels["verify_tree_greedy_triton"]

    def eagle_sample(verify_input, batch, logits_output):
        vi, logits = verify_input
        return sb.sglang_verify_greedy(vi, logits, kernel=utils.verify_tree_greedy_func)

    eagle_sample.__module__ = "fake_eagle_utils"
    utils.eagle_sample = eagle_sample
    worker = types.ModuleType("fake_eagle_worker")
    worker.eagle_sample = utils.eagle_sample  # `from eagle_utils import eagle_sample`, before install
    monkeypatch.setitem(sys.modules, "fake_eagle_utils", utils)
    monkeypatch.setitem(sys.modules, "fake_eagle_worker", worker)
    targets = {"fake_eagle_utils": {"eagle_sample": "context", "verify_tree_greedy_func": "greedy"},
               "fake_eagle_worker": {"eagle_sample": "context"}}
    batch = types.SimpleNamespace(
        reqs=[types.SimpleNamespace(rid="alpha", origin_input_ids=[5, 6, 7]),
              types.SimpleNamespace(rid="beta", origin_input_text="Hi", origin_input_ids=[8])],
        seq_lens=torch.tensor([4, 4]),
        sampling_info=types.SimpleNamespace(temperatures=torch.tensor([[0.0], [0.0]]), top_ks=torch.tensor([1, 1]),
                                            top_ps=torch.tensor([1.0, 1.0])),
    )
    with sr.SGLangRecorder().install(targets) as rec:
        assert sorted(rec.installed) == ["fake_eagle_utils.eagle_sample", "fake_eagle_utils.verify_tree_greedy_func",
                                         "fake_eagle_worker.eagle_sample"]
        worker.eagle_sample(_greedy_batch(6, bs=2), batch, None)
    assert worker.eagle_sample is utils.eagle_sample is eagle_sample  # restored
    assert len(rec.steps) == 1 and rec.steps[0]["request_ids"] == ["alpha", "beta"]
    assert rec.steps[0]["sampling"] == {"temperature": [0.0, 0.0], "top_k": [1.0, 1.0], "top_p": [1.0, 1.0]}
    assert rec.steps[0]["tensors"]["seq_lens"].tolist() == [4, 4]
    assert rec._get_context() is None  # cleared after the call
    assert rec.prompts == {"alpha": {"prompt": None, "prompt_token_ids": [5, 6, 7]},
                           "beta": {"prompt": "Hi", "prompt_token_ids": [8]}}
    requests = rec.to_trace().metadata["requests"]
    assert [(r["request_id"], r["prompt"], r["prompt_token_ids"]) for r in requests] == \
        [("alpha", None, [5, 6, 7]), ("beta", "Hi", [8])]
    assert all(r.agrees for r in sr.replay_recording(rec.steps))


@needs_sglang
def test_default_patch_points_cover_sglangs_kernel_modules():
    import importlib

    sb.sglang_kernels()
    spec_tree = importlib.import_module(SPEC_TREE)
    original = spec_tree.verify_tree_greedy_func
    with sr.SGLangRecorder() as rec:
        assert f"{SPEC_TREE}.verify_tree_greedy_func" in rec.installed
        vs = importlib.import_module("sglang.kernels.ops.speculative.verify_sampling")
        assert getattr(vs.chain_speculative_sampling_triton, "__ddtree_lab_original__", None) is not None
    assert spec_tree.verify_tree_greedy_func is original
    assert getattr(vs.chain_speculative_sampling_triton, "__ddtree_lab_original__", None) is None
    assert not any(isinstance(f, _PatchFinder) for f in sys.meta_path)


def test_step_parts_hold_what_a_step_trace_needs():
    recording = sr.load_recording(FIXTURE)
    parts = sr.recording.step_parts(recording.steps[1], 2)
    assert parts["request_id"] == "req-5" and parts["kind"] == "chain" and parts["rank"] == 0
    assert parts["target_probs"].shape[:2] == (1, parts["verify_input"].num_rows)
    assert parts["coins"].shape == (1, parts["verify_input"].num_rows) and parts["final_coins"].shape == (1,)
    assert parts["sampling"] == {"temperature": 0.8, "top_k": 10, "top_p": 1.0}
    assert parts["sglang_output"].accept_length.shape == (1,)
    greedy = sr.recording.step_parts(recording.steps[0], 0)
    assert greedy["target_predict"].shape == (1, greedy["verify_input"].num_rows) and greedy["coins"] is None


def test_recording_becomes_a_lab_trace_that_opens_replays_and_renders(tmp_path):
    """The recorder's output opens in the lab: Step per row, save/load, replay, views."""
    from pathlib import Path

    import ddtree_lab as dl
    from ddtree_lab import views
    from ddtree_lab.sglang import load_recording, recording_to_trace

    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "sglang_cpu_recording"
    rec = load_recording(fixture)
    run = recording_to_trace(rec)
    rows = sum(len(s["rows"]) for s in rec.steps)
    assert len(run.steps) + len(run.metadata["skipped_rows"]) == rows
    assert run.steps and all(s.extra["source"] == "sglang" for s in run.steps)
    path = dl.save_trace(run, tmp_path / "sglang.ddtrace.safetensors")
    loaded = dl.load_trace(path)
    for s in loaded.steps:
        dl.replay(s)
        if not s.extra["differences"]:  # where SGLang agrees, its emitted tokens are the lab's
            assert s.extra["sglang_emitted"] == s.emitted
        assert "digraph" in views.to_dot(views.step_view(s, loaded))


@pytest.mark.parametrize("backend", sorted(sb.lab_verifiers()))
def test_every_backend_classifies_every_fixture_row_like_the_reference(backend):
    """One input path for every backend: the same verdict and explanation on every row."""
    recording = sr.load_recording(FIXTURE)
    reference = sr.replay_recording(recording, "reference")
    other = sr.replay_recording(recording, backend)
    assert [(r.verdict, r.by_design, r.explanation) for r in other] == \
        [(r.verdict, r.by_design, r.explanation) for r in reference]
    assert sr.count_verdicts(other) == {"agrees": 8, "differs": 1, "by design": 1, "not replayable": 3}


@needs_sglang
@pytest.mark.parametrize("backend", sorted(sb.lab_verifiers()))
def test_a_row_the_kernel_never_read_is_named_alike_by_every_backend(backend):
    """prob_rows="path": SGLang rejects node 1 (it holds all of the root row's float32 mass and
    the coin equals it), so node 1's row is not recorded; the lab accepts node 1 and the replay
    stops there, naming the node, whatever the backend."""
    from ddtree_lab.sglang.buffers import verify_input_from_retrieve

    vi = verify_input_from_retrieve(torch.tensor([[1, 2, 5]]), torch.tensor([[1, 2, -1]]), torch.tensor([[-1, -1, -1]]))
    full = 1.0 - 2.0 ** -24
    probs = torch.full((1, 3, 8), 1.0 / 8)
    probs[0, 0] = 0.0
    probs[0, 0, 2] = full
    rec = sr.SGLangRecorder(sr.RecordFilter(prob_rows="path"))
    kernel = rec.wrap(sb.sglang_kernels()["chain_speculative_sampling_triton"], "chain")
    sgl = sb.sglang_verify_chain(vi, probs, torch.tensor([[full, 0.5, 0.5]]), torch.tensor([0.3]), kernel=kernel)
    assert sgl.output.accept_length.tolist() == [0] and sgl.output.bonus_token.tolist() == [7]  # V - 1
    assert rec.steps[0]["tensors"]["target_prob_nodes"][0].tolist()[:1] == [0]
    (r,) = sr.replay_recording(rec.recording(), backend)
    assert r.verdict == "differs" and r.by_design and r.unrecorded_node == 1
    assert "node 1, whose target row SGLang's kernel never read" in r.explanation
    assert r.lab.accept_index[0, :2].tolist() == [0, 1] and int(r.lab.bonus_token[0]) == -1  # no invented bonus
    run = rec.to_trace()
    assert run.steps == [] and "node 1, whose target row was not recorded" in run.metadata["skipped_rows"][0]["why"]


def test_a_corrupted_recording_is_refused_naming_the_tensor(tmp_path):
    for suffix in (".json", ".safetensors"):
        (tmp_path / f"rec{suffix}").write_bytes(FIXTURE.with_suffix(suffix).read_bytes())
    sr.load_recording(tmp_path / "rec")
    data = bytearray((tmp_path / "rec.safetensors").read_bytes())
    data[-5] ^= 0xFF  # a byte in the data region (the header is at the front)
    (tmp_path / "rec.safetensors").write_bytes(bytes(data))
    with pytest.raises(sr.RecordingFormatError, match=r"step \d+: tensor '\w+' does not match its checksum"):
        sr.load_recording(tmp_path / "rec")
    with pytest.raises(FileNotFoundError, match="no such file"):
        sr.load_recording(tmp_path / "missing")


def test_saving_never_creates_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not create it"):
        sr.save_recording([], tmp_path / "no" / "dir" / "rec")
    assert not (tmp_path / "no").exists()


def test_converted_trace_lists_its_requests_and_summarises(tmp_path):
    from ddtree_lab import notebook, views

    out = dl.io.convert(FIXTURE, tmp_path / "sglang.ddtrace.safetensors")
    run = dl.load_trace(out)
    ids = [r["request_id"] for r in run.metadata["requests"]]
    assert ids == [f"req-{i}" for i in range(6)]
    assert [r["params"]["temperature"] for r in run.metadata["requests"]] == [0.0] * 3 + [0.8] * 3
    assert all(run.metadata["requests"][s.request]["request_id"] == s.request_id for s in run.steps)
    rows = notebook.summary(run)
    assert [r["request"] for r in rows] == ids and [r["steps"] for r in rows] == [1] * 3 + [2] * 3
    recording = sr.load_recording(FIXTURE)
    converted = {(s.step, s.request_id) for s in run.steps}
    rows = [r for r in sr.replay_recording(recording) if r.request_id == "req-0" and (r.step, "req-0") in converted]
    emitted = [t for r in rows for t in r.sglang.emitted_tokens[0].tolist() if t >= 0]
    root = int(rows[0].verify_input.node_token_ids[0, 0])
    assert run.metadata["requests"][0]["generated_token_ids"] == [root] + emitted
    assert run.metadata["requests"][0]["prompt"] is None  # the CPU recipe has no SGLang Req
    text = views.committed_html(run, 0)
    assert text.count("<span") == len(emitted) + 1
    assert len(run.metadata["skipped_rows"]) == 3  # the rejection-sampling rows


def test_replay_report_ends_with_the_counts():
    lines = sr.replay_report(sr.replay_recording(FIXTURE))
    assert len(lines) == 13 and lines[-1] == "12 rows: 8 agree, 1 differs (1 by design), 3 not replayable"
    assert any(line.startswith("step 2 row 1 req-4 chain: differs by design (not a finding): node 0's children")
               and line.endswith("bonus_token: recorded 39 != replayed 11") for line in lines)
    assert sr.hook_dir().endswith("_sglang_hook") and Path(sr.hook_dir(), "sitecustomize.py").is_file()


@needs_sglang
def test_replay_names_sglangs_num_speculative_tokens_limit():
    """SGLang walks at most S - 1 draft tokens; the lab to the leaf: differs, by design."""
    g = torch.Generator().manual_seed(3)
    ids, lp = dl.draft_topk_from_logits(torch.randn(1, 5, 10, generator=g), k=1)
    tree = dl.build_tree(ids, lp, torch.tensor([4]), 5)
    vi = dl.compile_retrieve(tree, 3)
    logits = torch.randn(1, vi.num_rows, 10, generator=g)
    for i in range(1, vi.num_rows):
        logits[0, int(tree.parents[0, i]), int(tree.node_token_ids[0, i])] += 50.0  # accept everything
    rec = sr.SGLangRecorder()
    sb.sglang_verify_greedy(vi, logits, num_speculative_tokens=3,
                            kernel=rec.wrap(sb.sglang_kernels()["verify_tree_greedy_triton"], "greedy"))
    (r,) = sr.replay_recording(rec.recording())
    assert r.verdict == "differs" and r.by_design and "num_speculative_tokens - 1 = 2" in r.explanation
    assert int(r.lab.accept_length[0]) == 5 and int(r.sglang.accept_length[0]) == 2


def test_a_converted_row_bundles_and_replays(tmp_path):
    """Bundles work on SGLang recordings through their lab traces (the differing row included)."""
    from ddtree_lab.io import bundle

    run = sr.recording_to_trace(sr.load_recording(FIXTURE))
    step = next(s for s in run.steps if s.extra["verdict"] == "differs")
    bundle.save_bundle(bundle.make_bundle(run, step), tmp_path)
    assert bundle.replay_bundle(tmp_path).ok


def test_recording_problems_name_every_broken_row():
    recording = sr.load_recording(FIXTURE)
    assert sr.recording_problems(recording) == []
    t = recording.steps[0]["tensors"]
    first = int(t["retrive_next_token"][1, 0])
    t["retrive_next_sibling"][1, first] = first  # a node that is its own next sibling: SGLang's walk would hang
    recording.steps[1]["tensors"]["uniform_samples"][2, 3] = 1.0
    recording.steps[2]["tensors"]["predicts"][0, 0] += 1  # predicts disagree with the accepted token
    problems = sr.recording_problems(recording)
    assert problems[0].startswith("step 0 (call 0), row 1 (req-1): node 0: sibling chain") and str(first) in problems[0]
    # the loop cuts off the root's later children: each is named (every problem, not the first)
    assert problems[1:-2] and all(p.startswith("step 0 (call 0), row 1 (req-1): node ")
                                  and p.endswith("not reachable from the root") for p in problems[1:-2]), problems
    assert problems[-2] == "step 1 (call 1), row 2 (req-5): node 3: coin 1.0 is not in [0, 1)"
    assert problems[-1].startswith("step 2 (call 2), row 0 (req-3): SGLang's output: predicts")


def test_recording_problems_report_two_distinct_problems_of_one_row():
    recording = sr.load_recording(FIXTURE)
    t = recording.steps[0]["tensors"]
    n = t["retrive_next_token"].shape[1]
    leaf = max(i for i in range(1, n) if int(t["retrive_next_token"][1, i]) == -1 and int(t["retrive_index"][1, i]) >= 0)
    t["retrive_next_token"][1, leaf] = n + 4  # a first-child link out of range
    t["retrive_index"][1, 2] = 5  # node 2 claims node 5's row (recordings store request-local rows)
    problems = sr.recording_problems(recording)
    assert len(problems) == 2, problems
    assert all(p.startswith("step 0 (call 0), row 1 (req-1): node ") for p in problems), problems
    assert any(f"node {leaf}: " in p and "retrieve_next_token" in p for p in problems), problems
    assert any("node 2: retrieve_index" in p for p in problems), problems
