"""Text of the numbers and tokens every view prints: token labels with visible whitespace, one
number format, masses never shown above 1, the lossy mark."""

from __future__ import annotations

import unicodedata

__all__ = ["token_label", "number_label", "mass_label", "lossy_mark", "LOSSY_COLOR"]

#: the colour of a lossy step's mark (DOT label, HTML table header).
LOSSY_COLOR = "#c00000"

_VISIBLE = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"}


def token_label(text: str) -> str:
    """A token's text made visible and quoted: spaces '␣', newlines '⏎', tabs '⇥', carriage
    returns '␍', other control characters as ``\\xNN`` / ``\\uNNNN`` (so a label never holds
    an invisible or line-breaking character)."""
    out = []
    for ch in text:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "'" + "".join(out) + "'"


def number_label(x: float | None, digits: int = 4, missing: str = "-") -> str:
    """``x`` with ``digits`` significant digits, but never rounded to a bare 0 or 1 that it is
    not (0.99999994 prints in full); ``missing`` for None. The one number format of every view."""
    if x is None:
        return missing
    text = f"{x:.{digits}g}"
    return f"{x:.9g}" if text in ("0", "1") and x not in (0.0, 1.0) else text


def mass_label(x: float | None, digits: int = 4, missing: str = "-") -> str:
    """A probability mass (``S_k``, a residual mass) as text, never shown above 1.

    Masses are float64 sums of float32 probabilities; the rounding of each entry can put a
    whole row's sum a little above 1 (e.g. 1.0000071 over 49,152 tokens). Such a sum prints as
    ``"1 (float32 rounding: sum 1+7.1e-06)"``; masses in [0, 1] print as :func:`number_label`."""
    if x is None:
        return missing
    if x > 1.0:
        return f"1 (float32 rounding: sum 1+{x - 1:.2g})"
    return number_label(x, digits, missing)


def lossy_mark(thresholds: tuple[float, float]) -> str:
    """``"LOSSY: threshold_single=0.9, threshold_acc=0.5"``: the thresholds that break
    exactness (``threshold_single < 1``, ``threshold_acc != 1``; :func:`ddtree_lab.verify.is_lossy`)."""
    single, acc = thresholds
    parts = ([f"threshold_single={single:g}"] if single < 1.0 else []) + ([f"threshold_acc={acc:g}"] if acc != 1.0 else [])
    return "LOSSY: " + ", ".join(parts)
