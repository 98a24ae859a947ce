"""Runs vLLM's own ``RejectionSampler`` on chain requests sent by :mod:`ddtree_lab.engines.vllm`
(run with the vLLM venv's python; imports only torch, safetensors and vllm).

Protocol (one JSON object per line): the worker first prints ``{"ready": true, "vllm": ...,
"import_seconds": ...}``; then for each request line ``{"inputs": PATH, "output": PATH,
"temperature": [...], "top_k": [...], "top_p": [...], "broadcast": bool}`` it reads the
safetensors file ``inputs`` (``logits [B, K+1, V]`` float32, ``draft_token_ids [B, K]`` int64,
optional ``draft_probs [B, K, V]`` float32, ``seeds [R]`` int64; with ``broadcast`` B is 1 and
every one of the R requests uses that row), runs ``RejectionSampler.forward`` once on the
R requests and writes ``output_token_ids [R, K+1]`` int32 (vLLM's layout: accepted drafts, then
the recovered or bonus token, then -1) to ``output``; it answers ``{"ok": true, "seconds": ...}``
or ``{"ok": false, "error": ...}``. An empty line or end of input stops it.

On a CPU: ``CUDA_VISIBLE_DEVICES`` set empty (else vLLM turns Triton off and its kernels cannot
launch) and ``TRITON_INTERPRET=1`` (vLLM's three sampler kernels run unmodified in Triton's
interpreter); the top-k/top-p masks go through vLLM's PyTorch route
(``apply_top_k_top_p_pytorch``: its Triton top-k/top-p kernel does not run under the
interpreter); the unspecified platform's ``num_compute_units`` is stubbed. Randomness: one
``torch.Generator`` per request seeded with ``seeds[r]`` (vLLM's per-request seed path), used
by vLLM for its uniform coins, its recovered-token noise and the bonus sampler.

A request line with ``"op": "rule"`` runs the new model runner's speculative sampling
(``vllm/v1/worker/gpu/spec_decode/``) end to end instead (:func:`run_rule_request`): DFlash 2's
``CandidateSampler.sample`` (its Triton walk ``_selector_walk_kernel`` and the sparse draft
logits cache ``_cache_draft_logits_kernel``) draws the chain, the target's rows after the drafted
prefix are taken from a Markov table, the Sampler's own ``apply_temperature`` and
``apply_top_k_top_p`` process them as ``Sampler.apply_sampling_params`` does, and
``rejection_sampler_utils.rejection_sample`` verifies (``use_block_verification`` on or off; with
``draft_logits=None`` for one-hot drafts). ``dflash2/speculator.py`` cannot be imported here
(its ``DFlashSpeculator`` import reaches the attention stack and ``einops``), so the file is run
statement by statement (:mod:`ddtree_lab.engines.source`): only that import and the
``DFlash2Speculator`` class that needs it are skipped. Two shims for Triton's interpreter, both
leaving the kernels' arithmetic as written (:func:`interpreter_shims`): a block mask the
interpreter built as int32 (``mask & valid`` of a block and a scalar) is handed to its load and
store as bool, and ``libdevice.log1p`` (an extern function the interpreter cannot call; used by
``_resample_kernel``) is computed by numpy's ``log1p`` in the same dtype.
"""

import json
import os
import sys
import time

if __name__ == "__main__":
    # Run as a script, this file's folder leads sys.path, and its sibling vllm.py (the lab's
    # adapter) would shadow the vllm package.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU tensors only; see the module docstring
    os.environ["TRITON_INTERPRET"] = "1"


def load_sampler():
    """vLLM's RejectionSampler, its metadata classes and version, set up for this process."""
    # vLLM is imported from its own venv (scripts/setup_vllm.sh): pyright cannot resolve it from the lab's venv,
    # and takes the sibling engines/vllm.py for `vllm`
    from vllm.platforms import current_platform  # pyright: ignore[reportMissingImports]  # own venv

    import vllm
    from vllm.v1.sample.ops import topk_topp_sampler  # pyright: ignore[reportMissingImports]  # own venv

    current_platform.num_compute_units = lambda *a, **k: 1  # the unspecified platform raises
    topk_topp_sampler.HAS_TRITON = False  # vLLM's PyTorch top-k/top-p route
    from vllm.v1.sample.logits_processor import LogitsProcessors  # pyright: ignore[reportMissingImports]  # own venv
    from vllm.v1.sample.metadata import SamplingMetadata  # pyright: ignore[reportMissingImports]  # own venv
    from vllm.v1.sample.rejection_sampler import RejectionSampler  # pyright: ignore[reportMissingImports]  # own venv
    from vllm.v1.sample.sampler import Sampler  # pyright: ignore[reportMissingImports]  # own venv
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata  # pyright: ignore[reportMissingImports]  # own venv

    version = vllm.__version__  # pyright: ignore[reportAttributeAccessIssue]  # the real vllm (above)
    return {"sampler": RejectionSampler(Sampler()), "SamplingMetadata": SamplingMetadata,
            "SpecDecodeMetadata": SpecDecodeMetadata, "LogitsProcessors": LogitsProcessors,
            "version": version, "route": "pytorch top-k/top-p" if not topk_topp_sampler.HAS_TRITON else "triton"}


