"""Verify stage: the one walk, the rules, and the reference, torch-lazy and Triton backends.

* :mod:`.types` -- the records (:class:`Decision`, :class:`BonusDraw`, :class:`VerifyOutput`, ...);
* :mod:`.walk` -- the one walk over the retrieve buffers, as events;
* :mod:`.rules` -- the greedy and target-only rules (the module docstring states them);
* :mod:`.reference` -- the reference verifiers over full rows, and the input checks;
* :mod:`.lazy`, :mod:`.triton` -- the other backends; :mod:`.backends` picks one;
* :mod:`.whatif` -- re-walks of one request from a trace's child probabilities.
"""

from .backends import BACKENDS as BACKENDS
from .backends import select_backend as select_backend
from .backends import verify_tree as verify_tree
from .backends import verify_tree_greedy as verify_tree_greedy
from .lazy import lazy_row_probs as lazy_row_probs
from .reference import validate_coins as validate_coins
from .reference import check_thresholds as check_thresholds
from .reference import check_verify_input as check_verify_input
from .reference import draw_coins as draw_coins
from .reference import make_generators as make_generators
from .reference import verify_greedy as verify_greedy
from .reference import verify_sampled as verify_sampled
from .reference import walk_sampled_batch as walk_sampled_batch
from .rules import GreedyRule as GreedyRule
from .rules import SampledRule as SampledRule
from .rules import accepts as accepts
from .rules import SGLANG_MIN_THRESHOLD_ACC as SGLANG_MIN_THRESHOLD_ACC
from .rules import residual_draw as residual_draw
from .rules import sglang_accepts as sglang_accepts
from .triton import KERNEL_ORDER as KERNEL_ORDER
from .triton import PROB_ATOL as PROB_ATOL
from .triton import PROB_RTOL as PROB_RTOL
from .triton import greedy_launcher as greedy_launcher
from .triton import launch_options as launch_options
from .triton import sampled_launcher as sampled_launcher
from .types import BonusDraw as BonusDraw
from .types import Decision as Decision
from .types import UndrawnBonus as UndrawnBonus
from .types import VerifyOutput as VerifyOutput
from .types import WalkEvent as WalkEvent
from .types import events_of as events_of
from .types import is_lossy as is_lossy
from .walking import walk as walk
from .walking import walk_batch as walk_batch
from .whatif import CHILDREN_COVER_TOL as CHILDREN_COVER_TOL
from .whatif import acceptance_probabilities as acceptance_probabilities
from .whatif import walk_request as walk_request
