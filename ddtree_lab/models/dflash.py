"""DFlash block drafter: a few Qwen3-style layers that read the target's features by KV injection.

Architecture (DFlash, arXiv 2602.06036; z-lab/dflash ``dflash/model.py``, read for facts):

* no embedding and no LM head of its own: the block ``[anchor, mask x (L-1)]`` is embedded with
  the target's input embedding and the drafter's output, after its own final RMSNorm
  (``norm``), goes through the target's LM head; one forward gives the logits of the L-1 mask
  positions;
* context: for every committed token the target's hidden states at ``target_layer_ids``
  (layer ``l``'s output = HF ``hidden_states[l + 1]``), concatenated ``[k*H]``, projected by
  ``fc`` (``k*H -> H``, no bias) and normalised by ``hidden_norm`` (RMSNorm);
* KV injection: in every layer the queries come from the block only; keys and values are the
  projections of ``[context; block]`` (the same projected context in every layer), with
  Qwen3's per-head ``q_norm`` / ``k_norm`` before RoPE; the block attends to all of the context
  and to itself without a causal mask; RoPE positions continue the context (the anchor sits at
  the position after the last committed token);
* the context keys and values live in a per-request draft KV cache that holds exactly the
  committed tokens: :meth:`DFlashDrafter.commit` crops it and projects only the new tokens.

Checkpoints load (:mod:`.dflash_checkpoint`: :class:`DFlashConfig`, :func:`load_dflash_state`)
in the layout the public drafters ship (``config.json`` + ``*.safetensors`` with the parameter names ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``,
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence, cast

import torch
from torch import nn

from .dflash_checkpoint import (DFlashConfig, build_target_layer_ids, default_dflash_path, load_dflash_state,
                                parameter_names)
from .drafter import DraftContext
from ..hostsync import to_device

__all__ = ["DFlashConfig", "DFlashDraftModel", "DFlashDrafter", "build_target_layer_ids", "load_dflash_state",
           "default_dflash_path", "parameter_names"]


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: ``w * x / sqrt(mean(x^2) + eps)``, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Default RoPE tables for ``positions [...]``: ``(cos, sin)`` each ``[..., head_dim]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, T, hd]`` by tables ``[B, T, hd]`` (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K (normed, rotated) and V ``[B, kv_heads, T, hd]`` of ``x [B, T, H]``."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """Queries from ``x [B, Lq, H]``; keys/values ``[ctx_k; K(x)]``; ``mask [B, Lq, C+Lq]``
        boolean (True = may attend). Returns ``[B, Lq, H]``."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k = torch.cat([ctx_k, k], dim=2)
        v = torch.cat([ctx_v, v], dim=2)
        rep = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DFlashDraftModel(nn.Module):
    """The drafter's weights and its block forward (no cache; :class:`DFlashDrafter` keeps one).

    Parameter names are the public checkpoints' (:func:`parameter_names`).
    """

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        k = len(cfg.target_layer_ids)
        self.fc = nn.Linear(k * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _layers(self) -> Iterable[Layer]:
        return cast("Iterable[Layer]", self.layers)  # torch's ModuleList iterates as plain nn.Module

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(features))``: ``[..., k*H] -> [..., H]``."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(K, V)`` ``[B, kv_heads, C, hd]`` of context tokens with features
        ``[B, C, k*H]`` at ``positions [B, C]`` (the draft KV cache entries)."""
        ctx = self.project_context(features)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, ctx.dtype)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self._layers()]

    def block_forward(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                      ctx_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> torch.Tensor:
        """Run the blocks through every layer.

        Args:
            block_embeds: ``[B, Lq, H]`` the target's embeddings of the block tokens (several
                blocks of one sequence may share a row when ``mask`` separates them).
            positions: ``[B, Lq]`` int64 RoPE positions of the block tokens.
            ctx_kv: per layer ``(K, V)`` ``[B, kv_heads, C, hd]`` from :meth:`context_kv`.
            mask: ``[B, Lq, C + Lq]`` bool, True where a block token may attend (context
                columns first, then the block columns).

        Returns:
            ``[B, Lq, H]`` after the final ``norm`` (feed to the target's LM head).
        """
        x = block_embeds.to(self.fc.weight.dtype)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer, (ck, cv) in zip(self._layers(), ctx_kv):
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, ck, cv, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


class DFlashDrafter:
    """A DFlash drafter bound to its target, with a per-request draft KV cache.

    Implements the :class:`ddtree_lab.models.Drafter` protocol: ``start`` / ``commit`` /
    ``draft_logits``. The cache of request ``r`` holds, per layer, the keys and values of
    exactly the committed tokens ``0 .. n_r-1`` whose features were committed.

    Args:
        target: the target whose ``embed`` and ``lm_head`` the drafter shares.
        model: the :class:`DFlashDraftModel` (its dtype and device are used as they are).
        name: shown in traces.
        record: how the weights were made (model card), stored in traces.

    Raises:
        ValueError: the drafter's hidden size differs from the target's, or the mask token id
            is outside the target's vocabulary, or the config's ``vocab_size`` is not the target's.
    """

    def __init__(self, target, model: DFlashDraftModel, name: str = "dflash", record: dict | None = None):
        cfg = model.config
        if cfg.hidden_size != target.hidden_size:
            raise ValueError(f"drafter hidden size {cfg.hidden_size} != target hidden size {target.hidden_size}")
        if not 0 <= cfg.mask_token_id < target.vocab_size:
            raise ValueError(f"mask_token_id {cfg.mask_token_id} outside the target's vocabulary ({target.vocab_size})")
        vocab = cfg.extra.get("vocab_size")
        if vocab is not None and int(vocab) != int(target.vocab_size):
            raise ValueError(f"drafter config.json: vocab_size {vocab} != the target's vocabulary ({target.vocab_size}); "
                             "the drafter shares the target's embedding and LM head")
        n_target = getattr(getattr(getattr(target, "model", None), "config", None), "num_hidden_layers", None)
        if n_target is not None and any(not 0 <= l < n_target for l in cfg.target_layer_ids):
            raise ValueError(f"target_layer_ids {cfg.target_layer_ids} outside the target's {n_target} layers")
        self.target = target
        self.model = model.eval()
        self.name = name
        self.block_size = cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        self.target_layer_ids = tuple(cfg.target_layer_ids)
        self.record = record or {}
        self._cache: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = []
        self._lengths: list[int] = []

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def load(cls, target, path: str | Path | None = None, dtype: torch.dtype | None = None,
             device: str | torch.device | None = None, name: str | None = None) -> "DFlashDrafter":
        """Load a checkpoint directory (default: the drafter shipped for the embedded target).

        ``dtype`` / ``device`` default to the target's. A ``model_card.json`` beside the weights
        becomes the drafter's record.

        Raises:
            FileNotFoundError, ValueError: see :func:`load_dflash_state` and the class.
        """
        path = Path(path) if path is not None else default_dflash_path()
        cfg, state = load_dflash_state(path)
        model = DFlashDraftModel(cfg)
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
        model = model.to(device=device or target.device, dtype=dtype or target.dtype)
        card = path / "model_card.json"
        try:
            record = json.loads(card.read_text()) if card.exists() else {}
        except ValueError as exc:
            raise ValueError(f"{card}: not valid JSON ({exc}); remove or fix the model card") from exc
        if not isinstance(record, dict):
            raise ValueError(f"{card}: the model card must be a JSON object")
        return cls(target, model, name=name or record.get("name", path.name), record=record)

    def save(self, path: str | Path, record: dict | None = None) -> None:
        """Write ``config.json`` (with the target's ``vocab_size``, which engines read to size the
        shared LM head) and fp16 ``model.safetensors`` (public layout), plus ``model_card.json``
        when ``record`` is given."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = self.model.config.to_dict()
        # engines size the shared LM head from it (vLLM's qwen3_dflash assumes Qwen3's 151,936 without it)
        config["vocab_size"] = int(self.target.vocab_size)
        (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        state = {k: v.detach().to(torch.float16).contiguous().cpu() for k, v in self.model.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        if record is not None:
            (path / "model_card.json").write_text(json.dumps(record, indent=1) + "\n")

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, num_requests: int) -> None:
        """Empty the draft KV cache of requests ``0 .. num_requests-1``."""
        if num_requests < 0:
            raise ValueError(f"num_requests must be >= 0, got {num_requests}")
        self._cache = [None] * num_requests
        self._lengths = [0] * num_requests

    def cache_length(self, request: int) -> int:
        """How many committed tokens request ``request``'s draft cache holds."""
        self._check_request(request)
        return self._lengths[request]

    def _check_request(self, request: int) -> None:
        if not 0 <= request < len(self._lengths):
            raise ValueError(f"request {request} was not started (start({len(self._lengths)}) was called)")

    @torch.no_grad()
    def commit(self, request: int, features: torch.Tensor, start: int) -> None:
        """Crop request ``request``'s cache to ``start`` tokens, then project and append the
        features ``[n_new, k*H]`` of the tokens at positions ``start .. start+n_new-1``.

        Raises:
            ValueError: unknown request, ``start`` beyond the cached length (a gap), or
                features of the wrong width.
        """
        self._check_request(request)
        width = len(self.target_layer_ids) * self.model.config.hidden_size
        if features.dim() != 2 or features.shape[1] != width:
            raise ValueError(f"request {request}: features must be [n_new, {width}], got {tuple(features.shape)}")
        have = self._lengths[request]
        if not 0 <= start <= have:
            raise ValueError(f"request {request}: commit at position {start} but the draft cache holds {have} tokens")
        cache = self._cache[request]
        if cache is not None and start < have:
            cache = [(k[:, :, :start], v[:, :, :start]) for k, v in cache]
        n = features.shape[0]
        if n:
            dev = self.model.fc.weight.device
            pos = torch.arange(start, start + n, device=dev)[None]
            new = self.model.context_kv(features[None].to(dev), pos)
            cache = new if cache is None else [(torch.cat([k, nk], 2), torch.cat([v, nv], 2))
                                               for (k, v), (nk, nv) in zip(cache, new)]
        self._cache[request] = cache
        self._lengths[request] = start + n

    @torch.no_grad()
    def draft_logits(self, context: DraftContext) -> torch.Tensor:
        """Logits ``[bs, L-1, V]`` float32 of the L-1 positions after each anchor.

        Each request's block ``[anchor, mask x (L-1)]`` sits at positions
        ``positions[i] .. positions[i]+L-1`` and attends to its whole draft cache (which must
        hold exactly ``positions[i]`` tokens) and to itself.

        Raises:
            ValueError: a request's cache length differs from its anchor position.
        """
        cfg = self.model.config
        L = self.block_size
        dev = self.model.fc.weight.device
        bs = len(context.requests)
        lengths = []
        caches: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per request of the context
        for i, r in enumerate(context.requests):
            self._check_request(int(r))
            cache = self._cache[int(r)]
            if self._lengths[int(r)] != int(context.positions[i]) or cache is None:
                raise ValueError(f"request {int(r)}: anchor at position {int(context.positions[i])} but the draft "
                                 f"cache holds {self._lengths[int(r)]} committed tokens (commit them first)")
            lengths.append(self._lengths[int(r)])
            caches.append(cache)
        c_max = max(lengths)
        ctx_kv = []
        for layer in range(cfg.num_hidden_layers):
            ks, vs = [], []
            for cache, n in zip(caches, lengths):
                k, v = cache[layer]
                ks.append(torch.nn.functional.pad(k, (0, 0, 0, c_max - n)))
                vs.append(torch.nn.functional.pad(v, (0, 0, 0, c_max - n)))
            ctx_kv.append((torch.cat(ks), torch.cat(vs)))
        mask = torch.zeros(bs, L, c_max + L, dtype=torch.bool, device=dev)
        for i, n in enumerate(lengths):
            mask[i, :, :n] = True
        mask[:, :, c_max:] = True
        tokens = torch.full((bs, L), self.mask_token_id, dtype=torch.int64)
        tokens[:, 0] = context.anchor_token_ids.cpu()
        positions = context.positions.to(torch.int64).cpu()[:, None] + torch.arange(L)[None]
        embeds = self.target.embed(tokens).to(dev)
        hidden = self.model.block_forward(embeds, to_device(positions, dev), ctx_kv, mask)
        return self.target.lm_head(hidden[:, 1:]).float()

    def metadata(self) -> dict:
        """What a trace records of this drafter: its configuration and the model card's figures
        (without the held-out token ids and the training curves, which stay in the card)."""
        cfg = self.model.config
        record = {k: v for k, v in (self.record or {}).items() if k not in ("evals", "quick_evals")}
        if isinstance(record.get("held_out_eval"), dict):
            record["held_out_eval"] = {k: v for k, v in record["held_out_eval"].items() if k != "sequences"}
        return {"kind": "DFlashDrafter", "name": self.name, "block_size": self.block_size,
                "num_layers": cfg.num_hidden_layers, "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id, "record": record}


@torch.no_grad()
def target_features(target, token_ids: Sequence[int], layer_ids: Sequence[int]) -> torch.Tensor:
    """The features ``[T, k*H]`` float32 of every token of ``token_ids`` (one causal forward of
    the target with ``output_hidden_states``; layer ``l``'s output is ``hidden_states[l + 1]``)."""
    from .drafter import select_features

    ids = torch.tensor([list(token_ids)], dtype=torch.int64, device=target.device)
    out = target.model(ids, output_hidden_states=True)
    return select_features(out.hidden_states, layer_ids)[0].float()


class BlockDrafter(Protocol):
    """What :func:`block_hit_rates` uses of a drafter (a :class:`DFlashDrafter` has it all)."""

    @property
    def block_size(self) -> int: ...

    @property
    def target(self) -> Any: ...

    @property
    def target_layer_ids(self) -> Sequence[int]: ...

    def start(self, num_requests: int) -> None: ...

    def commit(self, request: int, features: torch.Tensor, start: int) -> None: ...

    def draft_logits(self, context: DraftContext) -> torch.Tensor: ...


@torch.no_grad()
def block_hit_rates(drafter: BlockDrafter, sequences: Sequence[tuple[Sequence[int], int]],
                    stride: int = 4, features: Sequence[torch.Tensor] | None = None) -> dict:
    """Held-out hit rates of a drafter's argmax block, through its own start/commit/draft_logits.

    For every sequence ``(ids, prompt_len)`` and every ``stride``-th anchor position ``a`` from
    ``prompt_len`` on, the drafter sees the target features of positions ``< a`` and the anchor
    ``ids[a]``; position ``k`` of its block is a hit when its argmax equals ``ids[a + k]``.

    ``features`` (optional): per sequence ``[T, k*H]``, the target features from
    :func:`target_features` when the caller already has them.

    Returns:
        ``{"anchors": n, "top1_by_position": [L-1 floats], "chain_tau": mean over anchors of
        1 + the number of leading hits}`` (positions past a sequence's end count as misses,
        so ``chain_tau`` is the accept length of greedy chain verification on this text).
    """
    L = drafter.block_size
    hits = torch.zeros(L - 1)
    counts = torch.zeros(L - 1)
    taus = []
    for i, (ids, prompt_len) in enumerate(sequences):
        ids = list(ids)
        feats = features[i] if features is not None else target_features(drafter.target, ids, drafter.target_layer_ids)
        drafter.start(1)
        have = 0
        for a in range(int(prompt_len), len(ids) - 1, stride):
            drafter.commit(0, feats[have:a], have)
            have = a
            ctx = DraftContext(requests=[0], anchor_token_ids=torch.tensor([ids[a]]), positions=torch.tensor([a]),
                               committed_ids=[ids[: a + 1]])
            pred = drafter.draft_logits(ctx)[0].argmax(-1).tolist()
            lead, leading = 0, True
            for k in range(1, L):
                if a + k >= len(ids):
                    leading = False
                    continue
                ok = pred[k - 1] == ids[a + k]
                hits[k - 1] += ok
                counts[k - 1] += 1
                if leading and ok:
                    lead += 1
                else:
                    leading = False
            taus.append(1 + lead)
    rates = (hits / counts.clamp(min=1)).tolist()
    return {"anchors": len(taus), "top1_by_position": [round(r, 4) for r in rates],
            "chain_tau": round(sum(taus) / max(1, len(taus)), 4)}
