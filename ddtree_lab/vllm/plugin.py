"""vLLM's plugin entry point for the lab's recorder (``vllm.general_plugins``, pyproject.toml).

vLLM calls :func:`register` in every engine process it starts (offline ``vllm.LLM`` and
``vllm serve`` alike) before the model runner is built. It does nothing unless
``DDTREE_LAB_VLLM_RECORD`` is set (:mod:`ddtree_lab.vllm.recorder`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .recorder import VLLMRecorder

_installed: "VLLMRecorder | bool | None" = None  # None: not yet asked; False: off (or failed)


def register() -> None:
    """Install the recorder once per process when ``DDTREE_LAB_VLLM_RECORD`` is set; a failure
    to install is one line on stderr, and the engine serves without recording."""
    global _installed
    if _installed is not None:
        return
    try:
        from .recorder import install_from_env

        _installed = install_from_env() or False
    except Exception as exc:  # the engine must start whatever the recorder does
        _installed = False
        print(f"[ddtree-lab vllm recorder] not installed ({type(exc).__name__}: {exc}): the engine serves "
              "without recording", file=sys.stderr, flush=True)


def installed() -> "VLLMRecorder | None":
    """The recorder this process runs (a :class:`~ddtree_lab.vllm.recorder.VLLMRecorder`), or None."""
    return _installed if not isinstance(_installed, bool) and _installed is not None else None
