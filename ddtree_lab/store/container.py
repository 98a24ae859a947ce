"""The checksummed file container of trace files and bundles (one safetensors file + one JSON document).

One safetensors file whose metadata key ``"ddtree_lab"`` holds one JSON document; the document
records a SHA-256, dtype and shape for every tensor and a SHA-256 of itself, so a corrupted or
truncated file is refused with one line naming the field. Loading reads tensors and JSON only:
no code from the file is ever executed (no pickle).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import torch

from .checksums import tensor_sha256

__all__ = ["TraceFormatError", "tensor_sha256", "write_container", "read_container", "safetensors_metadata",
           "container_format"]

_DTYPE_NAMES = {torch.int64: "int64", torch.float32: "float32", torch.float64: "float64"}


class TraceFormatError(ValueError):
    """A trace or bundle file that is not one, is corrupted, or has a missing or bad field."""



def _field_of(key: str) -> str:
    step, _, name = key.partition(".")
    return f"step {step}: field {name!r}" if name and step.isdigit() else f"field {key!r}"


def safetensors_metadata(path: str | Path) -> dict[str, str] | None:
    """The metadata of a safetensors file (its header only: no tensor is read), ``{}`` when it
    has none, or None when ``path`` is not a readable safetensors file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception:  # not a safetensors file (safetensors raises its own error types)
        return None


