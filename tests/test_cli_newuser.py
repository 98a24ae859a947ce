"""The CLI as a new user meets it (issue 18): bad options refused before any model loads,
one rule and one message per option, a warning with the cost of a huge budget, defaults in
--help, --quiet that is quiet, counts with their nouns in the right number."""

from pathlib import Path

import pytest

from ddtree_lab import cli
from ddtree_lab.cli import main

TRACE = str(Path(__file__).resolve().parent.parent / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors")


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test's command with a marker (so a check that runs after the
    load shows up as that marker instead of its own message)."""
    def load(spec, **kw):
        raise cli.CLIError(f"MODEL LOADED ({spec})")

    monkeypatch.setattr(cli.common, "load_model", load)


@pytest.mark.parametrize("budget", ["100000", "0", "-3"])
def test_record_budget_is_one_rule_checked_before_the_model(budget, no_model, tmp_path, capsys):
    assert main(["record", "--prompt", "hi", "--budget", budget, "-o", str(tmp_path / "t.ddtrace")]) == 2
    err = capsys.readouterr().err
    assert f"--budget {budget}: must be in [1, 65536]" in err and "MODEL LOADED" not in err


def test_audit_sampling_overrides_are_checked_before_the_model(no_model, capsys):
    assert main(["audit", TRACE, "--step", "1", "--request", "0", "--temperature", "-1", "--model", "default"]) == 2
    err = capsys.readouterr().err
    assert "temperature must be finite and >= 0" in err and "MODEL LOADED" not in err
    assert main(["audit", TRACE, "--step", "1", "--request", "0", "--top-p", "0.5"]) == 2
    assert "need --model" in capsys.readouterr().err


def test_a_huge_budget_warns_with_the_estimated_cost(no_model, tmp_path, capsys):
    assert main(["record", "--prompt", "hi", "--budget", "1024", "--max-new-tokens", "8",
                 "-o", str(tmp_path / "t.ddtrace")]) == 2
    err = capsys.readouterr().err
    assert "warning: --budget 1024 is large: expect roughly 78 s and 3.2 GB for 8 tokens" in err
    assert err.index("warning") < err.index("MODEL LOADED")
    assert cli.live.record_cost(512, 8) is None and cli.live.record_cost(32, 1000) is None


def test_help_shows_defaults():
    text = cli.build_parser()._subparsers._group_actions[0].choices["record"].format_help()
    assert "(default: 32)" in text and "(default: full)" in text and "(default: 0.0)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_quiet_silences_the_model_loaders_bar(no_model, tmp_path, capsys):
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    try:
        main(["record", "--prompt", "hi", "--quiet", "-o", str(tmp_path / "t.ddtrace")])
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
    capsys.readouterr()


def test_counts_have_their_nouns_in_the_right_number(capsys):
    assert cli.common.count(1, "step") == "1 step" and cli.common.count(0, "problem") == "0 problems"
    assert main(["replay", TRACE, "--step", "1", "--request", "0"]) == 0
    out = capsys.readouterr().out
    assert "1 step replayed" in out and "1 steps" not in out


@pytest.mark.parametrize("args, want", [
    (["--prompt", ""], "--prompt \"\" (the 1st --prompt): empty prompt"),
    (["--prompt", "hi", "--ban", "49152"], "--ban 49152: not a token id of the embedded SmolLM2-135M-Instruct "
                                           "(its vocabulary has ids 0..49151)"),
    (["--prompt", "hi", "--ban", "-1"], "--ban -1: not a token id"),
    (["--prompt", "hi", "--temperature", "-0.5"], "--temperature -0.5: temperature must be finite and >= 0"),
    (["--prompt", "hi", "--top-p", "1.5"], "--top-p 1.5: top_p must be in (0, 1]"),
    (["--prompt", "hi", "--top-k", "50000"], "--top-k 50000: top_k = 50000 exceeds the vocabulary size 49152"),
    (["--prompt", "hi", "--min-p", "2"], "--min-p 2.0: min_p must be in [0, 1]"),
    (["--prompt", "hi", "--budget", "0"], "--budget 0: must be in [1, 65536]"),
])
def test_record_checks_every_argument_before_the_model_loads(args, want, no_model, tmp_path, capsys):
    out = tmp_path / "t.ddtrace"
    assert main(["record", *args, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert want in err and "MODEL LOADED" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_record_checks_an_empty_prompt_and_a_ban_against_a_local_targets_vocabulary(no_model, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": ""}\n')
    assert main(["record", "--prompts", str(prompts), "-o", str(tmp_path / "t.ddtrace")]) == 2
    assert f"{prompts}, line 2: field 'prompt' is empty" in capsys.readouterr().err
    model = tmp_path / "tiny-model"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 100}')
    assert main(["record", "--prompt", "hi", "--target", str(model), "--ban", "100", "-o", str(tmp_path / "t.ddtrace")]) == 2
    err = capsys.readouterr().err
    assert f"--ban 100: not a token id of {model} (its vocabulary has ids 0..99)" in err and "MODEL LOADED" not in err
    assert main(["record", "--prompt", "hi", "--target", str(model), "--ban", "99", "-o", str(tmp_path / "t.ddtrace")]) == 2
    assert "MODEL LOADED" in capsys.readouterr().err  # every check passed: the model would load now


def test_the_default_targets_vocabulary_is_read_from_its_gguf_header_without_loading_it():
    from ddtree_lab.models.default_target import default_target_gguf, gguf_vocab_size, target_vocab_size

    assert gguf_vocab_size(default_target_gguf()) == 49152 == target_vocab_size()


def test_record_refuses_a_safetensors_name_for_its_segment_file(no_model, tmp_path, capsys):
    import torch
    from safetensors import safe_open

    import ddtree_lab as dl
    from ddtree_lab.io.append_trace import TraceWriter
    from ddtree_lab.io.live_record import SessionRecorder
    from ddtree_lab.io.synthetic import SyntheticShape, synthetic_steps

    out = tmp_path / "run.ddtrace.safetensors"
    assert main(["record", "--prompt", "hi", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "append-only segment file" in err and "not safetensors" in err and "name it run.ddtrace" in err
    assert "MODEL LOADED" not in err and not out.exists()
    with pytest.raises(ValueError, match="record_to=.*name it run.ddtrace"):
        SessionRecorder(out)
    # what the message says is so: the segment file is not safetensors, convert writes one that is
    seg = tmp_path / "run.ddtrace"
    w = TraceWriter(seg, {"vocab_size": 300})
    w.write_steps(synthetic_steps(SyntheticShape(requests=1, budget=4, vocab=300), 1, 0), {})
    w.close()
    from safetensors import SafetensorError

    with pytest.raises(SafetensorError, match="header too large"):  # what issue 26.4 saw
        safe_open(str(seg), framework="pt")
    with pytest.raises(ValueError, match="not safetensors"):
        TraceWriter(out, {"vocab_size": 300})
    from ddtree_lab.io import convert

    convert(seg, out)
    with safe_open(str(out), framework="pt") as f:
        assert any(isinstance(f.get_tensor(k), torch.Tensor) for k in f.keys())
    assert len(dl.load(out).steps) == 1


def test_a_damaged_step_is_named_as_damaged_not_out_of_range(tmp_path, capsys):
    from ddtree_lab.io.append_trace import TraceWriter
    from ddtree_lab.io.synthetic import SyntheticShape, synthetic_steps
    from ddtree_lab.store.segments import scan

    path = tmp_path / "run.ddtrace"
    w = TraceWriter(path, {"vocab_size": 300})
    for k in range(6):  # one segment per step: steps 0..5 of request 0
        w.write_steps(synthetic_steps(SyntheticShape(requests=1, budget=6, vocab=300), 3, k), {})
    w.close()
    raw = bytearray(path.read_bytes())
    entries, _ = scan(path)
    steps_segments = [e for e in entries if e.kind == "steps"]
    raw[steps_segments[2].end - 5] ^= 0xFF  # a tensor byte of step 2
    path.write_bytes(bytes(raw))
    for args in (["render", str(path), "--step", "2"], ["render", str(path), "--step", "2", "--request", "0"],
                 ["bundle", str(path), "--step", "2", "--request", "0", "-o", str(tmp_path / "b")]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "out of range" not in err, err
        assert "step 2, request 0 is damaged and was left out" in err and "checksum" in err, err
        assert "the readable steps of request 0: 0..1, 3..5" in err, err
    assert main(["render", str(path), "--step", "9", "--request", "0"]) == 2  # a step that never was: out of range
    assert "out of range" in capsys.readouterr().err
    assert main(["render", str(path), "--step", "3", "--request", "0"]) == 0


def test_replay_hints_say_what_the_file_is_and_which_command_reads_it(tmp_path, capsys):
    from ddtree_lab.io.append_trace import TraceWriter
    from ddtree_lab.io.synthetic import SyntheticShape, synthetic_steps

    recorded = tmp_path / "run.ddtrace"  # what `ddtree-lab record` writes
    w = TraceWriter(recorded, {"vocab_size": 300})
    w.write_steps(synthetic_steps(SyntheticShape(requests=1, budget=4, vocab=300), 1, 0), {})
    w.close()
    assert main(["replay", str(recorded), "--backend", "torch-lazy"]) == 2
    err = capsys.readouterr().err
    assert "recorded by `ddtree-lab record`" in err and "SGLang" not in err, err
    assert "backend 'reference'" in err and f"ddtree-lab audit {recorded} --step 0 --request 0 --model default " \
                                           "--verifier torch-lazy" in err, err
    assert main(["sglang", "replay", str(recorded)]) == 2
    err = capsys.readouterr().err
    assert "recorded by `ddtree-lab record`" in err and "not an SGLang recording" in err, err
    assert f"replay it with: ddtree-lab replay {recorded}" in err and "format" not in err, err
    converted = tmp_path / "sgl.ddtrace.safetensors"
    recording = str(Path(TRACE).parents[1] / "sglang_cpu_recording.json")
    assert main(["sglang", "convert", recording, "-o", str(converted)]) == 0
    capsys.readouterr()
    assert main(["replay", str(converted), "--backend", "triton"]) == 2
    err = capsys.readouterr().err
    assert "converted from an SGLang recording" in err and "ddtree-lab replay RECORDING --backend triton" in err, err
    assert main(["sglang", "replay", TRACE]) == 2
    assert "a lab trace" in capsys.readouterr().err


def test_loading_a_model_shows_progress_on_stderr_and_nothing_on_stdout(monkeypatch, capsys):
    import ddtree_lab.models as models

    monkeypatch.setenv("DDTREE_LAB_PROGRESS", "1")  # captured stderr is no terminal: bars on anyway

    monkeypatch.setattr(models, "load_default_target", lambda: "a target")  # no real load in the fast loop
    assert cli.common.load_model("default") == "a target"
    out, err = capsys.readouterr()
    assert out == "" and "loading target the embedded SmolLM2-135M-Instruct" in err and "1/1" in err
    assert cli.common.load_model("default", quiet=True) == "a target"
    assert capsys.readouterr() == ("", "")


def test_diagnose_with_a_model_shows_each_check_on_stderr(monkeypatch, capsys):
    import ddtree_lab.diagnosis as diagnosis

    monkeypatch.setenv("DDTREE_LAB_PROGRESS", "1")  # captured stderr is no terminal: bars on anyway

    def load_models(model, run):
        raise RuntimeError("MODEL LOADED")

    monkeypatch.setattr(diagnosis, "load_models", load_models)
    assert main(["diagnose", TRACE, "--step", "1", "--request", "0", "--model", "default"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "diagnose:" in err and "loading the model" in err and "MODEL LOADED" in err
    names = []
    import ddtree_lab as dl

    diagnosis.diagnose(dl.load(TRACE), step=1, request=0, progress=names.append)
    assert tuple(names) == diagnosis.RECORD_CHECKS


def test_compare_policies_counts_its_steps_on_the_progress_callback():
    import ddtree_lab as dl
    from ddtree_lab.analysis.counterfactual import run_counterfactuals

    done = []
    results = run_counterfactuals(dl.load(TRACE), ["chain"], [4], max_steps=3, progress=lambda: done.append(1))
    assert len(done) == 3 == len({(r.step, r.request) for r in results})
