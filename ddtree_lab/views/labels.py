"""The labels every view prints, under their old address: they live in :mod:`ddtree_lab.labels`
(below io, whose bundles print them too)."""

from ..labels import LOSSY_COLOR as LOSSY_COLOR
from ..labels import lossy_mark as lossy_mark
from ..labels import mass_label as mass_label
from ..labels import number_label as number_label
from ..labels import shared_text_ids as shared_text_ids
from ..labels import token_label as token_label

__all__ = ["token_label", "shared_text_ids", "number_label", "mass_label", "lossy_mark", "LOSSY_COLOR"]
