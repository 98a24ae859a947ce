"""A new user's findings (issue 34): what `info` shows, the wording of refused options, the
replay lines of `report`."""

from pathlib import Path

import pytest

import ddtree_lab as dl
from ddtree_lab import cli
from ddtree_lab.cli import main

ROOT = Path(__file__).resolve().parent.parent
SAMPLED = ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the command with a marker: the checks must come first."""
    def load(spec, **kw):
        if spec is None:
            return None
        raise cli.CLIError(f"MODEL LOADED ({spec})")

    monkeypatch.setattr(cli.common, "load_model", load)


def _request_line(out: str, req: int) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"request {req} "))


def test_info_shows_seed_0_and_top_k_1_and_hides_only_off_values(tmp_path, capsys):
    """Item 7: `info` dropped every value equal to 0 or 1.0, so seed 0, seed 1 and top_k 1 vanished."""
    run = dl.load(str(SAMPLED))
    meta = dict(run.metadata)
    reqs = [dict(r) for r in meta["requests"]]
    reqs[0]["params"] = dict(reqs[0]["params"], seed=0, top_k=1, top_p=1.0, min_p=0.0)
    reqs[1]["params"] = dict(reqs[1]["params"], seed=None, top_k=0, top_p=0.9, min_p=None)
    reqs[2]["params"] = dict(reqs[2]["params"], seed=1, top_k=-1, top_p=1.0, min_p=0.05)
    meta["requests"] = reqs
    path = dl.save_trace(dl.Run(meta, run.steps, run.token_texts), tmp_path / "p.ddtrace.safetensors")
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    r0, r1, r2 = (_request_line(out, k) for k in range(3))
    assert "temperature 0.8, top_k 1, seed 0," in r0 and "top_p" not in r0 and "min_p" not in r0, r0
    assert "temperature 0.8, top_p 0.9," in r1 and "seed" not in r1 and "top_k" not in r1, r1
    assert "temperature 0.8, min_p 0.05, seed 1," in r2 and "top_k" not in r2 and "top_p" not in r2, r2


def test_param_is_off_only_for_the_exact_off_values():
    from ddtree_lab.sampling import param_is_off

    assert [param_is_off("top_k", v) for v in (0, -1, 1)] == [True, True, False]
    assert [param_is_off("top_p", v) for v in (1.0, 0.999)] == [True, False]
    assert [param_is_off("min_p", v) for v in (None, 0.0, 0.01)] == [True, True, False]
    assert [param_is_off("seed", v) for v in (None, 0, 1)] == [True, False, False]
    assert not param_is_off("temperature", 0.0) and not param_is_off("temperature", 1.0)
    assert param_is_off("order", "top_k_then_top_p") and not param_is_off("order", "top_p_then_top_k")


@pytest.mark.parametrize("args, want", [
    (["record", "--prompt", "hi", "--seed", "-1"], "--seed -1: must be in [0, "),
    (["record", "--prompt", "hi", "--prompt", ""], '--prompt "" (the 2nd --prompt): empty prompt'),
    (["record", "--prompt", "hi", "--temperature", "inf"], "--temperature inf: temperature must be finite"),
    (["record", "--prompt", "hi", "--budget", "0"], "--budget 0: must be in [1, 65536]"),
    (["compare-policies", str(SAMPLED), "--budgets", "0"], "--budgets 0: must be in [1, 65536]"),
    (["compare-policies", str(SAMPLED), "--budgets", "4,-2"], "--budgets 4,-2: budget -2: must be in [1, 65536]"),
    (["audit", str(SAMPLED), "--step", "4", "--request", "1", "--verifier", "bogus"],
     "--verifier bogus: unknown verifier (reference, torch-lazy, triton, or a planted fault: "),
    (["audit", str(SAMPLED), "--step", "4", "--request", "1", "--temperature", "inf"],
     "--temperature inf: temperature must be finite"),
    (["audit", "--engine", "vllm:onehot", "--engine-fault", "q-other-slot"],
     "--engine-fault q-other-slot: --engine vllm:onehot takes "),
    (["info", str(SAMPLED), "--temperature", "inf"], "--temperature inf: must be a finite number >= 0"),
], ids=lambda x: " ".join(x)[:40] if isinstance(x, list) else None)
def test_a_refused_option_is_named_with_its_value_in_one_line(args, want, tmp_path, capsys, no_model):
    """Item 10: each refusal names its flag and the value given, before any model loads."""
    if args[0] == "record":
        args = args + ["-o", str(tmp_path / "r.ddtrace")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert want in err and len(err.strip().splitlines()) == 1 and "MODEL LOADED" not in err, err


def test_the_seed_rule_is_the_coin_seeds_range(tmp_path, capsys, no_model):
    """--seed S gives request b the coin seed S * 1000 + b, which SamplingParams keeps in [0, 2**63):
    the largest S that fits passes the option checks (the model load comes next), one more is refused."""
    top = (2**63 - 2) // 1000
    out = str(tmp_path / "r.ddtrace")
    assert main(["record", "--prompt", "a", "--prompt", "b", "--seed", str(top), "-o", out]) == 2
    assert "MODEL LOADED" in capsys.readouterr().err
    assert main(["record", "--prompt", "a", "--prompt", "b", "--seed", str(top + 1), "-o", out]) == 2
    assert f"--seed {top + 1}: must be in [0, {top}]" in capsys.readouterr().err


def test_budgets_that_cannot_be_scored_exit_with_the_could_not_check_status(capsys):
    """Item 10: a budget whose tree leaves the recording, without --model, was exit 1 ("a check found
    something") though nothing was checked: now 2, with a line on stderr saying why."""
    assert main(["compare-policies", str(SAMPLED), "--policy", "chain", "--budgets", "64", "--max-steps", "1"]) == 2
    io = capsys.readouterr()
    assert "not scored" in io.out and "1 of 1 row not scored" in io.err and "--model" in io.err
    assert main(["compare-policies", str(SAMPLED), "--policy", "ddtree", "--budgets", "4", "--max-steps", "1"]) == 0


def test_lab_passes_the_token_in_the_environment_not_on_the_command_line(monkeypatch, capsys):
    """Item 14: `--IdentityProvider.token=...` on Jupyter's command line showed the token to every
    local user (`ps`); now it is JUPYTER_TOKEN in Jupyter's environment, the server still on 127.0.0.1."""
    import os

    seen = {}

    def execve(path, argv, env):
        seen.update(path=path, argv=list(argv), env=dict(env))
        raise SystemExit(0)

    monkeypatch.setattr(os, "execve", execve)
    from ddtree_lab.cli import labserver

    monkeypatch.setattr(labserver, "working_copies", lambda labs, work: [])  # .lab/ left alone
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("os.execv: Jupyter started without the token's env"))
    monkeypatch.setenv("DDTREE_LAB_TOKEN", "s3cr3t-token-of-this-test")
    monkeypatch.setenv("JUPYTER_TOKEN_FILE", "/elsewhere")
    jupyter = Path(cli.live.sys.executable).parent / "jupyter"
    if not jupyter.exists():
        pytest.skip("jupyter is not installed in this environment (the 'lab' extra)")
    with pytest.raises(SystemExit):
        main(["lab", "--port", "8890"])
    out = capsys.readouterr().out
    assert seen["argv"] and not any("s3cr3t" in a for a in seen["argv"]), seen["argv"]
    assert "--ip=127.0.0.1" in seen["argv"] and not any("token" in a.lower() for a in seen["argv"])
    assert seen["env"]["JUPYTER_TOKEN"] == "s3cr3t-token-of-this-test" and "JUPYTER_TOKEN_FILE" not in seen["env"]
    assert "token=s3cr3t-token-of-this-test" in out  # the link the user opens still carries it


