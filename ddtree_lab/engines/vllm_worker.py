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
            run_request(kit, json.loads(line))
            reply = {"ok": True, "seconds": round(time.time() - t1, 3)}
        except Exception as err:
            reply = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        print(json.dumps(reply), file=proto, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
