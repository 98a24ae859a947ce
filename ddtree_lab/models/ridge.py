"""Drafters: from the committed context, the per-position draft distributions of one block.

A block drafter (DFlash, arXiv 2602.06036) proposes, in one pass, an independent distribution
for each of the ``L - 1`` positions after the anchor. The :class:`Drafter` protocol asks for
exactly that: ``draft_logits(context) -> [bs, L-1, V]``. :func:`ddtree_lab.draft_topk_from_logits`
turns the logits into the draft top-k the tree builder takes.

:class:`RidgeDrafter` is the first real drafter: per-offset linear heads fitted in closed form
(ridge regression) that map the target's last hidden state before the anchor and the anchor's
embedding to the target hidden state that predicts each later position, decoded through the
target's own LM head (the DFlash idea of sharing the target's embedding and head, with the
transformer layers replaced by one linear map per offset). Weak but real: see the fit record
shipped beside the weights (``fixtures/drafters/*.json``) for its measured hit rates.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .drafter import DraftContext

__all__ = ["RidgeDrafter", "fit_ridge_heads", "default_drafter_path"]


def default_drafter_path() -> Path:
    """The ridge drafter fitted for the embedded default target, shipped in ``fixtures/``."""
    return Path(__file__).resolve().parents[2] / "fixtures" / "drafters" / "smollm2_ridge_b16.safetensors"


class RidgeDrafter:
    """Per-offset ridge heads over the target's features (module docstring).

    For offset ``j = 1..L-1``: ``x = [h; e(anchor); 1] @ U`` (``U``: ``[2H+1, r]``, a shared
    rank-``r`` basis), ``z_j = x @ W_j`` (``[r, H]``), ``logits_j = lm_head(z_j) / T_j``.

    Args:
        target: the :class:`ddtree_lab.models.TargetModel` whose embedding and LM head are used.
        basis: ``[2H+1, r]``; heads: ``[L-1, r, H]``; temperatures: ``[L-1]`` (any float dtype,
            used in float32).
        name: shown in traces.
        record: how the weights were made (free-form, stored in traces).
    """

    def __init__(self, target, basis: torch.Tensor, heads: torch.Tensor, temperatures: torch.Tensor,
                 name: str = "ridge", record: dict | None = None):
        hidden = target.hidden_size
        if basis.shape[0] != 2 * hidden + 1:
            raise ValueError(f"basis has {basis.shape[0]} rows; the target needs 2*H+1 = {2 * hidden + 1}")
        if heads.shape[1:] != (basis.shape[1], hidden):
            raise ValueError(f"heads must be [L-1, {basis.shape[1]}, {hidden}], got {tuple(heads.shape)}")
        if temperatures.shape != (heads.shape[0],) or bool((temperatures <= 0).any()):
            raise ValueError("temperatures must be [L-1] and positive")
        self.target = target
        self.basis = basis.float().to(target.device)
        self.heads = heads.float().to(target.device)
        self.temperatures = temperatures.float().to(target.device)
        self.name = name
        self.block_size = int(heads.shape[0]) + 1
        self.record = record or {}
        self.target_layer_ids = [int(target.model.config.num_hidden_layers) - 1]  # post-norm last layer
        self._features: list[torch.Tensor | None] = []

    @classmethod
    def load(cls, target, path: str | Path | None = None) -> "RidgeDrafter":
        """Load weights saved by :meth:`save` (safetensors; the JSON record sits beside it).

        Raises:
            FileNotFoundError: no such file. ValueError: a directory, a file that is not ridge
                weights (named, with the tensors it lacks), a record that is not JSON, or shapes
                that do not fit ``target``.
        """
        from safetensors import safe_open

        path = Path(path) if path is not None else default_drafter_path()
        if not path.exists():
            raise FileNotFoundError(f"ridge drafter {path}: no such file")
        if path.is_dir():
            raise ValueError(f"ridge drafter {path}: a directory, not a ridge safetensors file "
                             "(a directory is read as a DFlash checkpoint)")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                lacking = sorted({"basis", "heads", "temperatures"} - set(f.keys()))
                if lacking:
                    raise ValueError(f"ridge drafter {path}: not ridge weights, lacks tensors {lacking}")
                tensors = {k: f.get_tensor(k) for k in ("basis", "heads", "temperatures")}
        except ValueError:
            raise
        except Exception as exc:  # safetensors' own SafetensorError on a file that is not safetensors
            raise ValueError(f"ridge drafter {path}: not a readable safetensors file ({exc})") from exc
        record_path = path.with_suffix(".json")
        try:
            record = json.loads(record_path.read_text()) if record_path.exists() else {}
        except ValueError as exc:
            raise ValueError(f"{record_path}: not valid JSON ({exc})") from exc
        if meta.get("target") and meta["target"] != target.name:
            raise ValueError(f"{path.name} was fitted for target {meta['target']!r}, not {target.name!r}")
        return cls(target, tensors["basis"], tensors["heads"], tensors["temperatures"],
                   name=meta.get("name", path.stem), record=record)

    def save(self, path: str | Path, record: dict) -> None:
        """Write fp16 weights (safetensors) and ``record`` as JSON beside them."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"basis": self.basis.half().contiguous(), "heads": self.heads.half().contiguous(),
                   "temperatures": self.temperatures.float().contiguous()}, str(path),
                  metadata={"name": self.name, "target": self.target.name, "block_size": str(self.block_size)})
        path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")

    def features(self, anchor_token_ids: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """``[bs, r]`` projected features."""
        ones = torch.ones(target_hidden.shape[0], 1, device=self.basis.device)
        x = torch.cat([target_hidden.float().to(self.basis.device), self.target.embed(anchor_token_ids), ones], dim=1)
        return x @ self.basis

    def start(self, num_requests: int) -> None:
        """Forget every request (the :class:`ddtree_lab.models.Drafter` lifecycle)."""
        self._features = [None] * int(num_requests)

    def commit(self, request: int, features: torch.Tensor, start: int) -> None:
        """Keep the request's features of positions ``0 .. start-1``, append ``features``
        ``[n_new, H]`` (only the last committed row is read when drafting).

        Raises:
            IndexError: an unknown request. ValueError: ``start`` past the committed features.
        """
        if not 0 <= request < len(self._features):
            raise IndexError(f"request {request} was not started (start({len(self._features)}) was called)")
        old = self._features[request]
        have = 0 if old is None else old.shape[0]
        if not 0 <= start <= have:
            raise ValueError(f"request {request}: commit start {start} outside [0, {have}] committed positions")
        new = features.detach().float().to(self.basis.device)
        self._features[request] = new if old is None or start == 0 else torch.cat([old[:start], new])

    @torch.no_grad()
    def draft_logits(self, context: DraftContext) -> torch.Tensor:
        """``[bs, L-1, V]`` float32 from the feature at ``positions[b] - 1`` and the anchor.

        Raises:
            ValueError: a request whose features before the anchor were not committed.
        """
        rows = []
        for b, r in enumerate(context.requests):
            feats, pos = self._features[r] if 0 <= r < len(self._features) else None, int(context.positions[b])
            if feats is None or not 1 <= pos <= feats.shape[0]:
                raise ValueError(f"request {r}: no committed feature at position {pos - 1} (commit before drafting)")
            rows.append(feats[pos - 1])
        x = self.features(context.anchor_token_ids, torch.stack(rows))
        z = torch.einsum("br,jrh->bjh", x, self.heads)
        return self.target.lm_head(z) / self.temperatures[None, :, None]

    def metadata(self) -> dict:
        return {"kind": "RidgeDrafter", "name": self.name, "block_size": self.block_size,
                "rank": int(self.basis.shape[1]), "record": self.record}


def fit_ridge_heads(hidden: list[torch.Tensor], embeds: list[torch.Tensor], block_size: int,
                    rank: int, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form ridge fit of the per-offset heads on sequences of target features.

    For every position ``t >= 1`` of every sequence and offset ``j`` with ``t + j - 1 < len``:
    input ``[hidden[t-1]; embeds[t]; 1]``, regression target ``hidden[t + j - 1]``.

    Args:
        hidden: per sequence ``[T, H]`` float, the target's last-layer post-norm hidden states.
        embeds: per sequence ``[T, H]`` float, the input embeddings of the same tokens.
        block_size: L; offsets ``1..L-1``.
        rank: r, size of the shared basis (top-r principal directions of the inputs).
        ridge: lambda, relative to the mean diagonal of the Gram matrix.

    Returns:
        ``(basis [2H+1, r], heads [L-1, r, H])``, float32.
    """
    xs, ys = [], [[] for _ in range(block_size - 1)]
    for h, e in zip(hidden, embeds):
        t_len = h.shape[0]
        x = torch.cat([h[:-1], e[1:], torch.ones(t_len - 1, 1)], dim=1).double()  # rows t = 1..T-1
        xs.append(x)
        for j in range(1, block_size):
            # row t needs hidden[t + j - 1]; rows with t + j - 1 >= T have no target
            target = torch.full((t_len - 1, h.shape[1]), math.nan, dtype=torch.float64)
            valid = max(0, t_len - j)
            target[:valid] = h[j : j + valid].double()  # t from 1: index t + j - 1
            ys[j - 1].append(target)
    x = torch.cat(xs)
    gram = x.T @ x / x.shape[0]
    _, vecs = torch.linalg.eigh(gram)
    basis = vecs[:, -rank:].flip(1)  # top-r directions
    xr = x @ basis
    heads = []
    for j in range(block_size - 1):
        y = torch.cat(ys[j])
        ok = ~torch.isnan(y[:, 0])
        a = xr[ok]
        g = a.T @ a
        lam = ridge * g.diagonal().mean()
        heads.append(torch.linalg.solve(g + lam * torch.eye(rank, dtype=g.dtype), a.T @ y[ok]))
    return basis.float(), torch.stack(heads).float()
