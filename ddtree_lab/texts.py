"""Token texts as traces store them: UTF-8 text, with each byte that is not text on its own
written ``<0xNN>``.

A byte-level tokenizer (SmolLM2's, GPT-2's) cuts a Japanese character or an emoji into tokens
that are single bytes of its UTF-8 encoding; decoded alone each is U+FFFD (``'�'``), so every such
token would read the same. The recorded text of such a token keeps its bytes instead: the
valid UTF-8 part as text, every other byte as ``<0xNN>`` (upper-case hex, the name SentencePiece
gives its byte-fallback pieces). :func:`join_texts` puts the bytes of consecutive tokens back
together into the characters they form.
"""

from __future__ import annotations

import codecs
import re
from typing import Iterable

__all__ = ["BYTE_ESCAPE", "bytes_text", "text_bytes", "join_texts", "token_pieces"]

#: one raw byte in a recorded token text: ``<0xE3>``.
BYTE_ESCAPE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_text(data: bytes) -> str:
    """``data`` as a recorded token text: its valid UTF-8 as text, every other byte as
    ``<0xNN>`` (``b"a\\xe3\\x81"`` -> ``"a<0xE3><0x81>"``)."""
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    return _escaped(bytes(data).decode("utf-8", errors="surrogateescape"))


def _escaped(text: str) -> str:
    # surrogateescape decoded a byte b that is not text as U+DC00 + b
    return "".join(f"<0x{ord(ch) - 0xDC00:02X}>" if 0xDC80 <= ord(ch) <= 0xDCFF else ch for ch in text)


def text_bytes(text: str) -> bytes:
    """The bytes a recorded token text stands for (:func:`bytes_text` inverted)."""
    out, pos = bytearray(), 0
    for m in BYTE_ESCAPE.finditer(text):
        out += text[pos:m.start()].encode("utf-8", errors="surrogatepass")
        out.append(int(m.group(1), 16))
        pos = m.end()
    out += text[pos:].encode("utf-8", errors="surrogatepass")
    return bytes(out)


def join_texts(texts: Iterable[str]) -> str:
    """The text of consecutive tokens from their recorded texts: their bytes joined, so the
    pieces of one character become the character; bytes that still form no character stay
    ``<0xNN>`` (``["<0xE3><0x81>", "<0xAB>"]`` -> ``"に"``)."""
    return bytes_text(b"".join(text_bytes(t) for t in texts))


def token_pieces(texts: Iterable[str]) -> list[str]:
    """Per token, the text it completes when the tokens are read in order: a character whose
    bytes span several tokens shows with the token of its last byte (the earlier ones show
    ``""``); bytes left incomplete at the end stay ``<0xNN>`` on the last token. ``"".join`` of
    the pieces is :func:`join_texts`."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    out = [_escaped(decoder.decode(text_bytes(t))) for t in texts]
    tail = decoder.decode(b"", final=True)
    if tail and out:
        out[-1] += _escaped(tail)
    return out