_SHIMS: list = []


def interpreter_shims() -> list:
    """Make Triton's interpreter run the new model runner's kernels (module docstring); returns
    what was changed (one line each). Does nothing (returns ``[]``) outside interpreter mode."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return []
    if _SHIMS:
        return _SHIMS
    import dataclasses
    import inspect

    import numpy as np
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        if mask.data.dtype == np.bool_:
            return mask
        return interpreter.TensorHandle(mask.data.astype(np.bool_), mask.dtype)

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        return load(self, ptrs, as_bool(mask), other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        return store(self, ptrs, value, as_bool(mask), cache_policy)

    builder.create_masked_load = masked_load
    builder.create_masked_store = masked_store

    def log1p(x, _semantic=None):
        with np.errstate(invalid="ignore", divide="ignore"):  # lanes the kernel masks out by tl.where
            data = np.log1p(x.handle.data).astype(x.handle.data.dtype)
        return tl.core.tensor(interpreter.TensorHandle(data, x.handle.dtype), x.type)

    tldevice.log1p = log1p

    # Speed only (~2x here): every device-function call re-patches the triton.language modules its
    # globals name, though the kernel's launch (or an earlier call) already patched them; patch
    # only modules not yet patched in this launch (the launch's restore is kept, as before).
    patch_lang, patched = interpreter._patch_lang, set()

    def patch_new_only(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if patched and langs <= patched:
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        if not patched:  # a kernel launch: its scope is restored when the launch ends
            restore = scope.restore

            def restore_and_forget():
                patched.clear()
                restore()

            scope.restore = restore_and_forget
        patched.update(langs)
        return scope

    interpreter._patch_lang = patch_new_only
    builder_obj = interpreter.interpreter_builder
    builder_obj.options = dataclasses.replace(builder_obj.options, sanitize_overflow=False)
    _SHIMS.extend(["speed: triton.language re-patched only where a device function's globals name a module "
                   "not yet patched in this launch",
                   "speed: the interpreter's int32 overflow checks off (a debugging aid; results unchanged)",
                   "interpreter load/store: a non-bool block mask cast to bool (values 0/1 unchanged)",
                   "libdevice.log1p: numpy log1p in the argument's dtype (the interpreter cannot call externs)"])
    return _SHIMS


def load_new_runner():
    """The new model runner's entry points (module docstring), loaded once into the kit."""
    # the repository this file belongs to leads sys.path, for ddtree_lab.engines.source
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:
        sys.path.insert(0, root)
    from ddtree_lab.engines.source import load_module_source

    shims = interpreter_shims()
    speculator = load_module_source("vllm.v1.worker.gpu.spec_decode.dflash2.speculator")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p  # pyright: ignore[reportMissingImports]  # own venv
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature  # pyright: ignore[reportMissingImports]  # own venv
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample  # pyright: ignore[reportMissingImports]  # own venv

    skipped = [f"line {ln}: {first}" for ln, first, _ in speculator.skipped]
    return {"CandidateSampler": speculator["CandidateSampler"], "rejection_sample": rejection_sample,
            "apply_temperature": apply_temperature, "apply_top_k_top_p": apply_top_k_top_p,
            "about": {"speculator": str(speculator.path), "sha256": speculator.sha256, "skipped": skipped,
                      "shims": shims}}


#: Planted faults of the rule requests (what changes between vLLM's draft side and its verify).
RULE_FAULTS = ("q-temperature-1", "q-other-slot", "token-wise-verify", "draft-logits-q")


