"""Ctrl-C in a long verb (issue 34, item 5): one line on standard error, exit status 130, and
no output written half (each is written to a temporary name and renamed at the end)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddtree_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"


def visible_lines(err: str) -> list[str]:
    """The lines a terminal shows for ``err``: a progress bar redraws its line with ``\\r``
    (only the text after the last one stays), and blank lines are dropped."""
    return [line.rsplit("\r", 1)[-1].strip() for line in err.split("\n") if line.rsplit("\r", 1)[-1].strip()]


def no_partial(directory: Path) -> list[Path]:
    """Temporary files a write left behind in ``directory``."""
    return [p for p in directory.rglob("*") if ".partial" in p.name]


def test_diagnose_sigint_while_loading_the_model_prints_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DDTREE_LAB_THREADS": "1", "DDTREE_LAB_PROGRESS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "ddtree_lab.cli", "diagnose", str(TRACE), "--model", "default"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    err = bytearray()

    def read():
        assert p.stderr is not None
        while chunk := p.stderr.read1(4096):  # type: ignore[attr-defined]
            err.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 120  # bars on (stderr is a pipe): diagnose's bar says it works
    while b"check/s" not in err and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.poll() is None, f"diagnose ended before it was interrupted: {bytes(err)!r}"
    p.send_signal(signal.SIGINT)
    p.wait(timeout=60)
    reader.join(timeout=10)  # the reader drains stderr to its end (one reader: no byte read twice or lost)
    text = err.decode()
    assert p.returncode == 130, text[-2000:]
    assert visible_lines(text) == ["ddtree-lab diagnose: interrupted"], text[-2000:]
    assert "Traceback" not in text


def test_render_interrupted_writes_nothing(tmp_path, monkeypatch, capsys):
    import ddtree_lab.views as views

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(views, "render_svg", stop)
    out = tmp_path / "tree.svg"
    assert main(["render", str(TRACE), "--step", "0", "--request", "0", "-o", str(out)]) == 130
    err = visible_lines(capsys.readouterr().err)
    assert err == [f"ddtree-lab render: interrupted; nothing written: -o {out} (not created)"]
    assert not out.exists() and not no_partial(tmp_path)


def test_write_outputs_interrupted_mid_write_leaves_no_file(tmp_path, monkeypatch):
    from ddtree_lab.cli import common

    real = Path.write_bytes
    calls = []

    def write_bytes(self, data):
        calls.append(self)
        if len(calls) == 2:
            real(self, data[:3])  # half the bytes on disk, then Ctrl-C
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    a, b = tmp_path / "a.md", tmp_path / "a-tree.png"
    with pytest.raises(KeyboardInterrupt):
        common.write_outputs({a: b"markdown", b: b"png bytes"})
    assert len(calls) == 2 and not a.exists() and not b.exists() and not list(tmp_path.iterdir())


def test_force_replaced_output_interrupted_is_left_as_it_was(tmp_path, monkeypatch, capsys):
    import ddtree_lab.views as views

    out = tmp_path / "tree.txt"
    out.write_text("old", encoding="utf-8")

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(views, "to_text", stop)
    assert main(["render", str(TRACE), "--step", "0", "--request", "0", "-o", str(out), "--force"]) == 130
    assert visible_lines(capsys.readouterr().err) == [
        f"ddtree-lab render: interrupted; nothing written: -o {out} (left as it was)"]
    assert out.read_text(encoding="utf-8") == "old" and not no_partial(tmp_path)


def test_export_interrupted_leaves_neither_table(tmp_path, monkeypatch, capsys):
    pytest.importorskip("pyarrow")
    import ddtree_lab.io.parquet as parquet

    real = parquet._node_rows
    seen = []

    def node_rows(s, nc):
        seen.append(s)
        if len(seen) == 3:  # some row groups are on disk by now (batch 256 holds them; the writer has opened both)
            raise KeyboardInterrupt
        return real(s, nc)

    monkeypatch.setattr(parquet, "_node_rows", node_rows)
    out = tmp_path / "tables"
    assert main(["export", str(TRACE), "--parquet", str(out)]) == 130
    assert visible_lines(capsys.readouterr().err) == [
        f"ddtree-lab export: interrupted; nothing written: --parquet {out} (not created)"]
    assert not out.exists() and not no_partial(tmp_path)


def test_bundle_interrupted_leaves_no_directory(tmp_path, monkeypatch, capsys):
    import ddtree_lab.io.bundle as bundle

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(bundle, "_readme", stop)  # after bundle.safetensors and tree.svg were written
    out = tmp_path / "b"
    assert main(["bundle", str(TRACE), "--step", "0", "--request", "0", "-o", str(out)]) == 130
    assert visible_lines(capsys.readouterr().err) == [
        f"ddtree-lab bundle: interrupted; nothing written: -o {out} (not created)"]
    assert not out.exists() and not no_partial(tmp_path)


def test_write_container_interrupted_leaves_no_file(tmp_path, monkeypatch):
    import safetensors.torch
    import torch

    from ddtree_lab.store.container import write_container

    def save_file(tensors, path, metadata=None):
        Path(path).write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    with pytest.raises(KeyboardInterrupt):
        write_container(tmp_path / "t.safetensors", {"format": "x"}, {"a": torch.zeros(2)})
    assert not list(tmp_path.iterdir())


def test_policies_parquet_interrupted_leaves_no_file(tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    from ddtree_lab.cli.policies import write_policies_parquet

    def write_table(table, where):
        Path(where).write_bytes(b"PAR1 half")
        raise KeyboardInterrupt

    monkeypatch.setattr(pq, "write_table", write_table)
    with pytest.raises(KeyboardInterrupt):
        write_policies_parquet("run", [], tmp_path / "p.parquet")
    assert not list(tmp_path.iterdir())


def test_report_archive_interrupted_names_what_was_written(tmp_path, monkeypatch, capsys):
    import ddtree_lab.cli.report as report

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(report.zipfile.ZipFile, "writestr", stop)
    md, archive = tmp_path / "r.md", tmp_path / "r.zip"
    assert main(["report", str(TRACE), "--step", "0", "--request", "0", "-o", str(md), "--archive",
                 str(archive)]) == 130
    err = visible_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("ddtree-lab report: interrupted; written whole: ")
    assert str(md) in err[0] and f"not written: --archive {archive} (not created)" in err[0]
    assert md.exists() and not archive.exists() and not no_partial(tmp_path)


def test_interrupted_line_without_outputs():
    from ddtree_lab.cli import interrupted_line

    assert interrupted_line("doctor", [], {}, []) == "ddtree-lab doctor: interrupted"
