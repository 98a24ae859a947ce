"""The losslessness audit: cases, the exact law, verifiers run over many coin sets, planted
faults, and the report (G-tests against the exact law). :mod:`.report` states the method."""

from .case import AuditCase as AuditCase
from .case import case_from_logits as case_from_logits
from .case import case_from_step as case_from_step
from .case import plant_duplicate_sibling as plant_duplicate_sibling
from .case import random_case as random_case
from .case import step_logits as step_logits
from .faults import PLANTED_FAULTS as PLANTED_FAULTS
from .faults import planted_fault as planted_fault
from .law import ExactLaw as ExactLaw
from .law import exact_law as exact_law
from .report import AuditReport as AuditReport
from .report import Cell as Cell
from .report import FitResult as FitResult
from .report import audit as audit
from .report import fit_counts as fit_counts
from .report import resolve_verifier as resolve_verifier
from .report import run_verifier as run_verifier
from .verifiers import Verifier as Verifier
from .verifiers import plain_sample as plain_sample
from .verifiers import target_probs_topp_first as target_probs_topp_first
from .thresholds import threshold_distance as threshold_distance
from .thresholds import threshold_law as threshold_law
