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
