from pathlib import Path

from ddtree_lab.cli import main

TRACE = Path(__file__).resolve().parent.parent / "fixtures" / "traces" / "smollm2_greedy_b32.ddtrace.safetensors"


def test_cli_info_replay_render(tmp_path, capsys):
    assert main(["info", str(TRACE)]) == 0
    assert "SmolLM2-135M-Instruct" in capsys.readouterr().out
    assert main(["replay", str(TRACE)]) == 0
    assert "replayed bit for bit" in capsys.readouterr().out
    out = tmp_path / "s.svg"
    assert main(["render", str(TRACE), "--step", "0", "--out", str(out)]) == 0
    assert "<svg" in out.read_text()
    assert main(["render", str(TRACE), "--step", "0", "--format", "text"]) == 0
    assert "◆ [0]" in capsys.readouterr().out


def test_cli_bad_input(tmp_path, capsys):
    assert main(["render", str(TRACE), "--step", "9999"]) == 2
    assert "out of range" in capsys.readouterr().err
    bad = tmp_path / "bad.safetensors"
    bad.write_text("not a trace")
    assert main(["info", str(bad)]) == 2
    assert "not a safetensors file" in capsys.readouterr().err