def test_a_real_jupyter_server_takes_the_token_from_the_environment_and_argv_lacks_it(tmp_path):
    """Item 14, end to end: Jupyter started as `ddtree-lab lab` starts it; /proc/PID/cmdline (what
    `ps` shows every user) lacks the token, and the server accepts the token and refuses without it."""
    import secrets
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    from ddtree_lab.cli import labserver

    jupyter = Path(sys.executable).parent / "jupyter"
    if not jupyter.exists():
        pytest.skip("jupyter is not installed in this environment (the 'lab' extra)")
    token, port = secrets.token_hex(16), labserver.free_port(18888)
    cmd = labserver.jupyter_command(str(jupyter), port, tmp_path, as_root=os_is_root())
    proc = subprocess.Popen(cmd, env=labserver.jupyter_env(token), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{port}/api/status"
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}?token={token}", timeout=2).read()
                break
            except urllib.error.HTTPError:
                raise
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "jupyter did not start"
                time.sleep(0.5)
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert argv and not any(token.encode() in a for a in argv), argv
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=5).read()
        assert refused.value.code == 403
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def os_is_root() -> bool:
    import os

    return hasattr(os, "geteuid") and os.geteuid() == 0


def test_report_heading_names_the_request_id_only_when_it_says_more_than_the_index(capsys):
    """Item 9: the heading read "request 1 (`1`)"; an engine's own id (e.g. SGLang's) still shows."""
    import dataclasses

    from ddtree_lab.cli.report import report_markdown

    assert main(["report", str(SAMPLED), "--step", "4", "--request", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "# DDTree verify step 4, request 1"
    run = dl.load(str(SAMPLED))
    step = dataclasses.replace(next(s for s in run.steps if (s.step, s.request) == (4, 1)), request_id="req-7f3a")
    text = report_markdown(run, step, SAMPLED.name, None, "none", None, [], [])
    assert text.splitlines()[0] == "# DDTree verify step 4, request 1 (`req-7f3a`)"


def test_report_replay_lines_name_the_file_not_the_reporters_path(capsys):
    """Item 9: without --archive the replay line pointed at the reporter's absolute path."""
    assert main(["report", str(SAMPLED), "--step", "4", "--request", "1"]) == 0
    text = capsys.readouterr().out
    block = text.split("## Replay", 1)[1]
    assert str(SAMPLED.parent) not in text, block
    assert f"ddtree-lab replay {SAMPLED.name} --step 4 --request 1" in block
    assert f"# in the folder holding {SAMPLED.name} (the reporter's lab trace: attach it, or make the report " \
           "with --archive" in block


def test_info_decodes_runs_of_byte_tokens_together(tmp_path, capsys):
    """Item 11: `info` showed `<0xCE><0x95>λληνικ` for "Ελληνικ": the generated text joins the
    tokens' bytes (ddtree_lab.texts.join_texts); a byte that forms no character stays <0xNN>."""
    from types import SimpleNamespace

    from ddtree_lab.cli.steps import generated_text

    run = SimpleNamespace(token_texts={1: "<0xCE>", 2: "<0x95>", 3: "λληνικ", 4: "<0xE3>"})
    assert generated_text(run, [1, 2, 3]) == '"Ελληνικ"'
    assert generated_text(run, [3, 4]) == '"λληνικ<0xE3>"'
    # end to end: a trace whose first generated tokens are the two bytes of "Ε"
    trace = ROOT / "fixtures" / "traces" / "smollm2_greedy_b32.ddtrace.safetensors"
    run = dl.load(str(trace))
    meta = dict(run.metadata)
    reqs = [dict(r) for r in meta["requests"]]
    ids = reqs[0]["generated_token_ids"]
    a, b = [t for t in sorted(run.token_texts) if t not in ids][:2]  # two ids request 0 does not generate
    reqs[0]["generated_token_ids"] = [a, b] + ids[2:]
    meta["requests"] = reqs
    texts = dict(run.token_texts)
    texts.update({a: "<0xCE>", b: "<0x95>"})
    path = dl.save_trace(dl.Run(meta, run.steps, texts), tmp_path / "g.ddtrace.safetensors")
    assert main(["info", str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  generated ("))
    assert '): "Ε' in line and "<0x" not in line, line
