"""The first device call of issue 36's GPU plan, one named step at a time (scripts/gpu_check.sh).

Every step uses random weights (no checkpoint travels): a small random Llama with SmolLM2's
tokenizer (:func:`ddtree_lab.models.tiny.random_target`), a SmolLM2-135M-shaped one (V 49,152,
hidden 576, 30 layers) and a Qwen3-8B-shaped one (V 151,936, hidden 4,096, 32 query / 8
key-value heads of 128, MLP 12,288, bf16, 36 layers as the real model unless ``--qwen-layers``
says fewer), each with a seeded :class:`ddtree_lab.models.tiny.RandomDrafter`. Steps (estimated
minutes on one H100 / H200, machine start not included):

* ``env`` (0.1): device, torch, triton, transformers.
* ``greedy-equivalence`` (0.5): a greedy :class:`ddtree_lab.LiveSession` on the device gives
  the tokens of transformers' ``generate(do_sample=False)`` on the same random weights.
* ``step-split-smollm`` (1.3), ``step-split-qwen3-8b`` (2.0): ``LiveSession(device)`` steps at
  bs 1 / 8 / 32, level ``light``, B 32, device tree build: the target forward's time against
  everything else (stage timings from CUDA events), then the sync-free step
  (``torch-batched``, levels ``light`` and ``off``) at bs 8 beside it. Goal (issue 36): everything but the target forward <= 10%
  of the step at bs 8, level ``light``.
* ``verify-floor`` (0.7): the sampled Triton verify at bs 32, N 64, V 151,936 bf16 (top-k 50,
  top-p 0.9) against its memory floor (the reached rows read once at the measured copy
  bandwidth), and the host time of one ``verify_tree`` call around it. Goal: within 3x.
* ``tree-build-floor`` (0.5): ``build_device.build_tree_device`` at bs 32, B 64, L-1 15,
  V 151,936 against its floor (one max-reduction over the draft logits, as
  benchmarks/tree_build.py). Goal: within 10x.
* ``host-syncs`` (0.7): host synchronisations per live step on the device
  (:class:`ddtree_lab.hostsync.HostSyncCounter`, and CUDA's own count of synchronising calls
  under ``torch.cuda.set_sync_debug_mode("warn")``, which also sees blocking host-to-device
  copies), bs 1 / 32, B 8 / 64, the sync-free step (``verify_backend="torch-batched"``, judged
  on the larger of the two counts) and the device's default verify (shown), each step's wall
  time beside it. Goal: <= 3, the same at every bs and B.

Each step prints ``STEP <name>: ...`` result lines and ends with ``STEP <name> done``; a goal
line reads ``GOAL <what>: <figure> (goal ...): met | missed | not judged (dry run)``.
``--dry-run`` runs the same code on the CPU with tiny shapes (kernels interpreted) so the plan
is known to work before a GPU is lent; its figures mean nothing.

    python benchmarks/gpu_plan.py --step verify-floor [--dry-run]
    python benchmarks/gpu_plan.py --list
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

STEPS = {  # name -> estimated minutes on the GPU
    "env": 0.1, "greedy-equivalence": 0.5, "step-split-smollm": 1.3, "step-split-qwen3-8b": 2.0,
    "verify-floor": 0.7, "tree-build-floor": 0.5, "host-syncs": 0.7,
}
PROMPTS = ["Explain why the sky is blue.", "Write a poem about the sea.", "Why do cats purr?",
           "Give me a recipe for tomato soup."]


def _setup(dry: bool):
    if dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports the kernels
    import torch

    if dry:
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_plan: no CUDA device (torch.cuda.is_available() is false); use --dry-run on a CPU")
    return torch, ("cpu" if dry else "cuda")


def _sync(torch, device):
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(torch, device, fn, repeat: int) -> float:
    """Median seconds of ``fn`` after one untimed call, each ended by a device sync."""
    fn()
    _sync(torch, device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(torch, device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _goal(what: str, value: float, limit: float, unit: str, dry: bool) -> None:
    verdict = "not judged (dry run)" if dry else ("met" if value <= limit else "missed")
    print(f"GOAL {what}: {value:.3g}{unit} (goal <= {limit:g}{unit}): {verdict}")


def _tokenizer():
    from transformers import AutoTokenizer

    from ddtree_lab.models.default_target import default_target_dir

    return AutoTokenizer.from_pretrained(default_target_dir(), local_files_only=True)


def shaped_target(torch, kind: str, device: str, dry: bool, layers: int | None = None):
    """A random-weight :class:`ddtree_lab.models.TargetModel` shaped as SmolLM2-135M (``smollm``,
    fp32) or Qwen3-8B (``qwen3-8b``, bf16); tiny shapes of the same family when ``dry``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from ddtree_lab.models import TargetModel

    tok = _tokenizer()
    common = dict(max_position_embeddings=4096, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    if kind == "smollm":
        shape = dict(vocab_size=49_152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
        if dry:
            shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)
        config, cls, dtype = LlamaConfig(**shape, **common), LlamaForCausalLM, torch.float32
    else:
        shape = dict(vocab_size=151_936, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=layers or 36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
        if dry:
            shape.update(vocab_size=max(len(tok), 1024), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        config, cls, dtype = Qwen3Config(**shape, **common), Qwen3ForCausalLM, torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(dtype)
    name = f"random-{kind}-V{config.vocab_size}-H{config.hidden_size}-L{config.num_hidden_layers}-{str(dtype)[6:]}"
    return TargetModel(model, tok, name=name)


def step_env(torch, device, args) -> None:
    import transformers
    import triton

    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)"
    print(f"STEP env: device {name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"transformers {transformers.__version__}, python {sys.version.split()[0]}")


def step_greedy_equivalence(torch, device, args) -> None:
    import ddtree_lab as dl
    from ddtree_lab.models.tiny import RandomDrafter, random_target

    target = random_target(hidden_size=64 if args.dry_run else 256, num_layers=2 if args.dry_run else 4, device=device)
    drafter = RandomDrafter(target.vocab_size, device=device)
    tokens = 8 if args.dry_run else 32
    session = dl.LiveSession(target, drafter, budget=16, record="light", sampling=dl.SamplingParams(0.0))
    session.tree_build = "device"
    session.run(PROMPTS[:2], max_new_tokens=tokens)
    same = 0
    for b, prompt in enumerate(PROMPTS[:2]):
        ids = torch.tensor([target.encode_prompt(prompt)], device=device)
        ref = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
                                    pad_token_id=target.tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
        eos = target.tokenizer.eos_token_id
        ref = ref[:ref.index(eos) + 1] if eos in ref else ref
        got = session.requests[b].generated[:len(ref)]
        same += got == ref
        print(f"STEP greedy-equivalence: request {b}: lab {len(got)} tokens, transformers {len(ref)}, "
              f"{'equal' if got == ref else 'DIFFER at ' + str(next(i for i, (x, y) in enumerate(zip(got, ref)) if x != y) if any(x != y for x, y in zip(got, ref)) else 'length')}")
    print(f"STEP greedy-equivalence: {same}/2 requests equal (fp32, {target.name})")
    if same != 2:
        raise SystemExit(1)


def _split(torch, device, target, args, kind: str) -> None:
    import ddtree_lab as dl
    from ddtree_lab.models.tiny import RandomDrafter
    from ddtree_lab.step import STAGES

    drafter = RandomDrafter(target.vocab_size, device=device)
    steps = 2 if args.dry_run else 6
    share8: dict[str, float] = {}
    runs = [(bs, "light", None) for bs in ((1, 2) if args.dry_run else (1, 8, 32))]
    runs += [(2 if args.dry_run else 8, level, "torch-batched") for level in ("light", "off")]  # the sync-free step
    for bs, level, backend in runs:
        s = dl.LiveSession(target, drafter, budget=32, record=level, verify_backend=backend,
                           sampling=dl.SamplingParams(0.8, top_k=50, top_p=0.9))
        s.tree_build = "device"
        s.start([PROMPTS[i % len(PROMPTS)] for i in range(bs)])
        s.step(10_000)  # warm-up: compiles, allocator
        totals = dict.fromkeys(STAGES, 0.0)
        _sync(torch, device)
        t0 = time.perf_counter()
        for _ in range(steps):
            s.step(10_000)
            for k, v in s.last_timings.items():
                totals[k] += v
        _sync(torch, device)
        wall = (time.perf_counter() - t0) / steps
        step = sum(totals.values()) / steps
        other = step - totals["target"] / steps
        share = other / step if step else 0.0
        stages = " ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in totals.items())
        print(f"STEP step-split-{kind}: bs {bs}, level {level}, {s.verify_backend}: step {step * 1e3:.2f} ms (wall {wall * 1e3:.2f}), target "
              f"{totals['target'] / steps * 1e3:.2f} ms, everything else {other * 1e3:.2f} ms = {share:.1%}; "
              f"stages ms: {stages}")
        if bs == (2 if args.dry_run else 8) and level == "light":
            share8[s.verify_backend] = share
    assert share8
    for backend, share in share8.items():
        _goal(f"{kind} bs 8 light, {backend}: everything but the target forward, share of the step", share * 100, 10,
              "%", args.dry_run)


def step_split_smollm(torch, device, args) -> None:
    _split(torch, device, shaped_target(torch, "smollm", device, args.dry_run), args, "smollm")


def step_split_qwen(torch, device, args) -> None:
    target = shaped_target(torch, "qwen3-8b", device, args.dry_run, args.qwen_layers)
    print(f"STEP step-split-qwen3-8b: target {target.name} (random weights)")
    _split(torch, device, target, args, "qwen3-8b")


def _bandwidth(torch, device) -> float:
    src = torch.empty((512 if device == "cuda" else 16) * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / _timed(torch, device, lambda: dst.copy_(src), 10)


def step_verify_floor(torch, device, args) -> None:
    import ddtree_lab as dl
    from ddtree_lab.verify import sampled_launcher

    bs, n, vocab = (2, 8, 512) if args.dry_run else (32, 64, 151_936)
    g = torch.Generator().manual_seed(0)
    ids, lp = dl.draft_topk_from_logits(torch.randn(bs, 15, min(vocab, 4096), generator=g) * 3, k=8)
    tree = dl.build_tree(ids, lp, torch.zeros(bs, dtype=torch.int64), n - 1)
    vi = dl.compile_retrieve(tree, 100)  # on the host: the launcher copies it into its device buffer
    logits = (torch.randn(bs, vi.num_rows, vocab, device=device) * 2).to(torch.bfloat16)
    coins, final = torch.rand(bs, vi.num_rows, generator=g), torch.rand(bs, generator=g)
    params = [dl.SamplingParams(0.8, top_k=50, top_p=0.9)] * bs
    launch, out = sampled_launcher(vi, logits, params, coins, final)
    t_kernel = _timed(torch, device, launch, 2 if args.dry_run else 50)
    reached = int(out["plen"].sum())
    floor = reached * vocab * 2 / _bandwidth(torch, device)
    call = _timed(torch, device, lambda: dl.verify_tree(vi, logits, params, coins, final, backend="triton",
                                                        validate=False), 2 if args.dry_run else 20)
    print(f"STEP verify-floor: bs {bs}, N {vi.num_rows}, V {vocab} bf16: kernel {t_kernel * 1e3:.3f} ms, floor "
          f"{floor * 1e3:.4f} ms ({reached} rows), verify_tree call {call * 1e3:.3f} ms")
    _goal("sampled verify bs 32 N 64 V 151936, kernel / memory floor", t_kernel / floor, 3, "x", args.dry_run)


def step_tree_build_floor(torch, device, args) -> None:
    import ddtree_lab as dl
    from ddtree_lab.build_device import build_tree_device

    bs, budget, vocab = (2, 8, 512) if args.dry_run else (32, 64, 151_936)
    logits = torch.randn(bs, 15, vocab, device=device) * 3
    ids, lp = dl.draft_topk_from_logits(logits, k=budget)
    anchor = torch.zeros(bs, dtype=torch.int64, device=device)
    repeat = 2 if args.dry_run else 30
    t_build = _timed(torch, device, lambda: build_tree_device(ids, lp, anchor, budget, validate=False), repeat)
    t_floor = _timed(torch, device, lambda: logits.amax(-1), repeat)
    print(f"STEP tree-build-floor: bs {bs}, B {budget}, L-1 15, V {vocab}: build {t_build * 1e3:.3f} ms, floor "
          f"(one max-reduction over the draft logits) {t_floor * 1e3:.4f} ms")
    _goal("tree build bs 32 B 64, build / floor", t_build / t_floor, 10, "x", args.dry_run)


def _cuda_syncs(torch, device, fn):
    """``(fn(), syncs)``: on CUDA, ``fn`` runs under ``torch.cuda.set_sync_debug_mode("warn")``
    and ``syncs`` is a Counter of the ``file:line`` of every synchronising CUDA call it made
    (what the CPU count cannot see: a blocking host-to-device copy, a driver-side wait); None
    elsewhere."""
    if device != "cuda":
        return fn(), None
    import warnings
    from collections import Counter

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sites = Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught
                    if "synchroniz" in str(w.message).lower())
    return out, sites


def step_host_syncs(torch, device, args) -> None:
    import ddtree_lab as dl
    from ddtree_lab.models.tiny import RandomDrafter, random_target

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from host_syncs import count_step

    target = random_target(device=device)
    drafter = RandomDrafter(target.vocab_size, device=device)
    worst = 0
    for backend in ("torch-batched", None):  # the sync-free step; the device's default verify
        for bs in (1, 2) if args.dry_run else (1, 32):
            for budget in (8, 64):
                s = dl.LiveSession(target, drafter, budget=budget, record="off", sampling=dl.SamplingParams(0.8),
                                   verify_backend=backend)
                s.tree_build = "device"
                s.start([PROMPTS[i % len(PROMPTS)] for i in range(bs)])
                s.step(10_000)
                _sync(torch, device)
                t0 = time.perf_counter()
                (stages, counter), cuda = _cuda_syncs(torch, device, lambda: count_step(s))
                _sync(torch, device)
                ms = (time.perf_counter() - t0) * 1e3
                if backend == "torch-batched":
                    worst = max(worst, counter.total if cuda is None else max(counter.total, sum(cuda.values())))
                print(f"STEP host-syncs: {s.verify_backend}, bs {bs}, B {budget}: {counter.total} per step "
                      f"({ms:.1f} ms with the counter on); by stage " + ", ".join(f"{k} {v}" for k, v in stages.items() if v)
                      + ("" if cuda is None else f"; CUDA sync debug mode: {sum(cuda.values())} synchronising calls "
                         + ", ".join(f"{site} x{n}" for site, n in cuda.most_common(8))))
    _goal("host syncs per live step, torch-batched (worst of bs x B)", worst, 3, "", args.dry_run)


RUN = {"env": step_env, "greedy-equivalence": step_greedy_equivalence, "step-split-smollm": step_split_smollm,
       "step-split-qwen3-8b": step_split_qwen, "verify-floor": step_verify_floor,
       "tree-build-floor": step_tree_build_floor, "host-syncs": step_host_syncs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", choices=list(STEPS), help="the step to run")
    ap.add_argument("--list", action="store_true", help="print the steps and their estimated minutes")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU with tiny shapes (figures mean nothing)")
    ap.add_argument("--qwen-layers", type=int, default=None, help="layers of the Qwen3-8B-shaped target (default 36)")
    args = ap.parse_args()
    if args.list or not args.step:
        for name, minutes in STEPS.items():
            print(f"{name:<20} {minutes:>4} min")
        return
    torch, device = _setup(args.dry_run)
    t0 = time.perf_counter()
    RUN[args.step](torch, device, args)
    print(f"STEP {args.step} done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
