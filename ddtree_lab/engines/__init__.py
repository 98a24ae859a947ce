"""Engine adapters: the serving engines' own verify code (vLLM's rejection sampler, SGLang's
kernels) as lab verifiers, judged by :func:`ddtree_lab.audit.audit` against the exact law.

``ddtree_lab.engines.vllm`` runs vLLM in its own venv through a worker process
(``scripts/setup_vllm.sh``); ``ddtree_lab.engines.sglang`` runs SGLang's kernels in this
process. Shared pieces (chain cases, the real-draft law, the planted fault, :func:`audit_engine`)
are in ``ddtree_lab.engines.common``. Importing this package imports neither engine.
"""

from .common import (DRAFT_MODES, ENGINE_FAULTS, audit_engine, chain_case, check_chain, drafter_probs,
                     random_chain_case, real_draft_case)

__all__ = ["DRAFT_MODES", "ENGINE_FAULTS", "audit_engine", "chain_case", "check_chain", "drafter_probs",
           "random_chain_case", "real_draft_case"]
