"""Analysis of recorded runs: statistics of what a run did (:mod:`.stats`) and the tuner's
re-analysis under other parameters (:mod:`.tuner`). Pure functions of Steps."""

from .stats import LooksGreedy as LooksGreedy
from .stats import OFFERED_DEFINITION as OFFERED_DEFINITION
from .stats import acceptance_by_depth as acceptance_by_depth
from .stats import accepted_sibling_ranks as accepted_sibling_ranks
from .stats import drafter_estimate as drafter_estimate
from .stats import expected_accept_length as expected_accept_length
from .stats import looks_greedy as looks_greedy
from .stats import reach_probabilities as reach_probabilities
from .stats import setting_label as setting_label
from .stats import sibling_conditioned_quality as sibling_conditioned_quality
from .stats import sibling_ranks as sibling_ranks
from .stats import step_seconds as step_seconds
from .stats import step_table as step_table
from .stats import tau as tau
from .stats import throughput as throughput
from .policies import POLICIES as POLICIES
from .tuner import TunerData as TunerData
from .tuner import TunerResult as TunerResult
from .tuner import token_prob_bounds as token_prob_bounds
