"""Read the JSON / JSONL documents of the outside sources (reference traces, engine summaries).

A ``.jsonl`` file is one JSON value per non-blank line (returned as a list); any other file is
one JSON document. Nothing here validates a record: the adapters do.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_json_document", "first_json_record", "json_format"]


def read_json_document(path: str | Path):
    """The JSON document of ``path`` (a ``.jsonl`` file: the list of its lines' values).

    Raises:
        ValueError: not JSON (naming the file and, for JSONL, the line).
        OSError: the file cannot be read.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not text (JSON expected)") from None
    if path.suffix.lower() == ".jsonl":
        out = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {lineno} is not JSON ({e.msg})") from None
        return out
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None


def first_json_record(path: str | Path):
    """The first record of a JSON / JSONL file for telling sources apart: a JSONL file's first
    line, a JSON list's first item, else the document; None when the file is not JSON."""
    path = Path(path)
    try:
        if path.suffix.lower() == ".jsonl":
            with path.open() as f:
                for line in f:
                    if line.strip():
                        return json.loads(line)
            return None
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if isinstance(doc, list):
        return doc[0] if doc else None
    return doc


def json_format(path: str | Path) -> str | None:
    """The ``"format"`` of a JSON document whose top level is an object (the lab's and the SGLang
    recorder's JSON files name their format there), or None: not JSON, not an object, or no
    format."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    fmt = doc.get("format") if isinstance(doc, dict) else None
    return fmt if isinstance(fmt, str) else None
