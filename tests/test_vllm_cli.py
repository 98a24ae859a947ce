"""`ddtree-lab vllm record / serve`: bad input refused in one line before the engine starts (no vLLM
needed: these fail before the engine's venv is looked for)."""

import socket

import pytest

from ddtree_lab.cli import main


@pytest.mark.parametrize("line, want", [
    ('{"prompt": "hi", "seed": "abc"}', "line 1: SamplingParams: seed must be an int"),
    ('{"prompt": "hi", "temperature": -1}', "temperature must be finite and >= 0"),
    ('{"prompt": "hi", "top_k": "x"}', "top_k must be an int"),
    ('{"prompt": "hi", "top_p": 0}', "top_p"),
    ('{"prompt": "hi", "max_new_tokens": 100000}', '"max_new_tokens" must be an integer in [1, 1024)'),
    ('{"prompt": "hi", "max_new_tokens": 0}', '"max_new_tokens" must be an integer'),
    ('{"prompt": "hi", "temprature": 1}', "unknown key(s) ['temprature']"),
    ("[1, 2]", "is not a JSON object (list)"),
    ('{"prompt": 42}', '"prompt" must be a non-empty string, got 42'),
    ("not json", "line 1 is not JSON"),
    ("", "no prompts"),
])
def test_a_bad_prompts_file_is_refused_before_the_engine_starts(line, want, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DDTREE_LAB_VLLM_VENV", str(tmp_path / "no-venv"))  # were the file accepted: this error
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(line + "\n")
    assert main(["vllm", "record", "--prompts", str(prompts), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert want in err and len(err.strip().splitlines()) == 1 and "vLLM's venv" not in err, err
    assert not (tmp_path / "out").exists()


def test_serve_refuses_a_port_out_of_range_or_taken(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DDTREE_LAB_VLLM_VENV", str(tmp_path / "no-venv"))
    for port in ("0", "70000"):
        assert main(["vllm", "serve", "--port", port, "-o", str(tmp_path / "a")]) == 2
        assert "must be in [1, 65535]" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["vllm", "serve", "--port", str(port), "-o", str(tmp_path / "b")]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_a_damaged_vllm_recording_file_is_named(tmp_path, capsys):
    (tmp_path / "vllm-pid1.ddvllm").write_bytes(b"\x00garbage" * 1000)
    assert main(["info", str(tmp_path)]) == 2
    assert "vllm-pid1.ddvllm is not one" in capsys.readouterr().err
