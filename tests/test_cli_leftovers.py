"""A new user's leftovers (issue 34.15): no progress bars in a log, the tree legend's dashed
edges, a cut-short safetensors file named as such, a DDTree reference dump's token texts."""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_lab.cli import common

ROOT = Path(__file__).resolve().parent.parent
SAMPLED = ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"


def test_no_progress_bar_when_standard_error_is_not_a_terminal(monkeypatch):
    """15b: a bar's \\r and escape codes went into `2>log`; off where standard error is not a terminal."""
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    assert common.bars_off()
    with common.progress(3, "work") as bar:
        bar.update(3)
    assert log.getvalue() == ""
    common.quiet_libraries()  # transformers' "Loading weights" bar reads this switch
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


@pytest.mark.slow
def test_a_model_loading_verb_writes_no_bar_into_a_log(tmp_path):
    """15b end to end: `compare-policies ... --model default 2>log` leaves no \\r or escape code in log."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    with open(tmp_path / "log", "w") as log:
        subprocess.run([sys.executable, "-m", "ddtree_lab.cli", "compare-policies", str(SAMPLED), "--model", "default",
                        "--policy", "chain", "--budgets", "4", "--max-steps", "1"], stdout=subprocess.DEVNULL,
                       stderr=log, env=env, cwd=tmp_path, check=True)
    text = (tmp_path / "log").read_text()
    assert "\r" not in text and "\x1b" not in text and "%|" not in text, text


def test_the_legend_names_every_edge_style():
    """15c: the red dashed edges (rejected) were drawn but missing from the legend."""
    import ddtree_lab as dl
    from ddtree_lab.views import dot

    assert "style=dashed" in dot.EDGE_STYLE["rejected"] and "red dashed: rejected" in dot.EDGE_LEGEND
    assert "green: accepted" in dot.EDGE_LEGEND and "dotted" in dot.EDGE_LEGEND
    run = dl.load(str(SAMPLED))
    text = dl.views.to_dot(dl.views.step_view(run.steps[4], run))
    assert "style=dashed" in text and "\\nedges: green: accepted · red dashed: rejected" in text


def test_a_safetensors_trace_cut_short_is_named_as_cut_not_as_another_format(tmp_path, capsys):
    """Issue 34.15d: a trace cut short is one (a safetensors file missing its end), said in one line
    with the bytes its header declares against the bytes there are; safetensors' own words are not
    shown. A file that is not safetensors at all is still called that."""
    from ddtree_lab.cli import main

    src = Path(__file__).resolve().parent.parent / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"
    for size, want in ((200_000, "the file ends"), (src.stat().st_size - 10, "10 missing")):
        cut = tmp_path / f"cut{size}.ddtrace.safetensors"
        cut.write_bytes(src.read_bytes()[:size])
        assert main(["info", str(cut)]) == 2
        err = capsys.readouterr().err
        assert "a safetensors file cut short" in err and want in err and "deserializ" not in err.lower(), err
        assert len(err.strip().splitlines()) == 1
    junk = tmp_path / "junk.ddtrace.safetensors"
    junk.write_bytes(b"hello, not a trace at all")
    assert main(["info", str(junk)]) == 2
    assert "not a safetensors file" in capsys.readouterr().err
