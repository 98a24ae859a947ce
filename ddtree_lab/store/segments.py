"""The append-only segment file: self-checking segments written one after another, and their index.

A recording that must survive the crash it is meant to explain cannot be written at the end.
This container is written as it goes: a file header, then one *segment* per step (or small
group of steps), each complete in itself::

    file    = MAGIC segment*
    segment = b"DDSG" | header_len u32 | blob_len u64 | SHA-256(header) 32 bytes | header | blob

``header`` is UTF-8 JSON: ``{"kind": str, "doc": {...}, "summary": {...}, "tensors": {name:
[dtype, shape, offset, nbytes, sha256]}}``; ``blob`` holds the tensors' bytes (C order) at
their offsets. A segment is *complete* when all its bytes are there and the header matches its
SHA-256; each tensor is checked against its own SHA-256 when it is read. A process killed at
any moment leaves complete segments followed by at most one partial one: the reader loads the
first and names the second in one line (:class:`SegmentTail`).

**The index** (``PATH.index``, JSON lines, one per segment: offset, sizes, kind, summary) is
appended after each segment and lets a large file open without reading it. It is only a
cache: lines that are cut, or that disagree with the file, are ignored and the segments after
the last good line are found by scanning the file (:func:`scan`); :func:`rebuild_index`
writes it anew. Reading runs no code from the file (JSON and raw tensor bytes only).

Writing one segment costs O(its size): one ``write`` and one ``flush`` (to the operating
system, which keeps it through a ``kill -9``; ``fsync=True`` also survives a power cut).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .container import TraceFormatError

__all__ = ["MAGIC", "SegmentWriter", "SegmentEntry", "SegmentTail", "SegmentWriteError", "scan", "read_segment",
           "rebuild_index", "is_segment_file", "index_path", "first_doc"]

MAGIC = b"DDTREE-LAB SEGMENTS 1\n"
_SEG = b"DDSG"
_HEAD = struct.Struct("<4sIQ32s")  # tag, header length, blob length, SHA-256 of the header
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                       torch.bool, torch.float64, torch.float32, torch.float16,
                                                       torch.bfloat16)}


class SegmentWriteError(OSError):
    """A segment could not be written (disk full, file closed, ...); the message says why."""


def index_path(path: str | Path) -> Path:
    """The index beside a segment file: ``PATH.index``."""
    return Path(str(path) + ".index")


def is_segment_file(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with :data:`MAGIC` (reads its first bytes only)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class SegmentEntry:
    """Where one complete segment lies: ``offset`` (bytes from the start of the file),
    ``header_len`` and ``blob_len`` (bytes), its ``kind`` and its ``summary`` (JSON the writer
    gave for the index: what a reader needs without opening the segment)."""

    offset: int
    header_len: int
    blob_len: int
    kind: str
    summary: dict = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.offset + _HEAD.size + self.header_len + self.blob_len


@dataclass(frozen=True)
class SegmentTail:
    """What follows the last complete segment: ``offset`` of the first byte not part of one,
    ``size`` of the file, and ``why`` (one line), or ``why=None`` when the file ends cleanly."""

    offset: int
    size: int
    why: str | None


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def encode_segment(kind: str, doc: dict, tensors: dict[str, torch.Tensor], summary: dict | None = None) -> bytes:
    """The bytes of one segment (module docstring).

    Raises:
        TypeError: a tensor of a dtype the format does not store, or a document that is not JSON.
    """
    table, parts, offset = {}, [], 0
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"segment {kind!r}: tensor {name!r} has dtype {t.dtype}, which a segment does not store")
        data = _tensor_bytes(t)
        table[name] = [dtype, list(t.shape), offset, len(data), hashlib.sha256(data).hexdigest()]
        parts.append(data)
        offset += len(data)
    header = json.dumps({"kind": kind, "doc": doc, "summary": summary or {}, "tensors": table},
                        separators=(",", ":")).encode()
    return _HEAD.pack(_SEG, len(header), offset, hashlib.sha256(header).digest()) + header + b"".join(parts)


class SegmentWriter:
    """Appends segments to a file and lines to its index (module docstring).

    Args:
        path: the file; a new file is created (an existing one is replaced) unless
            ``append=True``, which continues a segment file after its last complete segment.
        fsync: also ``os.fsync`` after each segment (survives a power cut, not only a kill).
        opener: ``open``-like callable (tests pass one whose writes fail, as a full disk does).

    Raises:
        FileNotFoundError: the directory does not exist (nothing is created for you).
        IsADirectoryError: ``path`` is a directory.
        TraceFormatError: ``append=True`` on a file that is not a segment file.
    """

    def __init__(self, path: str | Path, *, append: bool = False, fsync: bool = False, opener=open):
        self.path = Path(path)
        if self.path.is_dir():
            raise IsADirectoryError(f"{self.path}: is a directory (give a file name)")
        if not self.path.parent.is_dir():
            raise FileNotFoundError(f"{self.path}: directory {self.path.parent} does not exist "
                                    "(nothing is created for you)")
        self.fsync = fsync
        self.segments = 0
        self.bytes_written = 0
        self.stopped: str | None = None  # why try_append stopped the writer, or None
        if append and self.path.exists():
            entries, tail = scan(self.path)
            self._file = opener(self.path, "r+b")
            self._file.seek(tail.offset)
            self._file.truncate()  # a partial tail is cut before new segments follow it
            rebuild_index(self.path, entries)
            self._index = opener(index_path(self.path), "a")
            self.segments = len(entries)
        else:
            self._file = opener(self.path, "wb")
            self._index = opener(index_path(self.path), "w")
            self._file.write(MAGIC)
            self._file.flush()
        self._offset = self._file.tell()

    def append(self, kind: str, doc: dict, tensors: dict[str, torch.Tensor] | None = None,
               summary: dict | None = None) -> SegmentEntry:
        """Write one segment and its index line, flushed; returns where it lies.

        Raises:
            SegmentWriteError: the write failed (disk full, closed file, ...): the message names
                the file and the error. The file then ends in at most one partial segment.
        """
        data = encode_segment(kind, doc, tensors or {}, summary)
        header_len, blob_len = _HEAD.unpack(data[: _HEAD.size])[1:3]
        entry = SegmentEntry(self._offset, header_len, blob_len, kind, summary or {})
        try:
            self._file.write(data)
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
            self._index.write(json.dumps({"o": entry.offset, "h": header_len, "b": blob_len, "k": kind,
                                          "s": entry.summary}, separators=(",", ":")) + "\n")
            self._index.flush()
        except (OSError, ValueError) as exc:  # ValueError: I/O on a closed file
            raise SegmentWriteError(f"{self.path}: cannot write segment {self.segments} ({kind}): "
                                    f"{type(exc).__name__}: {exc}") from exc
        self._offset = entry.end
        self.segments += 1
        self.bytes_written += len(data)
        return entry

    def try_append(self, kind: str, doc: dict, tensors: dict | None = None, summary: dict | None = None) -> bool:
        """:meth:`append`, except that a failed write stops the writer (``stopped`` says why, the
        file is closed) instead of raising: a recorder must never stop the run it records.
        Returns whether the segment was written."""
        if self.stopped is not None:
            return False
        try:
            self.append(kind, doc, tensors, summary)
            return True
        except SegmentWriteError as exc:
            self.stopped = f"stopped recording: {exc}"
            self.close()
            return False

    def close(self) -> None:
        """Close the file and the index (errors while closing are ignored: every segment was
        already flushed)."""
        for f in (self._file, self._index):
            try:
                f.close()
            except (OSError, ValueError):
                pass


def _read_index(path: Path, size: int) -> list[SegmentEntry]:
    entries, expect = [], len(MAGIC)
    try:
        lines = index_path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    for line in lines:
        try:
            d = json.loads(line)
            e = SegmentEntry(int(d["o"]), int(d["h"]), int(d["b"]), str(d["k"]), dict(d.get("s") or {}))
        except (ValueError, KeyError, TypeError):
            break  # a cut line: the scan finds the rest
        if e.offset != expect or e.end > size:
            break
        entries.append(e)
        expect = e.end
    return entries


def scan(path: str | Path, use_index: bool = True) -> tuple[list[SegmentEntry], SegmentTail]:
    """The complete segments of ``path`` and what follows them.

    Uses the index for the segments it lists consistently (``use_index``), then reads the
    segment headers after them (their blobs are skipped, not read), checking each header's
    SHA-256. The first segment that is cut or fails its checksum ends the scan: it is the tail.

    Raises:
        FileNotFoundError: no such file.
        TraceFormatError: not a segment file (no :data:`MAGIC`).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    size = path.stat().st_size
    entries = _read_index(path, size) if use_index else []
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise TraceFormatError(f"{path}: not an append-only ddtree-lab file (no segment header)")
        offset = entries[-1].end if entries else len(MAGIC)
        while offset < size:
            k = len(entries)
            f.seek(offset)
            head = f.read(_HEAD.size)
            cut = f"{path}: segment {k} at byte {offset} is partial"
            if len(head) < _HEAD.size:
                return entries, SegmentTail(offset, size, f"{cut}: {len(head)} of its first {_HEAD.size} bytes "
                                                          "written (the writer stopped mid-segment)")
            tag, header_len, blob_len, digest = _HEAD.unpack(head)
            if tag != _SEG:
                return entries, SegmentTail(offset, size, f"{path}: byte {offset}: no segment starts here "
                                                          f"(after segment {k - 1}): the rest of the file is unreadable")
            want = _HEAD.size + header_len + blob_len
            if offset + want > size:
                return entries, SegmentTail(offset, size, f"{cut}: {size - offset} of {want} bytes written (the "
                                                          "writer stopped mid-segment)")
            header = f.read(header_len)
            if hashlib.sha256(header).digest() != digest:
                return entries, SegmentTail(offset, size, f"{path}: segment {k} at byte {offset}: its header fails "
                                                          "its checksum: the file is corrupted from there on")
            try:
                h = json.loads(header)
            except ValueError:
                return entries, SegmentTail(offset, size, f"{path}: segment {k}: header is not JSON")
            entries.append(SegmentEntry(offset, header_len, blob_len, str(h.get("kind")), dict(h.get("summary") or {})))
            offset += want
    return entries, SegmentTail(size, size, None)


