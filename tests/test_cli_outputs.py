"""Nothing a user has is replaced without --force (issue 26.1), in every verb that writes.

The parser is walked, so a new verb (or a new output option) cannot forget: every option that
writes is made by ``cli._output`` (``action.writes``), its verb has ``--force``, and each one has
a case here that shows an existing output refused (exit 2, the path and --force named, the bytes
untouched) and replaced with --force."""

import argparse
import re
from pathlib import Path

import pytest

from ddtree_lab import cli
from ddtree_lab.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
TRACE = str(ROOT / "fixtures" / "traces" / "smollm2_greedy_b32.ddtrace.safetensors")
SAMPLED = str(ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors")
RECORDING = str(ROOT / "fixtures" / "sglang_cpu_recording.json")
OLD = b"what the user had before\n"

#: option names and help words that mean "this option names something the verb writes"
OUTPUT_NAMES = {"-o", "--out", "--output", "--parquet", "--plot", "--archive"}
WRITES_WORDS = re.compile(r"\b(write|writes|output file|directory to write)\b", re.I)


def _parsers(parser=None, prefix=()):
    """(verb path, parser) of every verb and sub-verb."""
    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,), sub
                yield from _parsers(sub, prefix + (name,))


def _writing_options():
    found = []
    for verb, p in _parsers():
        for a in p._actions:
            looks = bool(OUTPUT_NAMES & set(a.option_strings)) or bool(WRITES_WORDS.search(a.help or ""))
            if a.option_strings and (getattr(a, "writes", False) or looks):
                found.append((" ".join(verb), a.dest, p, a))
    return found


#: verb -> dest -> (command with OUT in it, "file" or the names a directory output holds)
CASES = {
    ("record", "out"): (["record", "--prompt", "hi", "-o", "OUT.ddtrace"], "file"),
    ("render", "out"): (["render", TRACE, "--step", "1", "--request", "0", "-o", "OUT.svg"], "file"),
    ("bundle", "out"): (["bundle", SAMPLED, "--step", "27", "--request", "1", "-o", "OUT"], ("bundle.safetensors",)),
    ("audit", "plot"): (["audit", SAMPLED, "--step", "27", "--request", "1", "--draws", "100", "--plot", "OUT.html"],
                        "file"),
    ("sglang convert", "out"): (["sglang", "convert", RECORDING, "-o", "OUT.ddtrace.safetensors"], "file"),
    ("export", "parquet"): (["export", TRACE, "--parquet", "OUT"], ("steps.parquet", "nodes.parquet")),
    ("compare-policies", "parquet"): (["compare-policies", SAMPLED, "--policy", "ddtree", "--budgets", "4",
                                       "--max-steps", "1", "--parquet", "OUT.parquet"], "file"),
    ("report", "out"): (["report", SAMPLED, "--step", "4", "--request", "1", "-o", "OUT.md"], "file"),
    ("report", "archive"): (["report", SAMPLED, "--step", "4", "--request", "1", "--archive", "OUT.tar.gz"], "file"),
    ("vllm record", "out"): (["vllm", "record", "--prompts", str(ROOT / "fixtures" / "prompts" / "vllm_greedy.jsonl"),
                              "-o", "OUT"], ("requests.json", "engine.log", "vllm-pid1.ddvllm")),
    ("vllm serve", "out"): (["vllm", "serve", "-o", "OUT"], ("vllm-pid1.ddvllm",)),
}


def test_every_option_that_writes_is_made_by_the_one_helper_and_has_force_and_a_case():
    found = _writing_options()
    assert len(found) >= 8
    for verb, dest, p, a in found:
        assert getattr(a, "writes", False), f"`{verb} {a.option_strings[0]}` writes but is not made by cli._output"
        assert any("--force" in x.option_strings for x in p._actions), f"`{verb}` writes and has no --force"
        assert (verb, dest) in CASES, f"`{verb} {a.option_strings[0]}`: add a case to CASES in this file"
        assert p.get_default("_reads"), f"`{verb}` writes but names no input made by cli._input (issue 34.3)"
    assert {(v, d) for v, d, _, _ in found} == set(CASES)


@pytest.fixture
def no_model(monkeypatch):
    def load(spec, **kw):
        if spec is None:  # no --model: nothing to load
            return None
        raise cli.CLIError(f"MODEL LOADED ({spec})")

    monkeypatch.setattr(cli.common, "load_model", load)


@pytest.mark.parametrize("case", sorted(CASES), ids=lambda c: f"{c[0]}-{c[1]}")
def test_an_existing_output_is_refused_and_replaced_only_with_force(case, tmp_path, capsys, no_model, monkeypatch):
    monkeypatch.setenv("DDTREE_LAB_VLLM_VENV", str(tmp_path / "no-vllm-venv"))
    command, kind = CASES[case]
    out = None
    args = []
    for word in command:
        if word.startswith("OUT"):
            out = tmp_path / ("out" + word[3:])
            word = str(out)
        args.append(word)
    assert out is not None
    if kind == "file":
        out.write_bytes(OLD)
        olds = [out]
    else:
        out.mkdir()
        olds = [out / name for name in kind]
        for f in olds:
            f.write_bytes(OLD)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--force" in err and str(olds[0]) in err and len(err.strip().splitlines()) == 1, err
    assert all(f.read_bytes() == OLD for f in olds)  # nothing touched
    rc = main(args + ["--force"])
    err = capsys.readouterr().err
    if case[0] == "record":  # the checks passed and the model would load next (the fast loop loads none)
        assert rc == 2 and "MODEL LOADED" in err, err
        return
    if case[0].startswith("vllm"):  # the checks passed and the engine would start next (no venv here)
        assert rc == 2 and "vLLM's venv" in err, err
        return
    assert rc == 0, err
    assert all(f.exists() and f.read_bytes() != OLD for f in olds), err


