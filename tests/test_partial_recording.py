"""A lab append-only trace cut short (Ctrl-C, kill -9): every verb words it as a stopped process,
not a hang (issue 34, item 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_lab.cli import main
from ddtree_lab.io import load


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rec")
    out = d / "whole.ddtrace"
    assert main(["record", "--prompt", "Write a long story about a dragon.", "--budget", "4", "--max-new-tokens", "6",
                 "--quiet", "-o", str(out)]) == 0
    return out


def cut(whole: Path, name: str, keep) -> Path:
    """A copy of ``whole`` up to the end of the last segment ``keep(entry)`` accepts (as kill -9 leaves it)."""
    lines = [json.loads(x) for x in Path(str(whole) + ".index").read_text().splitlines()]
    last = max(i for i, e in enumerate(lines) if keep(i, e))
    end = lines[last + 1]["o"]  # where the next segment starts
    out = whole.with_name(name)
    out.write_bytes(whole.read_bytes()[:end])
    return out


@pytest.fixture(scope="module")
def pending(recorded) -> Path:
    lines = [json.loads(x) for x in Path(str(recorded) + ".index").read_text().splitlines()]
    last_inputs = max(i for i, e in enumerate(lines) if e["k"] == "inputs")
    return cut(recorded, "pending.ddtrace", lambda i, e: i == last_inputs)


def test_step_that_did_not_finish_is_not_called_a_hang(pending):
    run = load(pending)
    stopped = [s for s in run.steps if s.output is None]
    assert len(stopped) == 1
    why = stopped[0].extra["why"]
    assert why == "did not finish: the process stopped (interrupt, kill or crash) before its verifier returned"
    assert "hang" not in why


def test_kill_warning_is_a_whole_sentence(pending):
    run = load(pending)
    (note,) = [p for p in run.problems if "not closed" in p]
    assert note.endswith("records written before it stopped are read"), note
    assert "(killed?)" not in note and not note.endswith("before load")


def test_info_same_format_partial_one_extra_line(recorded, pending, capsys):
    main(["info", str(recorded)])
    whole = capsys.readouterr().out.splitlines()
    main(["info", str(pending)])
    part = capsys.readouterr().out.splitlines()
    extra = [x for x in part if x.startswith("partial: ")]
    assert len(extra) == 1 and "did not finish: the process stopped" in extra[0] and "no end segment" in extra[0]
    assert [x.split()[0] for x in part if not x.startswith("partial: ")] == [x.split()[0] for x in whole]
    assert not any("hang" in x or "problem" in x or "not recorded" in x for x in part)


def test_render_names_the_stopped_process_not_the_level(pending, capsys):
    run = load(pending)
    s = next(s for s in run.steps if s.output is None)
    assert main(["render", str(pending), "--step", str(s.step), "--request", str(s.request)]) == 2
    err = capsys.readouterr().err
    assert "did not finish: the process stopped" in err and "recorded at level" not in err


def test_doctor_names_every_problem(pending, capsys):
    assert main(["doctor", str(pending)]) == 1
    out = capsys.readouterr().out.splitlines()
    named = [x for x in out if x.startswith("problem: ")]
    n = int(out[-1].split(", ")[1].split()[0])
    assert n == len(named) >= 1 and "not closed" in named[0]


def test_replay_counts_add_up(pending, capsys):
    assert main(["replay", str(pending)]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if " with the reference verifier: " in x)
    total = int(line.split()[0])
    same = int(line.split(": ")[1].split()[0])
    differ = int(line.split(", ")[1].split()[0])
    left = int(line.split(", ")[2].split()[0])
    assert (same, differ, left) == (total - 1, 0, 1) and same + differ + left == total, line
    assert "1 not replayable (1 did not finish)" in line