def read_segment(path: str | Path, entry: SegmentEntry, f=None) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """``(kind, doc, tensors)`` of one segment, the header and every tensor checked against
    their SHA-256 (``f``: an open binary file of ``path`` to read from).

    Raises:
        TraceFormatError: the segment is cut, corrupted or inconsistent (naming file, segment
            offset and tensor).
    """
    own = f is None
    f = open(path, "rb") if own else f
    try:
        f.seek(entry.offset)
        raw = f.read(_HEAD.size + entry.header_len + entry.blob_len)
    finally:
        if own:
            f.close()
    where = f"{path}: segment at byte {entry.offset}"
    if len(raw) < _HEAD.size + entry.header_len + entry.blob_len:
        raise TraceFormatError(f"{where}: cut short ({len(raw)} bytes)")
    tag, header_len, blob_len, digest = _HEAD.unpack(raw[: _HEAD.size])
    if tag != _SEG or header_len != entry.header_len or blob_len != entry.blob_len:
        raise TraceFormatError(f"{where}: does not match the index (rebuild it: ddtree_lab.io.segments.rebuild_index)")
    header = raw[_HEAD.size : _HEAD.size + header_len]
    if hashlib.sha256(header).digest() != digest:
        raise TraceFormatError(f"{where}: header fails its checksum: the file is corrupted")
    h = json.loads(header)
    blob = memoryview(raw)[_HEAD.size + header_len :]
    tensors = {}
    for name, (dtype, shape, off, nbytes, sha) in h["tensors"].items():
        data = blob[off : off + nbytes]
        if len(data) != nbytes or hashlib.sha256(data).hexdigest() != sha:
            raise TraceFormatError(f"{where}: tensor {name!r}: checksum mismatch: the file is corrupted")
        if dtype not in _DTYPES:
            raise TraceFormatError(f"{where}: tensor {name!r}: unknown dtype {dtype!r}")
        if nbytes:
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(_DTYPES[dtype]).reshape(shape)
        else:
            t = torch.zeros(shape, dtype=_DTYPES[dtype])
        tensors[name] = t
    return str(h["kind"]), h["doc"], tensors


def rebuild_index(path: str | Path, entries: list[SegmentEntry] | None = None) -> Path:
    """Write ``PATH.index`` anew from a scan of the file (or from ``entries``); returns its path."""
    path = Path(path)
    if entries is None:
        entries, _ = scan(path, use_index=False)
    out = index_path(path)
    out.write_text("".join(json.dumps({"o": e.offset, "h": e.header_len, "b": e.blob_len, "k": e.kind, "s": e.summary},
                                      separators=(",", ":")) + "\n" for e in entries))
    return out


def first_doc(path: str | Path) -> dict | None:
    """The JSON ``doc`` of the file's first segment (its format and metadata), or None when
    the file is not a segment file or its first segment is not complete."""
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size:
                return None
            tag, header_len, _, digest = _HEAD.unpack(head)
            header = f.read(header_len)
            if tag != _SEG or hashlib.sha256(header).digest() != digest:
                return None
            doc = json.loads(header).get("doc")
            return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None
