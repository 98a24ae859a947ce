"""ddtree-lab: a bench for DDTree speculative decoding.

The public surface, stage by stage (draft -> tree -> buffers -> target -> verify -> trace;
terms in the README, "Terms"):

* draft top-k -> tree: :func:`draft_topk_from_logits`, :func:`build_tree`
  (:func:`build_tree_reference` is the per-request heap), :class:`DDTreeBuildResult`;
* tree -> verify buffers: :func:`compile_retrieve`, :class:`DDTreeVerifyInput`,
  :func:`encode_retrieve`, :func:`decode_retrieve`, :func:`check_retrieve`; the validator
  :func:`find_retrieve_problems` (giving :class:`Problem` s) and
  :func:`check_verify_buffers` (run by every verifier unless ``validate=False``);
* target logits -> target distribution: :class:`SamplingParams`, :func:`target_probs`;
* verification: :func:`verify_greedy`, :func:`verify_sampled`, :class:`VerifyOutput`,
  :func:`draw_coins`, :func:`make_generators`; the one walk as events (:class:`WalkEvent`,
  :func:`events_of`), what-if analyses (:func:`walk_request`, :func:`acceptance_probabilities`,
  :class:`UndrawnBonus`), :func:`is_lossy`;
* live decoding and traces: :class:`LiveSession` (``ddtree_lab.models`` holds the target
  adapter, ``ddtree_lab.models`` also the drafters), :class:`StepTrace`, :class:`RunTrace`,
  :func:`save_trace`, :func:`load_trace`, :func:`replay`, :func:`make_step_trace` (the one
  StepTrace constructor), :func:`compare_outputs` (the one output comparator, giving
  :class:`Difference` s); bug-report bundles of one step in ``ddtree_lab.io.bundle``;
* diagnosis of a recorded step or run, three views of one package (``ddtree_lab.diagnosis``),
  each broken invariant a :class:`Problem`: :func:`check` (a step's fast invariants),
  :func:`doctor` (those on chosen steps, and with the model a step's rows against causal
  forwards), :func:`diagnose` (the bug named, not the symptom); planted faults for the zoo and
  the tests in ``ddtree_lab.faults``;
* views: ``ddtree_lab.views`` (DOT/SVG/text/HTML) and ``ddtree_lab.notebook`` (the notebooks' calls);
* SGLang interop (package :mod:`ddtree_lab.sglang`; sglang itself is imported only to run
  its kernels): :func:`to_sglang_buffers`,
  :func:`from_sglang_buffers`, :class:`SGLangVerifyBuffers`, :class:`TreeMaskMode`,
  :func:`verify_output_from_sglang`, :func:`verify_output_to_sglang`,
  :class:`SGLangRecorder`, :func:`load_recording`, :func:`replay_recording`;
* verification from raw logits with a chosen backend (reference, torch-lazy, Triton):
  :func:`verify_tree`, :func:`verify_tree_greedy`, :func:`select_backend`.
"""

from .buffers import DDTreeVerifyInput as DDTreeVerifyInput
from .buffers import RetrieveError as RetrieveError
from .buffers import check_retrieve as check_retrieve
from .buffers import check_verify_buffers as check_verify_buffers
from .buffers import compile_retrieve as compile_retrieve
from .buffers import decode_retrieve as decode_retrieve
from .buffers import encode_retrieve as encode_retrieve
from .buffers import find_retrieve_problem as find_retrieve_problem
from .buffers import find_retrieve_problems as find_retrieve_problems
from .buffers import tree_attention_mask as tree_attention_mask
from .sampling import SamplingParams as SamplingParams
from .sampling import greedy_params as greedy_params
from .sampling import normalize_params as normalize_params
from .sampling import target_probs as target_probs
from .sglang import SGLangRecorder as SGLangRecorder
from .sglang import SGLangVerifyBuffers as SGLangVerifyBuffers
from .sglang import TreeMaskMode as TreeMaskMode
from .sglang import from_sglang_buffers as from_sglang_buffers
from .sglang import load_recording as load_recording
from .sglang import replay_recording as replay_recording
from .sglang import to_sglang_buffers as to_sglang_buffers
from .sglang import verify_output_from_sglang as verify_output_from_sglang
from .sglang import verify_output_to_sglang as verify_output_to_sglang
from .build import DDTreeBuildResult as DDTreeBuildResult
from .build import build_tree as build_tree
from .build import build_tree_reference as build_tree_reference
from .draft import check_draft_topk as check_draft_topk
from .draft import draft_topk_from_logits as draft_topk_from_logits
from .replaying import Difference as Difference
from .replaying import ReplayMismatch as ReplayMismatch
from .step import Run as Run
from .step import Step as Step
from .step import TargetRows as TargetRows
from .step import DraftTopK as DraftTopK
from .io import load as load
from .io import source_of as source_of
from .problems import Problem as Problem
from .io.lab_trace import TraceFormatError as TraceFormatError
from .replaying import compare_outputs as compare_outputs
from .io import load_trace as load_trace
from .replaying import replay as replay
from .replaying import replay_differences as replay_differences
from .io.lab_trace import save_trace as save_trace
from .verify import BonusDraw as BonusDraw
from .verify import Decision as Decision
from .verify import UndrawnBonus as UndrawnBonus
from .verify import VerifyOutput as VerifyOutput
from .verify import WalkEvent as WalkEvent
from .verify import acceptance_probabilities as acceptance_probabilities
from .verify import events_of as events_of
from .verify import is_lossy as is_lossy
from .verify import walk_request as walk_request
from .verify import draw_coins as draw_coins
from .verify import make_generators as make_generators
from .verify import verify_greedy as verify_greedy
from .verify import verify_sampled as verify_sampled
from .verify import select_backend as select_backend
from .verify import verify_tree as verify_tree
from .verify import verify_tree_greedy as verify_tree_greedy

from .session import LiveSession as LiveSession
from .diagnosis import check as check
from .diagnosis import diagnose as diagnose
from .diagnosis import doctor as doctor

from .version import __version__ as __version__



def _hand_over_drawing() -> None:
    """Bundles draw their step; io sits below the views, so the front door hands the drawing over."""
    from .io import bundle
    from .views import step_svg

    bundle.draw_step = step_svg


_hand_over_drawing()


#: Names the record had before it was made of the stage objects, and the two problem classes
#: before they were one (:class:`Problem`): still importable from the package's front door
#: (with a DeprecationWarning), used nowhere inside the library.
_DEPRECATED = {
    "StepTrace": ("ddtree_lab.step", "Step"),
    "RunTrace": ("ddtree_lab.step", "Run"),
    "make_step_trace": ("ddtree_lab.record", "make_step_trace"),
    "RetrieveProblem": ("ddtree_lab.problems", "Problem"),
    "StepProblem": ("ddtree_lab.problems", "Problem"),
}


def __getattr__(name: str):
    if name in _DEPRECATED:
        import importlib
        import warnings

        module, new = _DEPRECATED[name]
        warnings.warn(f"ddtree_lab.{name} is deprecated: use {module}.{new}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), new)
    raise AttributeError(f"module 'ddtree_lab' has no attribute {name!r}")
