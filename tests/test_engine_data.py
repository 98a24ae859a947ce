"""The drafter's training data made by vLLM's engine (scripts/make_dflash_engine_data.py): the
prompt sets, the plan, the checks that keep a wrong shard out of training, and the training
state that lets a run resume (scripts/train_dflash.py). No engine and no target here: the checks
run on synthetic logits whose right answers are known."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_engine_prompts_never_use_a_held_out_topic_or_template():
    prompts = _script("dflash_prompts")
    built = prompts.build()
    shipped = json.loads((ROOT / "fixtures" / "drafters" / "dflash_prompts.json").read_text())
    assert built == shipped  # the fixture is what the script writes
    assert len(built["engine_train"]) == len(set(built["engine_train"])) >= 6000
    assert set(built["train"]) <= set(built["engine_train"])
    topics = [t.lower() for t in prompts.HELD_OUT_TOPICS]
    starts = [t.split("{t}")[0] for t in prompts.HELD_OUT_TEMPLATES]
    leaks = [p for p in built["engine_train"] if any(t in p.lower() for t in topics) or any(p.startswith(s) for s in starts)]
    assert leaks == []
    assert not set(built["held_out"]) & set(built["engine_train"])


def test_plan_shards_cover_every_prompt_once_with_the_stated_decoding():
    plan = _script("make_dflash_engine_data").build_plan(shard_size=256)
    prompts = json.loads((ROOT / "fixtures" / "drafters" / "dflash_prompts.json").read_text())
    train = [s for s in plan["shards"] if s["split"] == "train"]
    held = [s for s in plan["shards"] if s["split"] == "heldout"]
    assert [q["prompt"] for s in train for q in s["requests"]] == prompts["engine_train"]
    assert [q["prompt"] for s in held for q in s["requests"]] == prompts["held_out"]
    assert all(s["temperature"] == 0.0 for s in held)
    assert [s["temperature"] for s in train[:6]] == [0.0, 0.0, 0.7, 0.0, 0.0, 0.7]
    assert {q["max_new_tokens"] for s in train for q in s["requests"]} <= set(range(160, 257, 16))
    assert plan == _script("make_dflash_engine_data").build_plan(shard_size=256)  # resumable: the same plan


def _logits(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3


def test_greedy_check_finds_a_wrong_token_and_counts_a_tie_apart():
    check = _script("dflash_engine_check")
    prompt_len, gen = 5, 40
    logits = _logits(prompt_len + gen, 50, 0)
    seq = list(range(prompt_len)) + logits[prompt_len - 1 : -1].argmax(-1).tolist()
    ok = check._greedy_check(logits, seq, prompt_len, tol=1e-3)
    assert ok["tokens"] == gen and ok["mismatches"] == 0 and ok["ties"] == 0 and ok["first_mismatch"] is None
    # a tie: the engine's token within the tolerance of the argmax
    tied = logits.clone()
    row = prompt_len - 1 + 7
    second = int(tied[row].topk(2).indices[1])
    tied[row, second] = tied[row].max() - 1e-4
    seq_tie = list(seq)
    seq_tie[prompt_len + 7] = second
    t = check._greedy_check(tied, seq_tie, prompt_len, tol=1e-3)
    assert (t["mismatches"], t["ties"]) == (0, 1)
    # a wrong token: named with its position and both tokens
    bad = list(seq)
    bad[prompt_len + 11] = (bad[prompt_len + 11] + 1) % 50
    b = check._greedy_check(logits, bad, prompt_len, tol=1e-3)
    assert b["mismatches"] >= 1 and b["first_mismatch"]["position"] == 11
    assert b["first_mismatch"]["engine_token"] == bad[prompt_len + 11]


@pytest.mark.parametrize("engine_temperature, uniform", [(0.7, True), (1.0, False), (0.35, False)])
def test_pit_check_passes_the_right_law_and_fails_a_wrong_temperature(engine_temperature, uniform):
    from scipy.stats import kstest

    check = _script("dflash_engine_check")
    prompt_len, gen = 1, 3000
    logits = _logits(prompt_len + gen, 40, 1)
    g = torch.Generator().manual_seed(2)
    probs = torch.softmax(logits[prompt_len - 1 : -1].double() / engine_temperature, -1)
    tokens = torch.multinomial(probs, 1, generator=g)[:, 0].tolist()
    u, lp, expected = check._pit(logits, [0] + tokens, prompt_len, 0.7, torch.Generator().manual_seed(3))
    p = kstest(u.numpy(), "uniform").pvalue
    assert (p >= 1e-3) == uniform, p
    if uniform:
        assert abs(float(lp.mean() - expected.mean())) < 0.1


def test_training_state_round_trip(tmp_path):
    train = _script("train_dflash")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    rng = random.Random(7)
    rng.random()
    scale = torch.rand(4) + 0.5
    info = {"step": 3, "train_seconds": 12.5, "python_rng": rng.getstate(), "log": [{"step": 3, "loss": 1.0}]}
    train.save_state(tmp_path, model, opt, scale, info)
    assert not list(tmp_path.glob("*.partial"))
    saved = train.load_state(tmp_path)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    fresh.load_state_dict({k[len("model."):]: v for k, v in saved["tensors"].items() if k.startswith("model.")})
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    train.restore_optimizer(opt2, fresh, saved["tensors"], saved["json"]["step"])
    assert torch.equal(saved["tensors"]["feature_scale"], scale)
    # one more step from the saved state equals one more step of the original run
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (fresh, opt2)):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(a, b)
    rng2 = random.Random()
    rng2.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in saved["json"]["python_rng"]))
    assert rng2.random() == rng.random()


def test_check_shard_rejects_engine_features_that_differ(monkeypatch):
    """A shard whose engine features are not the lab target's is rejected with the request named."""
    check = _script("dflash_engine_check")
    reqs = [{"prompt": "p", "prompt_token_ids": [1, 2, 3], "generated_token_ids": [4, 5]} for _ in range(4)]
    feats = {j: torch.randn(4, 6).to(torch.float16) for j in range(4)}

    def fake_forward(_target, seqs, _layers, want):  # the lab's target: greedy agrees with the engine
        logits = [torch.nn.functional.one_hot(torch.tensor(s[1:] + [0]), 8).float() * 10 for s in seqs]
        return [(feats[0], lg if w else None) for lg, w in zip(logits, want)]

    monkeypatch.setattr(check, "_forward", fake_forward)
    args = SimpleNamespace(check_every=2, tie_tolerance=1e-3, alpha=1e-3, max_mismatch=0.0, feature_tolerance=1e-3)
    doc = {"temperature": 0.0, "requests": reqs}
    for wrong in (False, True):
        engine = {}
        for j, r in enumerate(reqs):
            engine[f"ids.{j}"] = torch.tensor(r["prompt_token_ids"] + r["generated_token_ids"])
            engine[f"features.{j}"] = (feats[0].float() * 1.01).to(torch.float16) if wrong and j == 2 else feats[0]
        verdict, tensors = check.check_shard(None, doc, [0], args, engine)
        assert verdict["tokens"] == 4 and verdict["mismatches"] == 0  # requests 0 and 2 checked, 2 tokens each
        if not wrong:
            assert verdict["passed"] and tensors is not None and torch.equal(tensors["features.3"], feats[0])
            continue
        assert tensors is None and not verdict["passed"]
        assert verdict["feature_failures"][0]["request"] == 2
        assert "differ" in verdict["why"]
