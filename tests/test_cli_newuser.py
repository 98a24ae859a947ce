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
    def load(spec):
        raise cli.CLIError(f"MODEL LOADED ({spec})")

    monkeypatch.setattr(cli.common, "load_model", load)


@pytest.mark.parametrize("budget", ["100000", "0", "-3"])
def test_record_budget_is_one_rule_checked_before_the_model(budget, no_model, tmp_path, capsys):
    assert main(["record", "--prompt", "hi", "--budget", budget, "-o", str(tmp_path / "t.safetensors")]) == 2
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
                 "-o", str(tmp_path / "t.safetensors")]) == 2
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
        main(["record", "--prompt", "hi", "--quiet", "-o", str(tmp_path / "t.safetensors")])
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
    capsys.readouterr()


def test_counts_have_their_nouns_in_the_right_number(capsys):
    assert cli.common.count(1, "step") == "1 step" and cli.common.count(0, "problem") == "0 problems"
    assert main(["replay", TRACE, "--step", "1", "--request", "0"]) == 0
    out = capsys.readouterr().out
    assert "1 step replayed" in out and "1 steps" not in out
