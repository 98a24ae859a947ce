"""Text of the numbers and tokens every view (and a bundle's README) prints: token labels with visible whitespace, raw
bytes as escapes and the token id beside any text that could be taken for another token's, one
number format, masses never shown above 1, the lossy mark."""

from __future__ import annotations

import unicodedata
from typing import Callable, Iterable

from .texts import BYTE_ESCAPE

__all__ = ["token_label", "shared_text_ids", "number_label", "mass_label", "lossy_mark", "LOSSY_COLOR"]

#: the colour of a lossy step's mark (DOT label, HTML table header).
LOSSY_COLOR = "#c00000"

_VISIBLE = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"}
_MARKS = set(_VISIBLE.values())


def _shown(text: str) -> tuple[str, bool]:
    """``text`` made visible, and whether it could be taken for another text: it holds an
    escape (a control character, a raw byte ``<0xNN>``), U+FFFD (a decoder's stand-in for bytes
    it could not decode, in recordings made before the bytes were kept), a literal whitespace
    mark or backslash (so ``'␣'`` and ``'\\x1b'`` the texts differ from a space and ESC), or nothing."""
    out, unclear = [], not text or bool(BYTE_ESCAPE.search(text))
    for ch in text:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs"):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")
            unclear = True
        else:
            out.append(ch)
            unclear = unclear or ch in _MARKS or ch in "\\\ufffd"
    return "".join(out), unclear


def token_label(text: str, token_id: int | None = None, *, shared: bool = False) -> str:
    """A token's text as every view shows it: quoted, spaces ``␣``, newlines ``⏎``, tabs
    ``⇥``, carriage returns ``␍``, other control characters ``\\xNN`` / ``\\uNNNN``, raw bytes
    as recorded (``<0xE3>``: a piece of a UTF-8 character), so a label never holds an invisible
    or line-breaking character; then `` id N`` (``token_id``) wherever the text alone is
    ambiguous: it holds an escape, a raw byte, U+FFFD (older recordings kept a byte token's
    text as the decoder's ``'�'``), a literal whitespace mark or backslash, or nothing, or
    ``shared`` is set (another token of the same view has the same text:
    :func:`shared_text_ids`).

    Examples: ``token_label(" the")`` is ``'␣the'``; ``token_label("<0xE3>", 7365)`` is
    ``'<0xE3>' id 7365``; ``token_label("\\ufffd", 237)`` is ``'�' id 237``.
    """
    shown, unclear = _shown(text)
    label = "'" + shown + "'"
    return f"{label} id {int(token_id)}" if token_id is not None and (unclear or shared) else label


def shared_text_ids(token_ids: Iterable[int], text: Callable[[int], str]) -> set[int]:
    """The ids among ``token_ids`` whose shown text (:func:`token_label` without the id) is also
    another id's: the tokens of one view whose labels need their id."""
    by_label: dict[str, set[int]] = {}
    for t in {int(t) for t in token_ids}:
        by_label.setdefault(_shown(text(t))[0], set()).add(t)
    return {t for ids in by_label.values() if len(ids) > 1 for t in ids}


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