def safetensors_damage(path: str | Path) -> str | None:
    """Why a file that begins like a safetensors file does not open as one, in words (a file cut
    short: the bytes its header declares against the bytes there are), or None when it does not
    begin like one (an 8-byte little-endian header length, then a JSON header). Reads the header only."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None
            n = int.from_bytes(head, "little")
            if not 2 <= n <= 100_000_000:
                return None
            first = f.read(1)
            if first != b"{":
                return None
            if 8 + n > size:
                return (f"a safetensors file cut short: its header declares {n} bytes, the file ends "
                        f"{8 + n - size} bytes before the header does ({size} bytes in all)")
            header = json.loads(first + f.read(n - 1))
    except (OSError, ValueError):
        return None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
            and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2]
    need = 8 + n + (max(ends) if ends else 0)
    if need > size:
        return (f"a safetensors file cut short: its tensors need {need} bytes, the file has {size} "
                f"({need - size} missing)")
    return "a damaged safetensors file (its header reads, its tensors do not)"


def container_format(path: str | Path) -> str | None:
    """The ``format`` of the file's ``"ddtree_lab"`` document (:func:`write_container`; header
    only), ``""`` when that document is damaged or names no format (the reader names the
    problem), None when ``path`` is not a safetensors file with a ``"ddtree_lab"`` document."""
    meta = safetensors_metadata(path)
    if meta is None or "ddtree_lab" not in meta:
        return None
    try:
        doc = json.loads(meta["ddtree_lab"])
    except ValueError:
        return ""
    fmt = doc.get("format") if isinstance(doc, dict) else None
    return fmt if isinstance(fmt, str) else ""


def write_container(path: str | Path, doc: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``tensors`` and the JSON ``doc`` (plus each tensor's dtype, shape and SHA-256, and
    the document's own SHA-256) to one safetensors file. Creates no directory.

    Raises:
        FileNotFoundError: the parent directory of ``path`` does not exist.
        IsADirectoryError: ``path`` is a directory.
        OSError: the file cannot be written (naming ``path``).
    """
    from safetensors.torch import save_file

    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory (give a file name, e.g. {path / 'run.ddtrace.safetensors'})")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: directory {path.parent} does not exist (nothing is created for you)")
    doc = dict(doc)
    doc["tensors"] = {k: {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "sha256": tensor_sha256(t)}
                      for k, t in tensors.items()}
    text = json.dumps(doc)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")  # renamed at the end: never a half-written file
    try:
        try:
            save_file(tensors, str(tmp), metadata={"ddtree_lab": text,
                                                   "ddtree_lab_sha256": hashlib.sha256(text.encode()).hexdigest()})
        except OSError:
            raise
        except Exception as exc:  # safetensors raises its own error types (e.g. SafetensorError)
            raise OSError(f"{path}: cannot write ({exc})") from exc
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # safetensors creates the file 0600; a file to hand over is readable as usual
        os.replace(tmp, path)
    except BaseException:  # an error or Ctrl-C: the temporary file goes, ``path`` is as it was
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_container(path: str | Path, fmt: str, versions: Sequence[int], what: str = "trace",
                   damaged: dict | None = None) -> tuple[dict, dict]:
    """Read a file written by :func:`write_container`: ``(doc, tensors)``, every checksum,
    dtype and shape checked against the document before a tensor is returned.

    ``damaged``: a dict to collect tensor-level problems in (missing, wrong dtype / shape, or
    a failing checksum: ``{key: message}``, the tensor left out) instead of raising, so a
    reader can keep every undamaged step. The document itself must be intact either way.

    Raises:
        FileNotFoundError: no such file.
        IsADirectoryError: ``path`` is a directory.
        TraceFormatError: not a safetensors file, not a ddtree-lab ``fmt`` file, an unknown
            version, or a corrupted / inconsistent document or tensor (one line naming file,
            step and field).
    """
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory, not a {what} file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        f = safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types
        damage = safetensors_damage(path)
        raise TraceFormatError(f"{path}: {damage}" if damage else f"{path}: not a safetensors file") from exc
    with f:
        meta = f.metadata() or {}
        if "ddtree_lab" not in meta:
            raise TraceFormatError(f"{path}: no 'ddtree_lab' metadata: not a ddtree-lab {what}")
        text = meta["ddtree_lab"]
        want = meta.get("ddtree_lab_sha256")
        if want is not None and hashlib.sha256(text.encode()).hexdigest() != want:
            raise TraceFormatError(f"{path}: the JSON document fails its checksum: the file is corrupted")
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{path}: {what} metadata is not valid JSON ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("format") != fmt:
            raise TraceFormatError(f"{path}: format {doc.get('format') if isinstance(doc, dict) else None!r} "
                                   f"is not {fmt!r}")
        if doc.get("version") not in versions:
            raise TraceFormatError(f"{path}: {what} version {doc.get('version')!r}; this ddtree-lab reads "
                                   f"version{'s' if len(versions) > 1 else ''} {', '.join(map(str, versions))}")
        declared = doc.get("tensors")
        keys = set(f.keys())
        if declared is None:  # version 1 traces: no checksums
            return doc, {k: f.get_tensor(k) for k in keys}
        if want is None:
            raise TraceFormatError(f"{path}: the JSON document has no checksum")
        if not isinstance(declared, dict):
            raise TraceFormatError(f"{path}: 'tensors' must be an object")
        extra = keys - set(declared)
        if extra:
            raise TraceFormatError(f"{path}: {_field_of(sorted(extra)[0])}: tensor not listed in the document")
        tensors = {}

        def fail(key: str, message: str) -> None:
            if damaged is None:
                raise TraceFormatError(message)
            damaged[key] = message

        for key, info in declared.items():
            if key not in keys:
                fail(key, f"{path}: {_field_of(key)}: tensor is missing")
                continue
            sl = f.get_slice(key)
            dtype, shape = str(sl.get_dtype()).lower(), list(sl.get_shape())
            want_dtype = {"int64": "i64", "float32": "f32", "float64": "f64"}.get(info.get("dtype"))
            if want_dtype is None or dtype != want_dtype or shape != info.get("shape"):
                fail(key, f"{path}: {_field_of(key)}: tensor is {dtype} {shape}, the document says "
                          f"{info.get('dtype')} {info.get('shape')}")
                continue
            t = f.get_tensor(key)
            if tensor_sha256(t) != info.get("sha256"):
                fail(key, f"{path}: {_field_of(key)}: checksum mismatch: the file is corrupted")
                continue
            tensors[key] = t
    return doc, tensors
