"""Re-make fixtures/sglang_cpu_recording.{json,safetensors}: SGLang's Triton verify kernels,
interpreted on a CPU, driven through ddtree-lab's recorder.

    python scripts/make_sglang_fixture.py            # writes the fixture, prints the replay

:func:`record_cpu_demo` is the recipe (tests/test_sglang_recorder.py checks that the fixture is
what it makes).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "sglang_cpu_recording"


def record_cpu_demo(path: str | os.PathLike | None = None, seed: int = 0):
    """Drive SGLang's Triton kernels (interpreted on a CPU) through a recorder.

    Steps: (0) greedy tree verify of three DDTree trees; (1) the chain sampler with one-hot
    draft probabilities (the target-only rule) at temperature 0.8, top-k 10; (2) the same
    sampler on a row whose drafted token holds all of the row's float32 mass ``1 - 2**-24``
    and a coin equal to it, where SGLang and the lab differ by design; (3) the chain sampler
    with real draft probabilities (rejection sampling), which the lab's verifiers do not
    implement. Request ids ``req-0..2`` (greedy) and ``req-3..5`` (sampled). Every target row is recorded (``prob_rows="all"``),
    so the lab's walk on step 2 can go past the node SGLang rejected.

    Returns:
        the :class:`ddtree_lab.sglang.Recording`; written to ``path.json`` /
        ``path.safetensors`` when ``path`` is given.
    """
    from ddtree_lab import build_tree, compile_retrieve, draft_topk_from_logits, target_probs
    from ddtree_lab.sampling import SamplingParams
    from ddtree_lab.sglang.kernels import chain_draft_probs, sglang_kernels, sglang_verify_chain, sglang_verify_greedy
    from ddtree_lab.sglang.recorder import RecordFilter, SGLangRecorder

    kernels = sglang_kernels()
    rec = SGLangRecorder(RecordFilter(max_rows=3, prob_rows="all"))
    greedy = rec.wrap(kernels["verify_tree_greedy_triton"], "greedy")
    chain = rec.wrap(kernels["chain_speculative_sampling_triton"], "chain")
    g = torch.Generator().manual_seed(seed)
    bs, vocab, rids = 3, 40, ["req-0", "req-1", "req-2"]
    seq = torch.tensor([11, 17, 5])

    ids, lp = draft_topk_from_logits(torch.randn(bs, 4, vocab, generator=g) * 2.5, k=3)
    tree = build_tree(ids, lp, torch.randint(0, vocab, (bs,), generator=g), 12)
    vi = compile_retrieve(tree, seq)
    logits = torch.randn(bs, vi.num_rows, vocab, generator=g)
    for b in range(bs):
        for i in range(1, int(tree.num_nodes[b])):
            if torch.rand(1, generator=g) < 0.5:
                logits[b, int(tree.parents[b, i]), int(tree.node_token_ids[b, i])] += 4.0
    rec.set_context(rids, seq, {"temperature": [0.0] * bs, "top_k": [1] * bs, "top_p": [1.0] * bs})
    sglang_verify_greedy(vi, logits, kernel=greedy)

    def chain_batch(length):
        ids, lp = draft_topk_from_logits(torch.randn(bs, length - 1, vocab, generator=g) * 2.5, k=1)
        t = build_tree(ids, lp, torch.randint(0, vocab, (bs,), generator=g), length - 1)
        v = compile_retrieve(t, seq + 1)
        lg = torch.randn(bs, length, vocab, generator=g)
        for b in range(bs):
            for i in range(1, length):
                lg[b, i - 1, int(t.node_token_ids[b, i])] += 3.0
        return v, lg

    params = SamplingParams(0.8, top_k=10)
    rids = ["req-3", "req-4", "req-5"]  # the sampled requests
    rec.set_context(rids, seq + 1, {"temperature": [0.8] * bs, "top_k": [10] * bs, "top_p": [1.0] * bs})
    v, lg = chain_batch(6)
    sglang_verify_chain(v, target_probs(lg, params), torch.rand(bs, 6, generator=g), torch.rand(bs, generator=g),
                        kernel=chain)

    v, lg = chain_batch(4)
    probs = target_probs(lg, params)
    coins = torch.rand(bs, 4, generator=g) * 0.5
    full = 1.0 - 2.0 ** -24
    tokens = v.node_token_ids.clone()
    tokens[1, 1] = 7  # a drafted token other than V - 1, so SGLang's fallback token is visibly different
    v = dataclasses.replace(v, node_token_ids=tokens)
    probs[1, 0] = 0.0
    probs[1, 0, 7] = full
    coins[1, 0] = full
    sglang_verify_chain(v, probs, coins, torch.rand(bs, generator=g), kernel=chain)

    v, lg = chain_batch(4)
    probs = target_probs(lg, params)
    draft = torch.softmax(torch.randn(bs, 4, vocab, generator=g), -1)
    draft = 0.5 * draft + 0.5 * chain_draft_probs(v, vocab)
    draft[:, -1] = 0.0
    sglang_verify_chain(v, probs, torch.rand(bs, 4, generator=g), torch.rand(bs, generator=g), draft_probs=draft,
                        kernel=chain)
    rec.clear_context()
    if rec.errors:
        raise RuntimeError(f"recorder errors: {rec.errors}")
    meta = {"source": "scripts/make_sglang_fixture.py (record_cpu_demo)", "seed": seed}
    if path is not None:
        rec.save(path, meta)
    return rec.recording(meta)


def main() -> int:
    from ddtree_lab.sglang.replay import replay_recording, replay_report

    recording = record_cpu_demo(FIXTURE)
    print("\n".join(replay_report(replay_recording(recording))))
    print("wrote", FIXTURE.with_suffix(".json"), FIXTURE.with_suffix(".safetensors"))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
