"""A DFlash drafter's checkpoint: its config (:class:`DFlashConfig`, the public ``config.json``
layout), its parameter names and shapes, and :func:`load_dflash_state`, which reads and checks a
checkpoint directory (``config.json`` + ``*.safetensors``). The architecture that runs it:
:mod:`.dflash`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

__all__ = ["DFlashConfig", "build_target_layer_ids", "load_dflash_state", "default_dflash_path", "parameter_names",
           "expected_shapes"]


def default_dflash_path() -> Path:
    """The DFlash drafter trained for the embedded default target (a checkpoint directory in ``fixtures/``)."""
    return Path(__file__).resolve().parents[2] / "fixtures" / "drafters" / "smollm2_dflash_b16"


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default choice of target layers: the middle layer for one, else
    ``num_draft_layers`` layers spaced evenly from 1 to ``N - 3``, rounded.

    Raises:
        ValueError: fewer than 4 target layers or no draft layer.
    """
    if num_target_layers < 4 or num_draft_layers < 1:
        raise ValueError(f"need >= 4 target layers and >= 1 draft layer, got {num_target_layers}, {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [int(round(first + i * (last - first) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    """The drafter's shape, read from a public ``config.json`` (:meth:`from_dict`).

    ``block_size`` may sit at the top level or inside ``dflash_config``; ``mask_token_id`` and
    ``target_layer_ids`` inside ``dflash_config`` (the latter defaults to
    :func:`build_target_layer_ids` over ``num_target_layers``).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    num_target_layers: int | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, cfg: dict) -> "DFlashConfig":
        """Parse a public DFlash ``config.json`` dict.

        Raises:
            ValueError: a required field is missing or inconsistent, or the config asks for
                something this implementation does not do (attention bias, RoPE scaling,
                sliding-window layers).
        """
        if not isinstance(cfg, dict):
            raise ValueError(f"DFlash config.json must be a JSON object, got {type(cfg).__name__}")
        dcfg = cfg.get("dflash_config") or {}
        if not isinstance(dcfg, dict):
            raise ValueError(f"DFlash config.json: dflash_config must be an object, got {type(dcfg).__name__}")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
                   if k not in cfg]
        block_size = cfg.get("block_size", dcfg.get("block_size"))
        if block_size is None:
            missing.append("block_size (top level or dflash_config)")
        if dcfg.get("mask_token_id") is None:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise ValueError(f"DFlash config.json lacks {missing}")
        assert block_size is not None  # in missing otherwise
        if cfg.get("attention_bias"):
            raise ValueError("DFlash config.json: attention_bias=true is not supported")
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", None):
            raise ValueError(f"DFlash config.json: RoPE type {kind!r} is not supported (only default)")
        if any(t != "full_attention" for t in (cfg.get("layer_types") or [])) and cfg.get("use_sliding_window"):
            raise ValueError("DFlash config.json: sliding-window layers are not supported")
        if int(block_size) < 2:
            raise ValueError(f"DFlash config.json: block_size must be >= 2 (an anchor and at least one mask), "
                             f"got {block_size}")
        heads = int(cfg["num_attention_heads"])
        n_layers = int(cfg["num_hidden_layers"])
        layer_ids = dcfg.get("target_layer_ids")
        if layer_ids is None:
            if cfg.get("num_target_layers") is None:
                raise ValueError("DFlash config.json lacks dflash_config.target_layer_ids and num_target_layers")
            layer_ids = build_target_layer_ids(int(cfg["num_target_layers"]), n_layers)
        theta = cfg.get("rope_theta", rope.get("rope_theta", 1e6))
        known = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "block_size", "rope_theta", "rms_norm_eps", "num_target_layers", "dflash_config"}
        return cls(hidden_size=int(cfg["hidden_size"]), num_hidden_layers=n_layers, num_attention_heads=heads,
                   num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
                   head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                   intermediate_size=int(cfg["intermediate_size"]), block_size=int(block_size),
                   mask_token_id=int(dcfg["mask_token_id"]), target_layer_ids=[int(l) for l in layer_ids],
                   rope_theta=float(theta), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                   num_target_layers=cfg.get("num_target_layers"),
                   extra={k: v for k, v in cfg.items() if k not in known})

    def to_dict(self) -> dict:
        """The public ``config.json`` layout (``dflash_config`` nested)."""
        d = asdict(self)
        extra = d.pop("extra")
        out = {**extra, **{k: d[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "intermediate_size",
                                               "block_size", "rope_theta", "rms_norm_eps")}}
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        out["attention_bias"] = False
        out["dflash_config"] = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        return out


def parameter_names(num_layers: int) -> list[str]:
    """Every parameter name of a public DFlash checkpoint with ``num_layers`` layers."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(num_layers):
        p = f"layers.{i}."
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return names


def load_dflash_state(path: str | Path) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """Read a DFlash checkpoint directory (``config.json`` and one or more ``*.safetensors``).

    Raises:
        FileNotFoundError: no such path, no ``config.json`` or no safetensors file.
        ValueError: not a directory, a config that is not JSON or is bad
            (:meth:`DFlashConfig.from_dict`), a safetensors file that does not parse, unknown or
            missing parameter names (both listed), or a parameter of the wrong shape. Every
            message names the file.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"DFlash checkpoint {path}: no such directory")
    if not path.is_dir():
        raise ValueError(f"DFlash checkpoint {path}: not a directory (a DFlash checkpoint is a directory with "
                         "config.json and *.safetensors)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json (a DFlash checkpoint is a directory)")
    try:
        cfg = DFlashConfig.from_dict(json.loads((path / "config.json").read_text()))
    except (ValueError, TypeError, KeyError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path / 'config.json'}: {exc}") from exc
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors file")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:  # safetensors raises its own SafetensorError on a damaged file
            raise ValueError(f"{f}: not a readable safetensors file ({exc})") from exc
    # Some exports prefix the names with "model."; strip one such prefix when every key has it.
    if state and all(k.startswith("model.") for k in state):
        state = {k[len("model."):]: v for k, v in state.items()}
    expected = set(parameter_names(cfg.num_hidden_layers))
    unknown, missing = sorted(set(state) - expected), sorted(expected - set(state))
    if unknown or missing:
        raise ValueError(f"DFlash checkpoint {path}: unknown keys {unknown}, missing keys {missing}")
    shapes = expected_shapes(cfg)
    wrong = [f"{k}: {tuple(state[k].shape)} != {shapes[k]}" for k in sorted(expected) if tuple(state[k].shape) != shapes[k]]
    if wrong:
        raise ValueError(f"DFlash checkpoint {path}: wrong shapes: {wrong}")
    return cfg, state


def expected_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in a checkpoint of ``cfg``."""
    h, hd, nh, kv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    shapes = {"fc.weight": (h, len(cfg.target_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
                   p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    return shapes
