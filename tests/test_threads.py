"""The lab's thread choice: from cores, cgroup quota and load, with the documented overrides."""

import pytest

from ddtree_lab import threads


def test_busy_shared_machine_gets_one_thread_and_an_idle_one_all_cores():
    assert threads.choose_threads(env={}, cores=2, quota=None, load=8.0).threads == 1
    assert threads.choose_threads(env={}, cores=16, quota=None, load=0.2).threads == 16
    assert threads.choose_threads(env={}, cores=16, quota=None, load=5.6).threads == 10


def test_cgroup_quota_caps_the_cores(tmp_path):
    f = tmp_path / "cpu.max"
    f.write_text("250000 100000\n")
    assert threads._quota(str(f)) == 2.5
    f.write_text("max 100000\n")
    assert threads._quota(str(f)) is None
    assert threads._quota(str(tmp_path / "missing")) is None
    assert threads.choose_threads(env={}, cores=16, quota=2.5, load=0.0).threads == 2
    assert threads.choose_threads(env={}, cores=16, quota=0.5, load=0.0).threads == 1


def test_overrides_win_in_order():
    env = {"DDTREE_LAB_THREADS": "3", "OMP_NUM_THREADS": "7"}
    assert threads.choose_threads(env=env, cores=2, quota=None, load=9.0).threads == 3
    assert threads.choose_threads(env={"DDTREE_LAB_THREADS": "torch"}).threads is None
    got = threads.choose_threads(env={"OMP_NUM_THREADS": "7"}, cores=2, quota=None, load=0.0)
    assert got.threads is None and "OMP_NUM_THREADS" in got.reason
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match="DDTREE_LAB_THREADS must be an int >= 1 or 'torch'"):
            threads.choose_threads(env={"DDTREE_LAB_THREADS": bad})


def test_configure_applies_once(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("DDTREE_LAB_THREADS", "1")
    try:
        assert threads.configure_threads(force=True).threads == 1
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("DDTREE_LAB_THREADS", "2")
        assert threads.configure_threads().threads == 1  # applied once per process
    finally:
        torch.set_num_threads(before)
        threads._applied = None