def run_rule_request(kit, req: dict) -> dict:
    """One ``"op": "rule"`` request (module docstring).

    Request: ``rule`` (``"dflash2"``: the walk draws the chain; ``"onehot"``: ``draft_tokens``
    given, ``draft_logits=None``), ``block`` (``use_block_verification``), ``fault`` (one of
    :data:`RULE_FAULTS` or null), per-row ``temperature`` / ``top_k`` / ``top_p`` (R rows; 0 is
    greedy, top-k 0 or >= V and top-p 1 are off), ``seed`` (the trial seed: vLLM's per-request
    seeds are drawn from it), ``base_pos`` (the position of the anchor token). Inputs
    (safetensors): ``target_logits [gamma+1, V, V]`` float32 (row ``[i, last]``: the target
    after ``i`` drafts ending in ``last``), ``root [1]`` int64, and ``candidate_ids [gamma, K]``
    int64 + ``scores [gamma, K, K]`` float32 (dflash2) or ``draft_tokens [gamma]`` int64
    (+ ``fault_draft_logits [gamma, V]`` for ``draft-logits-q``) (onehot).

    Writes ``sampled [R, gamma+1]`` int64 (vLLM's rows; entries past ``num_sampled`` are
    unset), ``num_sampled [R]`` int32 (accepted drafts + 1) and ``draft_tokens [R, gamma]``.
    """
    import torch
    from safetensors.torch import load_file, save_file

    if "new_runner" not in kit:
        kit["new_runner"] = load_new_runner()
    nr = kit["new_runner"]
    t = load_file(req["inputs"])
    rule, block, fault = req["rule"], bool(req["block"]), req.get("fault")
    if rule not in ("dflash2", "onehot"):
        raise ValueError(f"rule must be 'dflash2' or 'onehot', got {rule!r}")
    if fault is not None and fault not in RULE_FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(RULE_FAULTS)}")
    table, root = t["target_logits"].float(), int(t["root"][0])
    g, vocab = table.shape[0] - 1, table.shape[-1]
    temp = torch.tensor(req["temperature"], dtype=torch.float32)
    r = temp.shape[0]
    top_k = torch.tensor([k if 0 < k < vocab else vocab for k in req["top_k"]], dtype=torch.int32)
    top_p = torch.tensor(req["top_p"], dtype=torch.float32)
    if top_k.shape[0] != r or top_p.shape[0] != r:
        raise ValueError("temperature, top_k and top_p need one value per row")
    gen = torch.Generator().manual_seed(int(req["seed"]))
    seeds = torch.randint(0, 2**62, (r,), generator=gen, dtype=torch.int64)
    base = int(req.get("base_pos", 16))
    rows_of = torch.arange(r, dtype=torch.int32)
    draft_logits = None
    if rule == "dflash2":
        cand, scores = t["candidate_ids"].long(), t["scores"].float()
        if tuple(cand.shape[:1]) != (g,) or tuple(scores.shape) != (g, cand.shape[1], cand.shape[1]):
            raise ValueError(f"candidate_ids [gamma={g}, K] and scores [gamma, K, K] expected, got "
                             f"{tuple(cand.shape)} and {tuple(scores.shape)}")
        k = int(cand.shape[1])
        sampler = nr["CandidateSampler"](r, g, k, torch.device("cpu"))
        draft_tokens = torch.empty(r * g, dtype=torch.int64)
        draft_logits = torch.full((r, g, vocab), -float("inf"), dtype=torch.float32)  # draft_logits_spec: fp32, -inf
        sampler.sample(cand[None].expand(r, -1, -1).contiguous(), scores[None].expand(r, -1, -1, -1).contiguous(), r,
                       (base + 1 + torch.arange(g))[None].expand(r, -1).reshape(-1).contiguous(),
                       rows_of.repeat_interleave(g), temp, seeds, draft_tokens, draft_logits, False)
        drafts = draft_tokens.view(r, g)
        if fault == "q-temperature-1":  # the verify divides by T again: it reads softmax(scores), not softmax(scores / T)
            scale = torch.where(temp > 0, temp, torch.ones_like(temp))[:, None, None]
            draft_logits = torch.where(torch.isfinite(draft_logits), draft_logits * scale, draft_logits).contiguous()
        elif fault == "q-other-slot":
            draft_logits = torch.cat([draft_logits[:, 1:], draft_logits[:, -1:]], 1).contiguous()
        elif fault is not None and fault != "token-wise-verify":
            raise ValueError(f"fault {fault!r} does not apply to rule dflash2")
    else:
        drafts = t["draft_tokens"].long()[None].expand(r, -1).contiguous()
        if drafts.shape[1] != g:
            raise ValueError(f"draft_tokens must be [gamma={g}], got {tuple(t['draft_tokens'].shape)}")
        if fault == "draft-logits-q":
            draft_logits = t["fault_draft_logits"].float()[None].expand(r, -1, -1).contiguous()
        elif fault is not None:
            raise ValueError(f"fault {fault!r} does not apply to rule onehot")
    lasts = torch.cat([torch.full((r, 1), root, dtype=torch.int64), drafts], 1)  # [R, gamma+1]
    logits = table[torch.arange(g + 1)[None, :], lasts].reshape(r * (g + 1), vocab).contiguous()
    expanded = rows_of.repeat_interleave(g + 1)
    nr["apply_temperature"](logits, expanded, temp)  # Sampler.apply_sampling_params: temperature, then top-k/top-p
    do_k, do_p = bool((top_k < vocab).any()), bool((top_p < 1.0).any())
    if do_k or do_p:
        logits = nr["apply_top_k_top_p"](logits, top_k[expanded.long()] if do_k else None,
                                         top_p[expanded.long()] if do_p else None,
                                         has_topp_only_rows=bool(((top_k >= vocab) & (top_p < 1.0)).any()))
    sampled, num_sampled = nr["rejection_sample"](
        logits.contiguous(), draft_logits, lasts.reshape(-1).contiguous(),
        torch.arange(r + 1, dtype=torch.int32) * (g + 1),
        (base + torch.arange(g + 1))[None].expand(r, -1).reshape(-1).contiguous(), rows_of, expanded,
        torch.arange(g + 1, dtype=torch.int32).repeat(r), temp, seeds, g,
        use_block_verification=block and fault != "token-wise-verify")
    save_file({"sampled": sampled.long().contiguous(), "num_sampled": num_sampled.int().contiguous(),
               "draft_tokens": drafts.contiguous()}, req["output"])
    return nr["about"]


