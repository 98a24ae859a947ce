"""A bug report one command away (issue 26.7): `report` (Markdown with the tree's picture, the
decision table, the diagnosis, the environment and the replay command; --archive with a
bundle), `render --format decisions-md`, and `info` showing each request's generated text."""

import json
import re
import tarfile
import zipfile
from pathlib import Path

import ddtree_lab as dl
from ddtree_lab.cli import main
from ddtree_lab.views import decisions_markdown, step_view

ROOT = Path(__file__).resolve().parent.parent
SAMPLED = str(ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors")
GREEDY = str(ROOT / "fixtures" / "traces" / "smollm2_greedy_b32.ddtrace.safetensors")


def _md_rows(text: str, first_cell: str) -> list[list[str]]:
    """The rows of the Markdown table whose header starts with ``| first_cell |`` (cells split on
    unescaped pipes)."""
    lines = text.splitlines()
    start = next(k for k, x in enumerate(lines) if x.startswith(f"| {first_cell} |"))
    assert re.fullmatch(r"\|(---\|)+", lines[start + 1]), lines[start + 1]
    rows = []
    for x in lines[start + 2:]:
        if not x.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", x)[1:-1]])
    return rows


def test_decisions_markdown_is_a_table_with_the_recorded_decisions(capsys, tmp_path):
    run = dl.load(SAMPLED)
    step = run.find_step(4, 1)
    text = decisions_markdown(step_view(step, run, False))
    rows = _md_rows(text, "#")
    assert len(rows) == len(step.decisions)
    for row, d in zip(rows, step.decisions):
        assert int(row[3]) == d.node and int(row[2]) == d.parent and row[-1] == d.verdict
        assert abs(float(row[5]) - d.target_prob) <= 1e-3 * max(d.target_prob, 1e-9) + 1e-12
    assert "bonus" in text.splitlines()[-1]
    assert main(["render", SAMPLED, "--step", "4", "--request", "1", "--format", "decisions-md"]) == 0
    assert capsys.readouterr().out == text
    out = tmp_path / "d.md"
    assert main(["render", SAMPLED, "--step", "4", "--request", "1", "-o", str(out)]) == 0  # .md: the Markdown table
    assert out.read_text() == text
    assert main(["render", SAMPLED, "--step", "4", "--request", "1", "--format", "decisions-md",
                 "-o", str(tmp_path / "d.txt")]) == 2
    assert "suffix" in capsys.readouterr().err


def test_a_token_with_a_pipe_or_backticks_stays_one_cell():
    from ddtree_lab.views.text import _code_span, _md_cell

    cell = _md_cell(_code_span("'a|`b'"))
    assert cell == "``'a\\|`b'``" and len(re.split(r"(?<!\\)\|", f"| {cell} |")) == 3


def test_report_writes_markdown_pictures_and_an_archive_with_a_bundle(tmp_path, capsys, monkeypatch):
    out = tmp_path / "bug.md"
    archive = tmp_path / "bug.tar.gz"
    assert main(["report", SAMPLED, "--step", "4", "--request", "1", "-o", str(out), "--archive", str(archive)]) == 0
    capsys.readouterr()
    text = out.read_text()
    run = dl.load(SAMPLED)
    step = run.find_step(4, 1)
    # the picture: referenced, beside the Markdown, a real PNG (and the SVG)
    found = re.search(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert found is not None, text
    pic = found.group(1)
    assert pic == "bug-tree.png" and (tmp_path / pic).read_bytes()[:4] == b"\x89PNG"
    assert "<svg" in (tmp_path / "bug-tree.svg").read_text()
    # the decision table, as render --format decisions-md gives it
    assert decisions_markdown(step_view(step, run, False)).rstrip() in text
    # the diagnosis: every check listed with whether it ran (a check that could not run says so)
    checks = {r[0]: r for r in _md_rows(text, "check")}
    assert {"record", "verifier", "coins", "tree-forward"} <= set(checks)
    assert checks["tree-forward"][1] == "no" and "needs the model" in checks["tree-forward"][3]
    assert checks["record"][1] == "yes" and "`check` on the step: 0 problems." in text
    # the environment, here and as recorded
    env = {r[0]: r for r in _md_rows(text, "")}
    import torch

    from ddtree_lab.version import __version__

    assert env["ddtree-lab"][1] == __version__

    assert env["torch"][1] == torch.__version__ and env["torch"][2] == run.metadata["versions"]["torch"]
    # the exact replay command, and it works for the reader: the trace by its name, not the reporter's
    # path (issue 34.9), run in a folder that holds the trace
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    name = Path(SAMPLED).name
    assert str(Path(SAMPLED).parent) not in text and f"From `{name}` (lab trace)" in text
    replay = next(x for x in block if x.startswith("ddtree-lab replay ") and "bundle/" not in x)
    assert replay == f"ddtree-lab replay {name} --step 4 --request 1"
    assert any(x.startswith("# ") and name in x for x in block[:block.index(replay)])  # says they need the file
    monkeypatch.chdir(Path(SAMPLED).parent)
    assert main(replay.split()[1:]) == 0 and "bit for bit" in capsys.readouterr().out
    # the archive: the same files in one folder, and a bundle that replays
    with tarfile.open(archive) as t:
        names = t.getnames()
        assert {"report-step4-request1/bug.md", "report-step4-request1/bug-tree.png",
                "report-step4-request1/bundle/bundle.safetensors"} <= set(names)
        t.extractall(tmp_path / "unpacked", filter="data")
    folder = tmp_path / "unpacked" / "report-step4-request1"
    assert (folder / "bug.md").read_text() == text
    assert main(["replay", str(folder / "bundle")]) == 0 and "bit for bit" in capsys.readouterr().out


def test_report_to_stdout_and_to_a_zip(tmp_path, capsys):
    assert main(["report", GREEDY, "--step", "8", "--request", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# DDTree verify step 8, request 1") and "No picture: pass -o FILE.md" in text
    assert "## Decisions" in text and "## Environment" in text and "## Replay" in text
    archive = tmp_path / "r.zip"
    assert main(["report", GREEDY, "--step", "8", "--request", "1", "--archive", str(archive)]) == 0
    with zipfile.ZipFile(archive) as z:
        names = set(z.namelist())
        assert "report-step8-request1/report.md" in names and "report-step8-request1/report-tree.png" in names
        md = z.read("report-step8-request1/report.md").decode()
    assert "](report-tree.png)" in md and "ddtree-lab replay bundle/" in md
    capsys.readouterr()
    assert main(["report", GREEDY, "--step", "8", "--request", "1", "--archive", str(tmp_path / "r.rar")]) == 2
    assert "--archive" in capsys.readouterr().err and not (tmp_path / "r.rar").exists()


def test_info_shows_each_requests_generated_text(capsys):
    assert main(["info", GREEDY]) == 0
    out = capsys.readouterr().out
    run = dl.load(GREEDY)
    for r in run.metadata["requests"]:
        ids = r["generated_token_ids"]
        text = "".join(run.text(t) for t in ids)
        shown = json.dumps(text if len(text) <= 100 else text[:97] + "...", ensure_ascii=False)
        assert f"  generated ({len(ids)} tokens): {shown}" in out


def test_info_shows_ids_where_no_text_is_recorded():
    from ddtree_lab.cli.steps import generated_text

    run = dl.load(GREEDY)
    run.token_texts = {k: v for k, v in run.token_texts.items() if k != 504}
    line = generated_text(run, [504, 6376])
    assert line == "ids [504, 6376] (no text recorded for 1 token: token ids shown)"
