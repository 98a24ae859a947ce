"""Host work of one sampled Triton verify call, on the CPU (issue 36).

What the host does around the sampled tree-verify kernel (``ddtree_lab.kernels.sampled``) in
``dl.verify_tree(..., backend="triton")``: the argument checks, the launcher's tensors
(``ddtree_lab.verify.triton.sampled_launcher``), the launch call, the read-back of the
kernel's compact outputs and their expansion into a ``VerifyOutput``. The kernel itself is
stubbed (a function that writes the outputs the interpreted kernel wrote for the same
inputs, recorded once under ``TRITON_INTERPRET=1``), so the time is the host's alone; the host
synchronisations are counted with :class:`ddtree_lab.hostsync.HostSyncCounter` (each one a
wait for the GPU there). Triton's own launch cost of a compiled kernel (~20-40 us) is not in
these figures: it needs a GPU (scripts/gpu_check.sh, check ``verify-floor``).

Shape: bs 32, N 64 (budget 63), V 4,096 bf16 logits, T 0.8, top-k 50, top-p 0.9 (the host
work does not depend on V). Phases: ``checks`` (verify_tree's argument checks, up to the
launcher), ``launcher`` (sampled_launcher: the tensors the kernel takes), ``launch`` (the
stubbed call), ``launcher+launch+readback`` (``verify_triton_sampled``: the two above, then
the error codes, the outputs to the host and the walk that expands them); ``total`` = verify_tree end to end, ``validate=False`` (the buffers' O(N) tree check
off, what a live step could run) and ``validate=True``.

    DDTREE_LAB_THREADS=1 python benchmarks/verify_launcher.py [--repeat 50] [--label after]

Run it once on the code before a change and once after (``PYTHONPATH`` picks which) to
compare: ``benchmarks/verify_launcher.out.txt`` holds both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports the kernels

import torch

import ddtree_lab as dl
from ddtree_lab.hostsync import HostSyncCounter
from ddtree_lab.verify import backends
from ddtree_lab.verify import triton as vt

BS, NODES, VOCAB = 32, 64, 4096
PARAMS = dl.SamplingParams(0.8, top_k=50, top_p=0.9)
OUTPUT_ARGS = slice(16, 28)  # positions of the compact output buffers in the kernel's arguments


def make_case(seed: int = 0):
    """(verify_input, bf16 logits [BS, N, V], coins [BS, N], final_coins [BS]) on the CPU."""
    g = torch.Generator().manual_seed(seed)
    ids, lp = dl.draft_topk_from_logits(torch.randn(BS, 15, VOCAB, generator=g) * 3, k=8)
    tree = dl.build_tree(ids, lp, torch.randint(0, VOCAB, (BS,), generator=g), NODES - 1)
    vi = dl.compile_retrieve(tree, 100)
    logits = (torch.randn(BS, vi.num_rows, VOCAB, generator=g) * 2).to(torch.bfloat16)
    return vi, logits, torch.rand(BS, vi.num_rows, generator=g), torch.rand(BS, generator=g)


class _Recorded:
    """Stands in for ``sampled_verify_kernel``: ``kernel[grid](*args, **meta)`` writes the
    outputs recorded from one real (interpreted) launch on the same inputs."""

    def __init__(self, outputs: list[torch.Tensor]):
        self.outputs = outputs

    def __getitem__(self, grid):
        def launch(*args, **meta):
            for dst, src in zip(args[OUTPUT_ARGS], self.outputs):
                dst.copy_(src)
        return launch


def _median_us(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _syncs(fn) -> HostSyncCounter:
    with HostSyncCounter() as counter:
        fn()
    return counter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=50, help="timed calls per figure (median; default 50)")
    ap.add_argument("--label", default="", help="a name for this run in the output (e.g. before / after)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    vi, logits, coins, final = make_case()
    items = [PARAMS] * BS
    module, interpreted = vt.triton_kernels()
    if module is None or not interpreted:
        raise SystemExit(f"verify_launcher: needs the kernels under TRITON_INTERPRET=1 ({interpreted})")
    real = module.sampled_verify_kernel
    # one real launch, its outputs recorded; then the stub replays them
    launch, out = vt.sampled_launcher(vi, logits, items, coins, final)
    launch()
    expected = dl.verify_tree(vi, logits, PARAMS, coins, final, backend="triton")
    module.sampled_verify_kernel = _Recorded([v.clone() for v in out.values()])
    real_kernels = vt.triton_kernels
    vt.triton_kernels = lambda: (module, True)  # the stub is no InterpretedFunction: say it is
    try:
        got = dl.verify_tree(vi, logits, PARAMS, coins, final, backend="triton")
        assert torch.equal(got.accept_index, expected.accept_index) and got.decisions == expected.decisions
        launch, out = vt.sampled_launcher(vi, logits, items, coins, final)
        launch()
        def checks():
            # verify_tree's work before the kernel's launcher: run it with the launcher stopped at entry
            saved = backends.verify_triton_sampled

            def stop(*a, **k):
                raise _Stop
            backends.verify_triton_sampled = stop
            try:
                dl.verify_tree(vi, logits, PARAMS, coins, final, backend="triton", validate=False)
            except _Stop:
                pass
            finally:
                backends.verify_triton_sampled = saved

        phases = {
            "checks": checks,
            "launcher": lambda: vt.sampled_launcher(vi, logits, items, coins, final),
            "launch": launch,
            "launcher+launch+readback": lambda: vt.verify_triton_sampled(vi, logits, items, coins, final, "triton"),
            "total (validate=False)": lambda: dl.verify_tree(vi, logits, PARAMS, coins, final, backend="triton",
                                                              validate=False),
            "total (validate=True)": lambda: dl.verify_tree(vi, logits, PARAMS, coins, final, backend="triton"),
        }
        label = f" [{args.label}]" if args.label else ""
        print(f"sampled Triton verify, host work per call{label}: bs {BS}, N {vi.num_rows}, V {VOCAB} bf16, "
              f"T 0.8 top-k 50 top-p 0.9; kernel stubbed; median of {args.repeat}; torch {torch.__version__}, "
              f"{torch.get_num_threads()} thread")
        print(f"{'phase':<26} {'host us':>9} {'syncs':>6}")
        keep = None
        for name, fn in phases.items():
            counter = _syncs(fn)
            print(f"{name:<26} {_median_us(fn, args.repeat):>9.0f} {counter.total:>6}")
            if name == "total (validate=False)":
                keep = counter
        assert keep is not None
        print("\nsync sites of one call, validate=False (count, call, site)")
        print(keep.table())
    finally:
        module.sampled_verify_kernel = real
        vt.triton_kernels = real_kernels


class _Stop(Exception):
    pass


if __name__ == "__main__":
    main()