def run_request(kit, req: dict) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    t = load_file(req["inputs"])
    seeds = t["seeds"].tolist()
    r = len(seeds)
    logits, drafts = t["logits"].float(), t["draft_token_ids"].long()
    q = t.get("draft_probs")
    if req.get("broadcast"):
        logits, drafts = logits.expand(r, -1, -1), drafts.expand(r, -1)
        q = None if q is None else q.expand(r, -1, -1)
    if logits.shape[0] != r or drafts.shape[0] != r:
        raise ValueError(f"{logits.shape[0]} logit rows and {drafts.shape[0]} drafts for {r} seeds")
    k, vocab = int(drafts.shape[1]), int(logits.shape[-1])
    if tuple(logits.shape[1:]) != (k + 1, vocab):
        raise ValueError(f"logits must be [R, K+1={k + 1}, V], got {tuple(logits.shape)}")
    temp = torch.tensor(req["temperature"], dtype=torch.float32)
    top_k = [int(x) for x in req["top_k"]]
    top_p = [float(x) for x in req["top_p"]]
    if len(temp) != r or len(top_k) != r or len(top_p) != r:
        raise ValueError("temperature, top_k and top_p need one value per request")
    greedy = temp == 0
    md = kit["SpecDecodeMetadata"]
    per = torch.arange(r, dtype=torch.int32)[:, None] * (k + 1)
    meta = md(draft_token_ids=drafts.reshape(-1).to(torch.int32).contiguous(), num_draft_tokens=[k] * r,
              cu_num_draft_tokens=torch.arange(1, r + 1, dtype=torch.int32) * k,
              cu_num_sampled_tokens=torch.arange(1, r + 1, dtype=torch.int32) * (k + 1),
              target_logits_indices=(per + torch.arange(k, dtype=torch.int32)[None]).reshape(-1),
              bonus_logits_indices=(per[:, 0] + k).contiguous(),
              logits_indices=torch.arange(r * (k + 1), dtype=torch.int32))
    sm = kit["SamplingMetadata"](
        temperature=temp, all_greedy=bool(greedy.all()), all_random=bool((~greedy).all()),
        top_p=None if all(p >= 1.0 for p in top_p) else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if all(x <= 0 or x >= vocab for x in top_k) else
        torch.tensor([x if 0 < x < vocab else vocab for x in top_k], dtype=torch.int32),
        generators={i: torch.Generator().manual_seed(int(s)) for i, s in enumerate(seeds)},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(r), presence_penalties=torch.zeros(r), repetition_penalties=torch.ones(r),
        output_token_ids=[[] for _ in range(r)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=kit["LogitsProcessors"]())
    flat = logits.reshape(r * (k + 1), vocab).contiguous()
    dp = None if q is None else q.reshape(r * k, vocab).float().contiguous()
    out = kit["sampler"](meta, dp, flat, sm).sampled_token_ids
    save_file({"output_token_ids": out.to(torch.int32).contiguous()}, req["output"])


def main() -> int:
    t0 = time.time()
    # The protocol owns the original stdout; anything vLLM prints (its logger) goes to stderr.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        kit = load_sampler()
    except Exception as err:
        print(json.dumps({"ready": False, "error": f"{type(err).__name__}: {err}"}), file=proto, flush=True)
        return 1
    print(json.dumps({"ready": True, "vllm": kit["version"], "route": kit["route"],
                      "import_seconds": round(time.time() - t0, 2)}), file=proto, flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        t1 = time.time()
        try:
            req = json.loads(line)
            about = run_rule_request(kit, req) if req.get("op") == "rule" else run_request(kit, req)
            reply = {"ok": True, "seconds": round(time.time() - t1, 3)}
            if about is not None:
                reply["about"] = about
        except Exception as err:
            reply = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        print(json.dumps(reply), file=proto, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
