"""The vLLM recorder's files as a source of :func:`ddtree_lab.io.load` (:mod:`ddtree_lab.vllm.recording`).

A directory holding ``vllm-pid{P}.ddvllm`` files (and ``requests.json`` when ``ddtree-lab vllm
record`` made it), or one such file. Detection reads the first segment's header only.
"""

from __future__ import annotations

from pathlib import Path

from ..replaying import ENGINE_REPLAYS
from ..step import Run, Step

__all__ = ["looks_like_vllm_recording", "load_vllm_recording_run"]


def _replay(step: Step):
    """:func:`ddtree_lab.vllm.replay.replay_differences` (vLLM's draws replayed from its noise)."""
    from ..vllm.replay import replay_differences

    return replay_differences(step)


# registered where every load() passes (this module is a source), so a bundle made from a vLLM
# step replays with vLLM's draws too
ENGINE_REPLAYS["vllm"] = _replay


def looks_like_vllm_recording(path: str | Path) -> bool:
    """Whether ``path`` is a vLLM recording (:func:`ddtree_lab.vllm.recording.looks_like_vllm_recording`)."""
    from ..vllm.recording import looks_like_vllm_recording as looks

    return looks(path)


def load_vllm_recording_run(path: str | Path) -> Run:
    """:func:`ddtree_lab.vllm.recording.load_vllm_run` of ``path``."""
    from ..vllm.recording import load_vllm_run

    return load_vllm_run(path)
