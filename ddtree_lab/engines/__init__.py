"""Engine adapters: the serving engines' own verify code (vLLM's rejection sampler, SGLang's
kernels) as lab verifiers, judged by :func:`ddtree_lab.audit.audit` against the exact law.

``ddtree_lab.engines.vllm`` runs vLLM in its own venv through a worker process
(``scripts/setup_vllm.sh``); ``ddtree_lab.engines.sglang`` runs SGLang's kernels in this
process. Shared pieces (chain cases, the real-draft law, the planted fault, :func:`audit_engine`)
are in ``ddtree_lab.engines.common``. Importing this package imports neither engine.
"""

from .common import (DRAFT_MODES, ENGINE_FAULTS, audit_engine, chain_case, check_chain, drafter_probs,
                     random_chain_case, real_draft_case)

__all__ = ["ENGINES", "Engine", "open_engine", "DRAFT_MODES", "ENGINE_FAULTS", "audit_engine", "chain_case", "check_chain", "drafter_probs",
           "random_chain_case", "real_draft_case"]

ENGINES = ("vllm", "sglang")


class Engine:
    """An opened engine: ``make`` is the ``make_verifier`` factory :func:`audit_engine` takes;
    :meth:`close` stops what it started (vLLM's worker)."""

    def __init__(self, name: str, make, closer=None, about: str = ""):
        self.name, self.make, self._closer, self.about = name, make, closer, about

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
            self._closer = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_engine(name: str, fault: str | None = None, kernel: str = "auto") -> Engine:
    """Open ``"vllm"`` (starts its worker in the vLLM venv) or ``"sglang"`` (``kernel``: one of
    :data:`ddtree_lab.engines.sglang.KERNELS`), with an optional planted ``fault``.

    Raises:
        ValueError: unknown engine or fault.
        RuntimeError: the engine cannot run here (the reason: no vLLM venv, sglang missing).
    """
    if fault is not None and fault not in ENGINE_FAULTS:
        raise ValueError(f"unknown engine fault {fault!r}; known: {', '.join(ENGINE_FAULTS)}")
    if name == "vllm":
        from . import vllm

        worker = vllm.VLLMWorker()
        return Engine(name, vllm.verifier(worker, fault), worker.close,
                      f"vllm {worker.version} ({worker.route}; worker import {worker.import_seconds} s)")
    if name == "sglang":
        from . import sglang

        why = sglang.sglang_unavailable_reason(kernel)
        if why is not None:
            raise RuntimeError(f"SGLang's kernels cannot run here: {why}")
        return Engine(name, sglang.verifier(kernel, fault), None, f"sglang kernel {kernel}")
    raise ValueError(f"engine must be one of {ENGINES}, got {name!r}")
