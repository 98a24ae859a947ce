"""Views of recorded steps: one view model, rendered many ways.

A :class:`ddtree_lab.step.Step` is lowered once to a :class:`StepView`
(:mod:`ddtree_lab.views.model`: nodes, labelled probabilities, decision rows, the bonus draw,
the walk events and a decision cursor (:mod:`ddtree_lab.views.cursor`), ``to_dict()``);
everything else renders that:

* :mod:`ddtree_lab.views.dot` -- the picture: :func:`to_dot`, :func:`step_svg`, :func:`svg_size`;
* :mod:`ddtree_lab.views.text` -- :func:`to_text` (the tree), :func:`decisions_text`;
* :mod:`ddtree_lab.views.html` -- :func:`decisions_table_html`, :func:`children_html`,
  :func:`mass_bar_svg`, :func:`bonus_html`, :func:`committed_html`;
* :mod:`ddtree_lab.views.pick` -- :func:`informative_step`, the step a view opens on;
* :mod:`ddtree_lab.views.stepper` -- the verify stepper widget (:class:`VerifyStepper`);
* :mod:`ddtree_lab.views.compare` -- greedy against sampling: plotly figures over a batch's
  steps (tau, calibration, acceptance and sibling rank by depth, drafter quality, tokens/s);
* :mod:`ddtree_lab.views.tuner` -- the top-k / top-p / budget tuner widget (:class:`Tuner`,
  :func:`expected_tau_text`) over :class:`ddtree_lab.analysis.TunerData`;
* :mod:`ddtree_lab.views.engine` -- a real engine's recordings side by side: the per-position
  parameters vLLM's sampler applied against the request's (a plotly figure), each run's
  generated texts, a diagnosis as HTML tables.

Views read traces only; no view touches a model.
"""

from .dot import render_svg as render_svg
from .dot import step_svg as step_svg
from .dot import svg_size as svg_size
from .dot import to_dot as to_dot
from .html import bonus_html as bonus_html
from .html import children_html as children_html
from .html import committed_html as committed_html
from .html import decisions_table_html as decisions_table_html
from .html import mass_bar_svg as mass_bar_svg
from .model import BonusView as BonusView
from .model import Cursor as Cursor
from .model import DecisionRow as DecisionRow
from .nodes import NodeView as NodeView
from .model import StepView as StepView
from .model import step_view as step_view
from ..labels import shared_text_ids as shared_text_ids
from ..labels import token_label as token_label
from .model import walk_events as walk_events
from .pick import informative_step as informative_step
from .text import decisions_markdown as decisions_markdown
from .text import decisions_text as decisions_text
from .text import to_text as to_text

__all__ = ["StepView", "NodeView", "DecisionRow", "BonusView", "Cursor", "step_view", "walk_events", "token_label",
           "shared_text_ids",
           "to_dot", "step_svg", "render_svg", "svg_size", "to_text", "decisions_text", "decisions_table_html",
           "children_html", "mass_bar_svg", "bonus_html", "committed_html", "informative_step"]
from .stepper import VerifyStepper as VerifyStepper
from .stepper import WhatIf as WhatIf
from .stepper import what_if as what_if

__all__ += ["VerifyStepper", "WhatIf", "what_if"]
