"""Widget layouts shared by the lab's ipywidgets views (stepper, tuner, policy picker).

Plain dicts, so this module imports no ipywidgets: pass them as ``layout=`` and ``style=``.

A slider in an ``HBox`` beside a long note or another control is shrunk by the flex row until
only its description and readout are left: the track is 0 px wide, a mouse drag cannot move it
(issue 34.2). :func:`slider_kwargs` gives a slider a fixed width that never shrinks
(``flex: 0 0 auto`` and ``min_width`` = its width), with a description column of its own, so
its track keeps ``width - description_width - readout`` pixels. :func:`note_layout` lets a
note beside controls take the room left and wrap in it instead of squeezing them.
"""

from __future__ import annotations

__all__ = ["slider_kwargs", "note_layout", "wrap_row", "track_px", "READOUT_PX"]

#: the room a slider's readout and the gaps around its track take (ipywidgets 8: a 64 px readout
#: plus margins), for :func:`track_px`.
READOUT_PX = 80


def _px(width: str) -> int:
    if not width.endswith("px"):
        raise ValueError(f"a width in px is needed, got {width!r}")
    return int(float(width[:-2]))


def slider_kwargs(width: str = "420px", description_width: str = "90px") -> dict:
    """``layout`` and ``style`` keyword arguments for a slider that keeps its track: ``width``
    fixed (it neither grows nor shrinks in a flex row), ``description_width`` for its label.

    Raises:
        ValueError: widths not in px, or no room left for a track of at least 100 px.
    """
    track = _px(width) - _px(description_width) - READOUT_PX
    if track < 100:
        raise ValueError(f"a {width} slider with a {description_width} description leaves a {track} px track "
                         "(at least 100 px)")
    return {"layout": {"width": width, "min_width": width, "flex": "0 0 auto"},
            "style": {"description_width": description_width}}


def track_px(kwargs: dict) -> int:
    """The track width in px a slider made with ``kwargs`` (:func:`slider_kwargs`) keeps."""
    return _px(kwargs["layout"]["width"]) - _px(kwargs["style"]["description_width"]) - READOUT_PX


def note_layout(basis: str = "260px") -> dict:
    """The layout of an HTML note beside controls in a :func:`wrap_row`: it takes the room left
    and wraps its text there; with less than ``basis`` left it goes to the next line (a note
    squeezed to a few px would cut its words)."""
    return {"flex": f"1 1 {basis}", "min_width": "0"}


def wrap_row() -> dict:
    """The layout of an ``HBox`` of controls: in a column narrower than the controls together
    they wrap onto the next line instead of running past the right edge (where they are cut)."""
    return {"flex_flow": "row wrap"}
