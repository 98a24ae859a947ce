"""Every verb of `ddtree-lab` on the fixture traces, bad input, and --help everywhere."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ddtree_lab as dl
from ddtree_lab.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "fixtures" / "traces" / "smollm2_greedy_b32.ddtrace.safetensors"
SAMPLED = ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"
RECORDING = ROOT / "fixtures" / "sglang_cpu_recording.json"
VERBS = ["record", "info", "render", "bundle", "replay", "audit", "doctor", "diagnose", "sglang", "lab", "export",
         "compare-policies", "report", "vllm"]


def run_cli(*args):
    """The console entry point in a fresh process: (exit status, stdout, stderr)."""
    r = subprocess.run([sys.executable, "-m", "ddtree_lab.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    return r.returncode, r.stdout, r.stderr


def test_cli_info_replay_render(tmp_path, capsys):
    assert main(["info", str(TRACE)]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out
    assert main(["replay", str(TRACE)]) == 0
    assert "replayed bit for bit" in capsys.readouterr().out
    svg = tmp_path / "s.svg"
    assert main(["render", str(TRACE), "--step", "0", "--request", "0", "--out", str(svg)]) == 0
    assert "<svg" in svg.read_text()
    assert main(["render", str(TRACE), "--step", "0", "--request", "0", "--format", "text"]) == 0
    assert "◆ [0]" in capsys.readouterr().out


def test_info_lists_requests_prompts_tau_and_keeps_the_drafter_to_a_line(capsys):
    assert main(["info", str(TRACE)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) < 20
    drafter = [line for line in lines if line.startswith("drafter:")]
    assert len(drafter) == 1 and "{" not in drafter[0] and "smollm2-ridge" in drafter[0]
    run = dl.load_trace(TRACE)
    for r in run.metadata["requests"]:
        assert json.dumps(r["prompt"]) in out
    assert out.count("mean tau") == 3
    # request 1's step list starts with its own step numbers and taus
    start = [k for k, x in enumerate(lines) if x.startswith("request 1 ")][0]
    assert lines[start + 1].startswith("  prompt: ") and lines[start + 2].startswith("  generated (64 tokens): ")
    line = lines[start + 3]
    s = run.for_request(1)
    assert line.startswith("  steps (step:tau): " + f"{s[0].step}:{s[0].accept_length + 1}")


def test_render_addresses_decoding_step_and_request(tmp_path, capsys):
    run = dl.load_trace(TRACE)
    want = next(s for s in run.steps if s.step == 8 and s.request == 1)
    assert main(["render", str(TRACE), "--step", "8", "--request", "1", "--format", "decisions"]) == 0
    text = capsys.readouterr().out
    first = want.decisions[0]
    assert f"{first.node}" in text and run.text(first.token).strip() in text.replace("␣", " ")
    for suffix, magic in ((".svg", b"<svg"), (".png", b"\x89PNG"), (".dot", b"digraph"), (".txt", "◆ [0]".encode())):
        out = tmp_path / f"tree{suffix}"
        assert main(["render", str(TRACE), "--step", "8", "--request", "1", "-o", str(out)]) == 0
        assert magic in out.read_bytes()[:4096]
    assert "step 8, request 1" in capsys.readouterr().out
    # ambiguous: three requests have step 8
    assert main(["render", str(TRACE), "--step", "8"]) == 2
    err = capsys.readouterr().err
    assert "requests 0, 1, 2" in err and "--request" in err


def test_replay_reports_each_difference(tmp_path, capsys):
    run = dl.load_trace(TRACE)
    step = next(s for s in run.steps if s.step == 3 and s.request == 0)
    step.output.accept_length[0] += 1  # a recorded output that the verifier does not reproduce
    bad = dl.save_trace(dl.Run(run.metadata, [step], run.token_texts), tmp_path / "bad.ddtrace.safetensors")
    assert main(["replay", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "step 3, request 0" in out and "accept_length" in out and "1 differ" in out
    assert main(["replay", str(TRACE), "--step", "3", "--request", "0"]) == 0
    assert "1 step replayed bit for bit" in capsys.readouterr().out
    assert main(["replay", str(TRACE), "--backend", "triton"]) == 2
    err = capsys.readouterr().err  # the advice is one that works (issue 18.4): the reference replays it
    assert "needs the whole target rows" in err and "backend 'reference'" in err


def test_replay_and_sglang_verbs_on_the_recording(tmp_path, capsys):
    assert main(["replay", str(RECORDING)]) == 0
    assert "12 rows" in capsys.readouterr().out
    assert main(["sglang", "replay", str(RECORDING), "--backend", "torch-lazy"]) == 0
    assert "12 rows" in capsys.readouterr().out
    assert main(["sglang", "hook-dir"]) == 0
    hook = Path(capsys.readouterr().out.strip())
    assert (hook / "sitecustomize.py").exists()
    out = tmp_path / "sgl.ddtrace.safetensors"
    assert main(["sglang", "convert", str(RECORDING), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    assert "records" in capsys.readouterr().out
    assert main(["doctor", str(RECORDING)]) == 0
    assert "0 problems" in capsys.readouterr().out


def test_a_by_design_difference_has_one_verdict_in_every_verb(tmp_path, capsys):
    """SGLang's float32 u < S at u ~ S (the fixture's step 2, request 4): every verb says
    "differs by design (not a finding)" with the same explanation, and exits 0 (issue 34.4)."""
    why = "SGLang rejects node 1 because coin 0.99999994 is not < S = 0.99999994"
    converted = tmp_path / "sgl.ddtrace.safetensors"
    assert main(["sglang", "convert", str(RECORDING), "-o", str(converted)]) == 0
    capsys.readouterr()
    for argv, count in ((["sglang", "replay", str(RECORDING)], "1 differs (1 by design)"),
                        (["replay", str(RECORDING)], "1 differs (1 by design)"),
                        (["replay", str(converted)], "9 steps replayed bit for bit"),
                        (["diagnose", str(RECORDING)], "0 findings (1 differs by design, not a finding)"),
                        (["diagnose", str(converted)], "0 findings (1 differs by design, not a finding)"),
                        (["doctor", str(RECORDING)], "0 problems (1 differs by design, not a problem)"),
                        (["doctor", str(converted)], "0 problems (1 differs by design, not a problem)")):
        assert main(argv) == 0, argv
        out = capsys.readouterr().out
        lines = [line for line in out.splitlines() if "differs by design (not a finding): " in line]
        assert len(lines) == 1 and why in lines[0] and count in out, (argv, out)
    report = tmp_path / "r.md"
    assert main(["report", str(RECORDING), "--step", "2", "--request", "4", "-o", str(report)]) == 0
    text = report.read_text()
    assert "0 findings (1 differs by design, not a finding)" in text and "FINDING" not in text
    assert "differs by design (not a finding): " in text and why in text


def test_audit_verb(tmp_path, capsys):
    plot = tmp_path / "audit.html"
    assert main(["audit", str(SAMPLED), "--step", "27", "--request", "1", "--draws", "1500", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "verdict: consistent with lossless" in out and "plotly" in plot.read_text()
    assert main(["audit", str(SAMPLED), "--step", "27", "--request", "1", "--draws", "1500",
                 "--verifier", "coin-reuse"]) == 1
    assert "verdict: LOSSY" in capsys.readouterr().out
    assert main(["audit", "--random", "1", "--draws", "1500", "--threshold-acc", "0.5"]) == 1
    assert "lossy thresholds" in capsys.readouterr().out
    assert main(["audit", "--random", "1", "--draws", "1000"]) == 0


def test_bundle_verb_and_the_verbs_on_a_bundle(tmp_path, capsys):
    out = tmp_path / "bug"
    assert main(["bundle", str(SAMPLED), "--step", "27", "--request", "1", "-o", str(out)]) == 0
    assert "step 27, request 1" in capsys.readouterr().out
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert size <= 200_000 and (out / "README.md").exists()
    assert main(["replay", str(out)]) == 0
    assert "bit for bit" in capsys.readouterr().out
    assert main(["doctor", str(out)]) == 0
    assert "0 problems" in capsys.readouterr().out
    assert main(["audit", str(out), "--draws", "1000"]) == 0
    assert "consistent with lossless" in capsys.readouterr().out
    assert main(["audit", str(out), "--draws", "1000", "--verifier", "threshold"]) == 1
    assert main(["bundle", str(SAMPLED), "--step", "27", "--request", "1", "-o", "/no/such/dir/b"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_audit_with_the_model_audits_the_transforms(capsys):
    args = ["audit", str(SAMPLED), "--step", "27", "--request", "1", "--model", "default", "--draws", "1500",
            "--temperature", "0.5"]
    assert main(args) == 0
    assert main(args + ["--verifier", "temperature-1"]) == 1
    assert "verdict: LOSSY" in capsys.readouterr().out
    assert main(["audit", str(SAMPLED), "--step", "27", "--request", "1", "--top-k", "3"]) == 2
    assert "--model" in capsys.readouterr().err


def test_doctor_reports_every_problem(tmp_path, capsys):
    assert main(["doctor", str(TRACE)]) == 0
    assert "113 steps checked, 0 problems" in capsys.readouterr().out
    run = dl.load_trace(TRACE)
    step = next(s for s in run.steps if s.step == 1 and s.request == 2)
    kids = [i for i in range(1, step.num_nodes) if int(step.parents[i]) == 0]
    step.retrieve_next_sibling = step.retrieve_next_sibling.clone()
    step.retrieve_next_sibling[kids[-1]] = kids[0]  # the root's sibling chain loops
    step.positions = step.positions.clone()
    step.positions[3] += 1
    bad = dl.save_trace(dl.Run(run.metadata, [step], run.token_texts), tmp_path / "bad.ddtrace.safetensors")
    assert main(["doctor", str(bad)]) == 1
    out = capsys.readouterr().out
    loop = [line for line in out.splitlines() if "reached twice" in line or "cycle" in line]
    assert loop and ("node 0" in loop[0] or f"node {kids[0]}" in loop[0])
    assert any("node 3" in line and "position" in line for line in out.splitlines())
    assert "2 problems" in out


def test_doctor_on_a_broken_sglang_recording(tmp_path, capsys):
    from ddtree_lab import sglang as sg

    rec = sg.load_recording(RECORDING)
    sib = rec.steps[0]["tensors"]["retrive_next_sibling"]
    first = int(rec.steps[0]["tensors"]["retrive_next_token"][0, 0])
    second = int(sib[0, first])
    assert second >= 0
    sib[0, second] = first  # the root's children loop: SGLang's sibling walk would never end
    path = tmp_path / "broken"
    sg.save_recording(rec.steps, path, rec.metadata)
    assert main(["doctor", str(path)]) == 1
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "row 0" in line]
    assert lines and ("cycle" in lines[0] or "twice" in lines[0])
    assert all("not reachable from the root" in line for line in lines[1:])  # every problem, not the first
    assert f"{len(lines)} problems" in out


def test_doctor_with_the_model(capsys):
    assert main(["doctor", str(SAMPLED), "--model", "default", "--step", "27", "--request", "1", "--sample", "2"]) == 0
    assert "match causal forwards" in capsys.readouterr().out


def test_record_inline_and_jsonl(tmp_path, capsys):
    out = tmp_path / "run.ddtrace"
    assert main(["record", "--prompt", "Name a colour.", "--budget", "4", "--max-new-tokens", "4", "--quiet",
                 "-o", str(out)]) == 0
    run = dl.load_trace(out)
    assert run.steps and run.metadata["budget"] == 4 and run.steps[0].params.is_greedy
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    assert '"Name a colour."' in capsys.readouterr().out
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "Say hi.", "temperature": 0.7, "top_k": 20, "seed": 5, "id": "a"}) + "\n"
                     + json.dumps({"prompt": "Say bye."}) + "\n")
    out2 = tmp_path / "run2.ddtrace"
    assert main(["record", "--prompts", str(jsonl), "--budget", "4", "--max-new-tokens", "3", "--quiet",
                 "--temperature", "0", "-o", str(out2)]) == 0
    run2 = dl.load_trace(out2)
    params = {r["request_id"]: r["params"] for r in run2.metadata["requests"]}
    assert params["a"]["temperature"] == 0.7 and params["a"]["top_k"] == 20 and params["a"]["seed"] == 5
    assert params["1"]["temperature"] == 0.0
    assert main(["replay", str(out2)]) == 0
    light = tmp_path / "light.ddtrace"
    for drafter in ("dflash", "ridge"):
        assert main(["record", "--prompt", "Say hi.", "--budget", "4", "--max-new-tokens", "3", "--quiet", "--level",
                     "light", "--drafter", drafter, "-o", str(light)]) == 0
        meta = dl.load_trace(light).metadata
        assert meta["record"] == "light" and meta["drafter"]["name"] == f"smollm2-{drafter}-b16"
        light.unlink()


def test_record_bad_input(tmp_path, capsys):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "ok"}\n{"prompt": "x", "temprature": 1}\n')
    assert main(["record", "--prompts", str(jsonl), "-o", str(tmp_path / "r.ddtrace")]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "temprature" in err and len(err.strip().splitlines()) == 1
    assert main(["record", "--prompt", "x", "--temperature", "-1", "-o", str(tmp_path / "r.ddtrace")]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["record", "--prompt", "x", "-o", "/no/such/dir/r.ddtrace"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["record", "--prompt", "x", "--drafter", "eagle", "-o", str(tmp_path / "r.ddtrace")]) == 2
    assert "--drafter eagle: no such file or directory" in capsys.readouterr().err
    from ddtree_lab.models import default_drafter_path

    assert main(["info", str(default_drafter_path())]) == 2  # drafter weights with a .json beside them
    assert "not a trace, bundle or recording" in capsys.readouterr().err
    assert not Path("/no/such/dir").exists()


def test_lab_dry_run(capsys):
    assert main(["lab", "--dry-run", "--port", "8899"]) == 0
    out = capsys.readouterr().out
    assert "--ip=127.0.0.1" in out and "--port=8899" in out and "labs" in out and "<token>" in out


def test_cli_bad_input(tmp_path, capsys):
    assert main(["render", str(TRACE), "--step", "9999", "--request", "0"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["render", str(TRACE), "--step", "1", "--request", "7"]) == 2
    assert "--request 7 does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.safetensors"
    bad.write_text("not a trace")
    assert main(["info", str(bad)]) == 2
    assert "not a safetensors file" in capsys.readouterr().err
    assert main(["info", str(tmp_path / "missing.safetensors")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["render", str(TRACE), "--step", "1", "--request", "0", "-o", str(tmp_path / "x.jpg")]) == 2
    assert "suffix" in capsys.readouterr().err


def test_a_corrupted_step_is_named_and_the_others_stay_readable(tmp_path):
    data = bytearray(TRACE.read_bytes())
    header = int.from_bytes(data[:8], "little")
    for k in range(8 + header + 1000, 8 + header + 1064):  # flip bytes inside the first step's tensors
        data[k] ^= 0xFF
    bad = tmp_path / "flipped.ddtrace.safetensors"
    bad.write_bytes(bytes(data))
    whole = dl.load_trace(TRACE)
    run = dl.load(bad)
    assert len(run.problems) == 1 and "checksum" in run.problems[0] and "record 0 = step 0, request 0" in run.problems[0]
    assert len(run.steps) == len(whole.steps) - 1
    for args, want in ((["info", bad], 1), (["replay", bad], 1), (["doctor", bad], 1),
                       (["render", bad, "--step", "1", "--request", "0"], 0)):
        rc, out, err = run_cli(*args)
        assert rc == want, (args, out, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert "checksum" in err and "step 0, request 0" in err, err
    rc, out, err = run_cli("replay", bad)
    n = len(whole.steps)  # the counts add up (issue 34.6): the same + differ + not replayable = every step
    assert f"{n} steps with the reference verifier: {n - 1} the same (bit for bit), 0 differ, 1 not replayable " \
           "(1 damaged)" in out, out
    for args in (["render", bad, "--step", "0", "--request", "0"], ["bundle", bad, "--step", "0", "--request", "0",
                                                                    "-o", tmp_path / "b"]):
        rc, out, err = run_cli(*args)
        assert rc == 2 and "is damaged" in err and "checksum" in err, (args, out, err)
    with pytest.raises(dl.TraceFormatError, match="checksum"):
        dl.load_trace(bad)  # the strict reader still refuses the whole file


def test_errors_are_one_line_without_traceback(tmp_path):
    data = bytearray(TRACE.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + 2:8 + 40] = b"X" * 38  # a corrupted header
    bad = tmp_path / "corrupt.ddtrace.safetensors"
    bad.write_bytes(bytes(data))
    for args in (["info", bad], ["replay", bad], ["render", bad, "--step", "0", "--request", "0"], ["doctor", bad],
                 ["info", tmp_path / "missing"], ["render", TRACE, "--step", "-3", "--request", "0"]):
        rc, out, err = run_cli(*args)
        assert rc == 2, (args, out, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"ddtree-lab {args[0]}: ")
    assert header > 0


@pytest.mark.parametrize("verb", VERBS)
def test_help_on_every_verb(verb, capsys):
    with pytest.raises(SystemExit) as exc:
        main([verb, "--help"])
    assert exc.value.code == 0
    assert f"ddtree-lab {verb}" in capsys.readouterr().out


def test_every_verb_is_listed():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(VERBS)


def test_a_lossy_recording_is_marked_by_info_replay_and_render(tmp_path, capsys):
    out = tmp_path / "lossy.ddtrace"
    assert main(["record", "--prompt", "Name a colour.", "--budget", "4", "--max-new-tokens", "4", "--quiet",
                 "--temperature", "0.8", "--threshold-acc", "0.5", "-o", str(out)]) == 0
    run = dl.load_trace(out)
    assert run.steps and all(s.thresholds == (1.0, 0.5) and s.lossy for s in run.steps)
    assert run.metadata["thresholds"] == [1.0, 0.5]
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    n = len(run.steps)
    assert f"LOSSY: threshold_acc=0.5 ({n} of {n} steps)" in capsys.readouterr().out
    assert main(["replay", str(out)]) == 0  # replayed under the recorded thresholds
    text = capsys.readouterr().out
    assert "LOSSY: threshold_acc=0.5" in text and "replayed bit for bit" in text
    s = run.steps[0]
    assert main(["render", str(out), "--step", str(s.step), "--request", "0", "--format", "dot"]) == 0
    assert "LOSSY: threshold_acc=0.5" in capsys.readouterr().out
    assert main(["info", str(SAMPLED)]) == 0
    assert "LOSSY" not in capsys.readouterr().out
    assert main(["record", "--prompt", "x", "--threshold-acc", "-1", "--quiet", "-o", str(tmp_path / "bad.ddtrace")]) != 0
    assert "--threshold-acc must be a finite number >= 0" in capsys.readouterr().err


# -- a new user's findings: arguments are checked before any work, and selections that match nothing fail


def _err(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_record_refuses_a_bad_output_path_before_loading_the_model(tmp_path, capsys, monkeypatch):
    from ddtree_lab import notebook

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(notebook, "load_default", no_model)
    out = str(tmp_path / "r.ddtrace")
    assert main(["record", "--prompt", "x", "-o", str(tmp_path)]) == 2
    assert "is a directory" in _err(capsys)
    assert main(["record", "--prompt", "x", "-o", str(tmp_path / "no" / "r.ddtrace")]) == 2
    assert "does not exist" in _err(capsys)
    assert main(["record", "--prompt", "x", "--max-new-tokens", "0", "-o", out]) == 2
    assert "--max-new-tokens 0" in _err(capsys)
    assert main(["record", "--prompt", "x", "--budget", "-1", "-o", out]) == 2
    assert "--budget -1" in _err(capsys)
    assert main(["record", "--prompt", "x", "--target", "/no/such", "-o", out]) == 2
    err = _err(capsys)
    assert "--target /no/such" in err and "--model" not in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": "b", "temperature": "hot"}\n')
    assert main(["record", "--prompts", str(bad), "-o", out]) == 2
    err = _err(capsys)
    assert f"{bad}, line 2" in err and "temperature" in err
    bad.write_text('{"prompt": "a"}\n{"prompt": "b", "temperature": -3}\n')
    assert main(["record", "--prompts", str(bad), "-o", out]) == 2
    assert f"{bad}, line 2" in _err(capsys)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert main(["record", "--prompts", str(empty), "-o", out]) == 2
    err = _err(capsys)
    assert f"{empty}: no prompts" in err and "record needs" not in err
    assert not Path(out).exists()


def test_save_and_load_trace_name_a_directory(tmp_path):
    run = dl.load_trace(TRACE)
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):
        dl.save_trace(run, tmp_path)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        dl.load_trace(tmp_path)


def test_selections_that_match_nothing_fail(tmp_path, capsys):
    assert main(["doctor", str(TRACE), "--step", "500", "--request", "0"]) == 2
    assert "--step 500" in (err := _err(capsys)) and "steps 0.." in err
    assert main(["doctor", str(TRACE), "--request", "9"]) == 2
    assert "requests: 0, 1, 2" in _err(capsys)
    assert main(["replay", str(TRACE), "--request", "9"]) == 2
    assert "--request 9" in _err(capsys)
    assert main(["doctor", str(TRACE), "--step", "8", "--request", "1"]) == 0
    assert "1 step checked" in capsys.readouterr().out
    rec = str(RECORDING.with_suffix(""))
    for verb in ("replay", "doctor"):
        assert main([verb, rec, "--step", "99"]) == 2
        assert "--step 99" in (err := _err(capsys)) and "steps 0.." in err
    assert main(["doctor", rec, "--step", "0"]) == 0
    out = capsys.readouterr().out
    assert main(["doctor", rec]) == 0
    assert out.split()[0] != capsys.readouterr().out.split()[0]  # one step's rows, not all
    b = tmp_path / "bug8"
    assert main(["bundle", str(TRACE), "--step", "8", "--request", "1", "-o", str(b)]) == 0
    capsys.readouterr()
    for args in (["replay", str(b), "--step", "3"], ["doctor", str(b), "--request", "5"],
                 ["audit", str(b), "--step", "5"]):
        assert main(args) == 2
        assert "the bundle holds" in (err := _err(capsys)) and "step 8" in err
    assert main(["doctor", str(b), "--step", "8", "--request", "1"]) == 0
    assert main(["doctor", str(tmp_path)]) == 2
    assert "is not a bundle (no bundle.safetensors" in _err(capsys)
    assert main(["replay", str(tmp_path)]) == 2
    assert "is not a bundle" in _err(capsys)


def test_audit_argument_checks(tmp_path, capsys):
    for args, flag in ((["--random", "1", "--draws", "0"], "--draws"), (["--random", "1", "--draws", "1"], "--draws"),
                       (["--random", "1", "--draws", "-5"], "--draws"), (["--random", "0"], "--random"),
                       (["--random", "-1"], "--random"), (["--random", "1", "--vocab", "1"], "--vocab"),
                       (["--random", "1", "--nodes", "1"], "--nodes"),
                       (["--random", "1", "--plot", "/no/such/dir/a.html"], "/no/such/dir"),
                       (["--random", "1", "--plot", str(tmp_path / "a.txt")], "suffix"),
                       (["--random", "1", "--step", "3"], "--random"), (["--random", "1", "--threads", "0"], "--threads")):
        assert main(["audit", *args]) == 2, args
        assert flag in _err(capsys)
    assert not (tmp_path / "a.txt").exists()
    with pytest.raises(ValueError, match="draws"):
        from ddtree_lab import audit as au

        au.audit(au.random_case(0), draws=0)


def test_recordings_open_in_every_verb_and_suffixes_must_match(tmp_path, capsys):
    rec = str(RECORDING.with_suffix(""))
    assert main(["info", rec]) == 0  # one loader: a recording opens like a trace (issue 15)
    assert capsys.readouterr().out.startswith(f"sglang recording {rec}: ")
    first = dl.load(rec).steps[0]
    assert main(["render", rec, "--step", str(first.step), "--request", str(first.request)]) == 0
    assert capsys.readouterr().out.startswith(f"step {first.step} · request {first.request_id} · ")
    png = tmp_path / "x.png"
    assert main(["render", str(TRACE), "--step", "0", "--request", "0", "--format", "svg", "-o", str(png)]) == 2
    assert "suffix" in _err(capsys) and not png.exists()
    assert main(["doctor", str(TRACE), "--sample", "0"]) == 2
    assert "--sample 0" in _err(capsys)
    assert main(["lab", "--port", "-1", "--dry-run"]) == 2
    assert "--port -1" in _err(capsys)
    assert main(["lab", "--port", "65536", "--dry-run"]) == 2
    capsys.readouterr()


def test_readme_sglang_convert_example_passes_o():
    lines = [x for x in (ROOT / "README.md").read_text().splitlines() if x.startswith("ddtree-lab sglang convert")]
    assert lines and all(" -o " in x for x in lines)
    for x in lines:
        build_parser().parse_args(x.split()[1:])
