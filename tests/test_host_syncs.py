"""Host synchronisations per live step, counted on the CPU (issue 36).

The counter first: it must see every kind of call it claims to see (on this torch), count a
call once, and name its call site. Then the live step on a random-weight target
(:mod:`ddtree_lab.models.tiny`) at bs 1 / 32, B 8 / 64, greedy and sampled, level ``off``:
each stage's count read at the session's stage marks. Held here: the build stage reads
nothing on the host, and the commit stage's count is one constant at every batch size and
budget. Not yet met (the issue's goal is <= 3 per step): the draft top-k, compile and verify
stages still read per block / per depth / per request, so the step's total grows with the
batch; its measured value is pinned from above so that no new read creeps in unseen.
"""

import math

import numpy as np
import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.hostsync import SYNC_CALLS, HostSyncCounter


def test_the_counter_sees_every_read_it_claims_once_each_at_its_site():
    t, s, flag = torch.tensor([1.0, 2.0]), torch.tensor(3), torch.tensor(True)
    with HostSyncCounter() as syncs:
        s.item()
        t.tolist()
        t.cpu()
        t.numpy()
        np.asarray(t)
        bool(flag)
        if flag:  # implicit truthiness
            pass
        int(s)
        float(s)
        math.isfinite(s)  # __float__
        list(range(s))  # __index__
        f"{s}"  # __format__ of a one-element tensor
        t.nonzero()
        t[t > 1]  # boolean-mask indexing
        torch.equal(t, t)
        t.repeat_interleave(torch.tensor([1, 2]))
    calls = [x.call for x in syncs.syncs]
    assert calls == ["item", "tolist", "cpu", "numpy", "__array__", "__bool__", "__bool__", "__int__", "__float__",
                     "__float__", "__index__", "__format__", "nonzero", "__getitem__", "equal", "repeat_interleave"]
    assert set(calls) <= SYNC_CALLS
    assert all(x.site.startswith("tests/test_host_syncs.py:") for x in syncs.syncs), syncs.table()
    with HostSyncCounter() as none:  # no value read: not counted
        u = t * 2 + 1
        u[torch.tensor([0])]
        u.to(torch.float64)
        t.repeat_interleave(torch.tensor([1, 2]), output_size=3)
        torch.where(t > 1, t, 0.0).sum()
    assert none.total == 0, none.table()


@pytest.fixture(scope="module")
def tiny():
    from ddtree_lab.models.tiny import RandomDrafter, random_target

    target = random_target()
    return target, RandomDrafter(target.vocab_size)


PROMPTS = ["Explain why the sky is blue.", "Write a poem about the sea.", "Why do cats purr?"]


def _stage_counts(monkeypatch, session) -> dict[str, int]:
    """Host syncs of one ``session.step`` per stage, read at the session's stage marks."""
    from ddtree_lab import session as session_module

    marks = []
    counter = HostSyncCounter()
    real_mark = session_module._Clock.mark

    def mark(clock, name):
        marks.append((name, counter.total))
        real_mark(clock, name)

    monkeypatch.setattr(session_module._Clock, "mark", mark)
    with counter:
        session.step(1000)
    monkeypatch.setattr(session_module._Clock, "mark", real_mark)
    out, last = {}, 0
    for name, total in marks:
        out[name], last = total - last, total
    out["total"] = counter.total
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_host_syncs_per_live_step(monkeypatch, tiny, temperature):
    target, drafter = tiny
    counts = {}
    for bs in (1, 32):
        for budget in (8, 64):
            session = dl.LiveSession(target, drafter, budget=budget, record="off",
                                     sampling=dl.SamplingParams(temperature=temperature))
            session.tree_build = "device"  # what a GPU step runs ("auto" builds on the host on a CPU)
            session.start([PROMPTS[i % len(PROMPTS)] for i in range(bs)])
            session.step(1000)  # a warm step; the second is counted
            assert len(session._rows) == bs  # nobody left: the counted step runs the whole batch
            counts[bs, budget] = _stage_counts(monkeypatch, session)
    for key, c in counts.items():
        assert c["build"] == 0, (key, c)  # the tree is built on the device: no host read
        assert c["target"] == counts[1, 8]["target"] <= 3, (key, c)
        assert c["commit"] == counts[1, 8]["commit"] <= 3, (key, c)  # one read of the result, one of the lengths
    # the stages still to do: per-request (verify), per-block (draft top-k) and per-depth (compile)
    # reads; pinned from above at what was measured so that none grows unseen
    assert counts[1, 8]["total"] <= 70 and counts[32, 64]["total"] <= 560, counts
