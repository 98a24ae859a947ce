"""The vLLM recorder's files as a source of :func:`ddtree_lab.io.load` (:mod:`ddtree_lab.vllm.recording`).

A directory holding ``vllm-pid{P}.ddvllm`` files (and ``requests.json`` when ``ddtree-lab vllm
record`` made it), or one such file. Detection reads the first segment's header only.
"""

from __future__ import annotations

from pathlib import Path

from ..step import Run

__all__ = ["looks_like_vllm_recording", "load_vllm_recording_run"]


def looks_like_vllm_recording(path: str | Path) -> bool:
    """Whether ``path`` is a vLLM recording (:func:`ddtree_lab.vllm.recording.looks_like_vllm_recording`)."""
    from ..vllm.recording import looks_like_vllm_recording as looks

    return looks(path)


def load_vllm_recording_run(path: str | Path) -> Run:
    """:func:`ddtree_lab.vllm.recording.load_vllm_run` of ``path``."""
    from ..vllm.recording import load_vllm_run

    return load_vllm_run(path)