def test_output_paths_are_checked_before_anything_loads(tmp_path, capsys, no_model):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    for args, want in (
            (["record", "--prompt", "hi", "-o", str(afile / "r.ddtrace")], "is a file, not a directory"),
            (["record", "--prompt", "hi", "-o", str(tmp_path / "no" / "r.ddtrace")], "does not exist"),
            (["render", TRACE, "--step", "1", "--request", "0", "-o", str(tmp_path / "no" / "t.svg")], "does not exist"),
            (["export", TRACE, "--parquet", str(afile)], "is a file"),
            (["bundle", SAMPLED, "--step", "27", "--request", "1", "-o", str(tmp_path / "no" / "b")], "does not exist")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert want in err and "MODEL LOADED" not in err, (args, err)


def test_an_unwritable_directory_is_named(tmp_path, capsys, monkeypatch, no_model):
    import os

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == tmp_path else real(p, mode))
    assert main(["render", TRACE, "--step", "1", "--request", "0", "-o", str(tmp_path / "t.svg")]) == 2
    assert f"directory {tmp_path} is not writable" in capsys.readouterr().err
    assert not (tmp_path / "t.svg").exists()


def test_a_directory_that_refuses_files_is_named_before_the_model_loads(tmp_path, capsys, monkeypatch, no_model):
    """As root, os.access says every directory is writable (/sys, a read-only mount): the check
    makes and removes a file there, so `record -o` is refused before the model loads."""
    import tempfile

    real = tempfile.TemporaryFile

    def refuse(*a, dir=None, **kw):
        if dir is not None and Path(dir) == tmp_path:
            raise PermissionError(13, "Permission denied")
        return real(*a, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    assert main(["record", "--prompt", "hi", "-o", str(tmp_path / "r.ddtrace.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"directory {tmp_path} is not writable (Permission denied)" in err and "MODEL LOADED" not in err, err


@pytest.mark.parametrize("case", sorted(CASES), ids=lambda c: f"{c[0]}-{c[1]}")
def test_no_verb_writes_onto_its_own_input_even_with_force(case, tmp_path, capsys, no_model):
    """Issue 34.3: each case's input is its own output (the source argument, record's --prompts):
    refused with one line naming the flag and the input, --force or not, the bytes untouched."""
    command, kind = CASES[case]
    out = tmp_path / ("out" + next(w for w in command if w.startswith("OUT"))[3:])
    if kind == "file":
        out.write_bytes(OLD)
        olds = [out]
    else:
        out.mkdir()
        olds = [out / name for name in kind]
        for f in olds:
            f.write_bytes(OLD)
    args = [str(out) if w.startswith("OUT") or w in (TRACE, SAMPLED, RECORDING) else w for w in command]
    if case[0] == "record":
        args[args.index("--prompt"):args.index("--prompt") + 2] = ["--prompts", str(out)]
    if case[0] == "vllm record":  # the prompts file inside the output directory
        args[args.index("--prompts") + 1] = str(olds[0])
    if case[0] == "vllm serve":  # the model directory as the output directory
        args += ["--model", str(out)]
    flag = command[command.index(next(w for w in command if w.startswith("OUT"))) - 1]
    for extra in ([], ["--force"]):
        assert main(args + extra) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"{flag} {out}" in err and "own input" in err, err
        assert "MODEL LOADED" not in err
        assert all(f.read_bytes() == OLD for f in olds)


def test_sglang_convert_refuses_the_recordings_sibling_file_relative_or_through_a_link(tmp_path, capsys,
                                                                                       monkeypatch):
    """Issue 34.3, as found: `sglang convert NAME -o NAME.safetensors --force` overwrote its own
    input (a recording given as NAME is NAME.json + NAME.safetensors)."""
    src = Path(RECORDING).with_suffix("")
    for suffix in (".json", ".safetensors"):
        (tmp_path / f"rec{suffix}").write_bytes(src.with_suffix(suffix).read_bytes())
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "rec.safetensors")
    (tmp_path / "sub").mkdir()
    before = {p.name: p.read_bytes() for p in tmp_path.glob("rec.*")}
    monkeypatch.chdir(tmp_path / "sub")
    for rec, out in (("../rec", "../rec.safetensors"), ("../rec.json", "../rec.safetensors"),
                     (str(tmp_path / "rec.safetensors"), "../rec.json"), ("../rec", str(tmp_path / "link.safetensors")),
                     ("../rec.json", "./../rec.json")):
        assert main(["sglang", "convert", rec, "-o", out, "--force"]) == 2
        err = capsys.readouterr().err
        assert f"-o {out}: is the verb's own input RECORDING {rec}" in err and "--force or not" in err, err
    assert {p.name: p.read_bytes() for p in tmp_path.glob("rec.*")} == before
    assert main(["sglang", "convert", "../rec", "-o", "../rec.ddtrace.safetensors"]) == 0  # another name is fine
