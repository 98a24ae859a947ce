"""Host synchronisations per live step, by stage and by call site (issue 36), on the CPU.

A random-weight Llama with SmolLM2's tokenizer and a seeded random drafter
(:mod:`ddtree_lab.models.tiny`), level ``off``, device tree build, bs in {1, 32}, B in {8, 64},
greedy and T = 0.8, for the sync-free step (``verify_backend="torch-batched"``) and the
per-request walks (``torch-lazy``): the second step of each session is counted with
:class:`ddtree_lab.hostsync.HostSyncCounter`, per stage (read at the session's stage marks),
then three more steps are timed with the counter off (CPU milliseconds: on a CPU a host read
costs nothing, so the sync-free step only pays its extra work there), then level ``light``
(T = 0.8: the count and the time per step, the writer thread's work waited for), then the
sites of bs 32, B 64, T = 0.8. Goal (issue 36): <= 3 per step, the same at every batch size and budget.

    python benchmarks/host_syncs.py
"""

from __future__ import annotations

import time

import ddtree_lab as dl
from ddtree_lab.live import StepClock
from ddtree_lab.hostsync import HostSyncCounter
from ddtree_lab.models.tiny import RandomDrafter, random_target

PROMPTS = ["Explain why the sky is blue.", "Write a poem about the sea.", "Why do cats purr?"]
STAGES = ("draft", "build", "compile", "target", "verify", "record", "commit")
BACKENDS = ("torch-batched", "torch-lazy")  # the sync-free step; the per-request walks (the CPU default)


def count_step(session) -> tuple[dict[str, int], HostSyncCounter]:
    marks = []
    counter = HostSyncCounter()
    real = StepClock.mark

    def mark(self, name: str) -> None:
        marks.append((name, counter.total))
        real(self, name)

    StepClock.mark = mark
    try:
        with counter:
            session.step(1000)
    finally:
        StepClock.mark = real
    out, last = {}, 0
    for name, total in marks:
        out[name], last = total - last, total
    return out, counter


def step_ms(session, steps: int = 3) -> float:
    """Mean wall time of ``steps`` more steps, the counter off (ms)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        session.step(1000)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    target = random_target()
    drafter = RandomDrafter(target.vocab_size)
    print("host syncs per live step (level off), by stage; then the mean CPU time of 3 more steps (counter off)")
    print(f"{'verify':<14} {'bs':>3} {'B':>3} {'T':>4} " + " ".join(f"{s:>7}" for s in STAGES) + "   total   ms/step")
    keep = {}
    for backend in BACKENDS:
        for bs in (1, 32):
            for budget in (8, 64):
                for temperature in (0.0, 0.8):
                    s = dl.LiveSession(target, drafter, budget=budget, record="off", verify_backend=backend,
                                       sampling=dl.SamplingParams(temperature=temperature))
                    s.tree_build = "device"  # what a GPU step runs
                    s.start([PROMPTS[i % len(PROMPTS)] for i in range(bs)])
                    s.step(1000)
                    stages, counter = count_step(s)
                    ms = step_ms(s)
                    print(f"{backend:<14} {bs:>3} {budget:>3} {temperature:>4} "
                          + " ".join(f"{stages.get(n, 0):>7}" for n in STAGES) + f"   {counter.total:>5}   {ms:>7.1f}")
                    keep[backend] = counter
    print("\nlevel light (the sync-free step's Steps written by its writer thread; ms/step includes waiting for it)")
    print(f"{'verify':<14} {'bs':>3} {'B':>3} {'T':>4}   total   ms/step")
    for backend in BACKENDS:
        for bs in (1, 32):
            for budget in (8, 64):
                s = dl.LiveSession(target, drafter, budget=budget, record="light", verify_backend=backend,
                                   sampling=dl.SamplingParams(temperature=0.8))
                s.tree_build = "device"
                s.start([PROMPTS[i % len(PROMPTS)] for i in range(bs)])
                s.step(1000)
                _, counter = count_step(s)
                s.trace()
                t0 = time.perf_counter()
                for _ in range(3):
                    s.step(1000)
                written = len(s.trace().steps)
                ms = (time.perf_counter() - t0) / 3 * 1e3
                assert written == 5 * bs
                print(f"{backend:<14} {bs:>3} {budget:>3} {0.8:>4}   {counter.total:>5}   {ms:>7.1f}")
    for backend, counter in keep.items():
        print(f"\n{backend}, bs 32, B 64, T 0.8: sites (count, call, site)")
        print(counter.table())


if __name__ == "__main__":
    main()
