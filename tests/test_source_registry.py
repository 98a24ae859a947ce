"""io/'s registry of sources (issue 23): each source detects its own files and no other source
claims them (or the registry's order decides, tested), a new source is one line, and a file no
source reads gets one error naming the path and every registered source."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ddtree_lab as dl
from ddtree_lab.io import SOURCES, load, source_of, sources
from ddtree_lab.io import bundle as bd
from ddtree_lab.io.append_trace import TraceWriter
from ddtree_lab.io.synthetic import SyntheticShape, synthetic_steps
from ddtree_lab.sglang.append import AppendSink
from ddtree_lab.step import Run

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures"
TRACE = FIX / "traces" / "smollm2_t08_b32.ddtrace.safetensors"
RECORDING = FIX / "sglang_cpu_recording.json"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, list[Path]]:
    """Per registered source, files of it: the fixtures, and the files the lab writes."""
    tmp = tmp_path_factory.mktemp("sources")
    run = dl.load(TRACE)
    bundle_dir = bd.save_bundle(bd.make_bundle(run, run.steps[5]), tmp / "bug")
    shape = SyntheticShape(requests=2, budget=6, vocab=300)
    w = TraceWriter(tmp / "live.ddtrace", {"vocab_size": 300})
    w.write_steps(synthetic_steps(shape, 1, 0), {})
    w.close()
    sink = AppendSink(tmp / "sglang.ddrec", {"note": "no call recorded"})
    sink.close()
    return {
        "bundle": [bundle_dir, bundle_dir / "bundle.safetensors"],
        "lab trace": sorted((FIX / "traces").glob("*.ddtrace.safetensors")),
        "lab trace (append-only)": [tmp / "live.ddtrace"],
        "sglang recording (append-only)": [tmp / "sglang.ddrec", tmp / "sglang"],
        "sglang recording": [RECORDING, RECORDING.with_suffix(".safetensors"), RECORDING.with_suffix("")],
        "ddtree reference": sorted((FIX / "ddtree_reference").iterdir()),
        "engine summary": sorted((FIX / "engine_summaries").iterdir()),
        "vllm recording": [d for d in sorted((FIX / "vllm").iterdir())] + sorted((FIX / "vllm").glob("*/*.ddvllm")),
    }


def test_every_registered_source_has_files_here(files):
    assert set(files) == set(SOURCES) == {s.name for s in sources.REGISTRY}
    assert SOURCES == sources.source_names() and len(SOURCES) == len(sources.REGISTRY)


@pytest.mark.parametrize("name", SOURCES)
def test_each_source_claims_its_files_and_no_other_does(files, name):
    for path in files[name]:
        claims = [s.name for s in sources.REGISTRY if s.detect(path)]
        assert claims == [name], (path, claims)
        assert source_of(path) == name
        run = load(path)
        assert run.source == name == run.metadata["source"], path
        assert all(s.source == name for s in run.steps), path


def test_overlaps_are_resolved_by_the_registry_order(tmp_path):
    """A lab trace saved under a ``.pt`` name is claimed by both the lab trace and the DDTree
    reference's detect (any ``.pt`` file); the lab's own format comes first in the registry."""
    pt = tmp_path / "run.pt"
    shutil.copy(TRACE, pt)
    claims = [s.name for s in sources.REGISTRY if s.detect(pt)]
    assert claims == ["lab trace", "ddtree reference"]
    assert SOURCES.index("lab trace") < SOURCES.index("ddtree reference")
    assert source_of(pt) == "lab trace" and len(load(pt).steps) == len(load(TRACE).steps)


def test_a_new_source_is_one_line(tmp_path, monkeypatch):
    toy = tmp_path / "greeting.toy"
    toy.write_text("TOY v1\n")

    def looks_like_toy(path: Path) -> bool:
        return path.is_file() and path.suffix == ".toy" and path.read_text().startswith("TOY ")

    def load_toy(path: Path) -> Run:
        return Run(metadata={"toy_version": path.read_text().split()[1]}, steps=[])

    with pytest.raises(dl.TraceFormatError, match="registered sources: bundle, "):
        load(toy)
    monkeypatch.setattr(sources, "REGISTRY", (*sources.REGISTRY, sources.Source("toy", looks_like_toy, load_toy)))
    assert source_of(toy) == "toy"
    run = load(toy)
    assert run.source == "toy" and run.metadata["toy_version"] == "v1" and run.metadata["path"] == str(toy)
    assert source_of(TRACE) == "lab trace"  # the others are untouched
    (tmp_path / "nothing.bin").write_bytes(b"\x01" * 9)
    with pytest.raises(dl.TraceFormatError, match=r"registered sources: .*engine summary, toy\)"):
        load(tmp_path / "nothing.bin")
    monkeypatch.undo()
    assert "toy" not in sources.source_names()
    with pytest.raises(dl.TraceFormatError):
        source_of(toy)


def test_an_unknown_file_names_the_path_and_every_source(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(dl.TraceFormatError) as e:
        load(junk)
    msg = str(e.value)
    assert msg.startswith(f"{junk}: not a safetensors file (nor JSON)")
    assert msg.endswith("(registered sources: " + ", ".join(SOURCES) + ")")
    weights = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(weights))
    with pytest.raises(dl.TraceFormatError, match="safetensors without ddtree_lab metadata .*drafter weights"):
        source_of(weights)
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(dl.TraceFormatError, match="JSON that is neither"):
        source_of(other)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(dl.TraceFormatError, match="is not a bundle"):
        source_of(empty)
    with pytest.raises(dl.TraceFormatError, match="a directory: give the file itself"):
        source_of(tmp_path)  # it holds other.json
    with pytest.raises(FileNotFoundError, match="no such file"):
        source_of(tmp_path / "missing.safetensors")
