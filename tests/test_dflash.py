"""DFlash drafter: checkpoint loader, forward against an independent implementation, cache
lifecycle, and the shipped weights reproducing their recorded held-out hit rate."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from ddtree_lab.models import DraftContext
from ddtree_lab.models.dflash import DFlashConfig, DFlashDrafter, build_target_layer_ids, load_dflash_state

H, HEADS, KV, HD, INTER, LAYERS, L, V = 32, 4, 2, 8, 48, 2, 5, 64
TARGET_LAYERS = [0, 2, 3]
EPS, THETA = 1e-6, 10000.0


class TinyTarget:
    """Just what a drafter reads of a target: a random embedding and LM head."""

    name = "tiny"

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.embedding = torch.randn(V, H, generator=g)
        self.head = torch.randn(V, H, generator=g) / math.sqrt(H)
        self.hidden_size, self.vocab_size = H, V
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def embed(self, ids):
        return self.embedding[ids]

    def lm_head(self, hidden):
        return hidden.float() @ self.head.T


def public_config(**over):
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
           "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
           "intermediate_size": INTER, "rope_theta": THETA, "rms_norm_eps": EPS, "block_size": L,
           "num_target_layers": 6, "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": TARGET_LAYERS}}
    cfg.update(over)
    return cfg


def public_weights(seed=1):
    """Random weights under the public names, written out by hand (not from the module)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    w = {"fc.weight": r(H, len(TARGET_LAYERS) * H), "hidden_norm.weight": 1 + r(H), "norm.weight": 1 + r(H)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        w |= {p + "self_attn.q_proj.weight": r(HEADS * HD, H), p + "self_attn.k_proj.weight": r(KV * HD, H),
              p + "self_attn.v_proj.weight": r(KV * HD, H), p + "self_attn.o_proj.weight": r(H, HEADS * HD),
              p + "self_attn.q_norm.weight": 1 + r(HD), p + "self_attn.k_norm.weight": 1 + r(HD),
              p + "mlp.gate_proj.weight": r(INTER, H), p + "mlp.up_proj.weight": r(INTER, H),
              p + "mlp.down_proj.weight": r(H, INTER), p + "input_layernorm.weight": 1 + r(H),
              p + "post_attention_layernorm.weight": 1 + r(H)}
    return w


def write_checkpoint(path, cfg=None, weights=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg or public_config()))
    save_file(weights or public_weights(), str(path / "model.safetensors"))
    return path


# -- an independent, straightforward DFlash forward (plain loops and einsum, from scratch) ----------

def rms(x, w):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS))


def rope(x, pos):
    """x [T, heads, hd] at positions pos [T]: pairs (i, i + hd/2) rotated by pos * theta^(-2i/hd)."""
    out = torch.empty_like(x)
    half = HD // 2
    for t in range(x.shape[0]):
        for i in range(half):
            ang = float(pos[t]) * THETA ** (-2 * i / HD)
            c, s = math.cos(ang), math.sin(ang)
            a, b = x[t, :, i], x[t, :, i + half]
            out[t, :, i] = a * c - b * s
            out[t, :, i + half] = b * c + a * s
    return out


def reference_logits(w, target, features, anchor, mask_id):
    """Logits [L-1, V] for the block after ``anchor`` given every committed token's features
    ``[C, k*H]`` (positions 0..C-1), computed from scratch with full attention."""
    c = features.shape[0]
    ctx = rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = target.embed(torch.tensor([anchor] + [mask_id] * (L - 1)))
    ctx_pos, blk_pos = torch.arange(c), torch.arange(c, c + L)
    for i in range(LAYERS):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(L, HEADS, HD), w[p + "self_attn.q_norm.weight"])
        both = torch.cat([ctx, h])  # K/V from [context; block]
        k = rms((both @ w[p + "self_attn.k_proj.weight"].T).view(c + L, KV, HD), w[p + "self_attn.k_norm.weight"])
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(c + L, KV, HD)
        q, k = rope(q, blk_pos), rope(k, torch.cat([ctx_pos, blk_pos]))
        heads = []
        for hh in range(HEADS):
            g = hh // (HEADS // KV)
            scores = torch.einsum("qd,kd->qk", q[:, hh], k[:, g]) / math.sqrt(HD)  # no mask at all
            heads.append(torch.softmax(scores, -1) @ v[:, g])
        x = x + torch.cat(heads, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return target.lm_head(rms(x, w["norm.weight"]))[1:]


# -- tests ------------------------------------------------------------------------------------------

def test_build_target_layer_ids_follows_z_lab():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B-DFlash-b16's choice
    assert build_target_layer_ids(30, 1) == [15]
    with pytest.raises(ValueError):
        build_target_layer_ids(3, 2)


def test_loader_reads_the_public_layout(tmp_path):
    weights = public_weights()
    cfg, state = load_dflash_state(write_checkpoint(tmp_path / "ckpt", weights=weights))
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (L, V - 1, TARGET_LAYERS)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (HEADS, KV, HD)
    drafter = DFlashDrafter.load(TinyTarget(), tmp_path / "ckpt")
    got = drafter.model.state_dict()
    assert set(got) == set(weights)
    for k, v in weights.items():
        assert torch.equal(got[k], v), k
    # block_size inside dflash_config, no head_dim (hidden / heads), layer ids from num_target_layers
    alt = public_config(head_dim=None)
    del alt["block_size"]
    alt["dflash_config"] = {"mask_token_id": 3, "block_size": 7}
    cfg2 = DFlashConfig.from_dict(alt)
    assert (cfg2.block_size, cfg2.head_dim, cfg2.target_layer_ids) == (7, H // HEADS, build_target_layer_ids(6, LAYERS))


def test_loader_names_unknown_and_missing_keys(tmp_path):
    weights = public_weights()
    weights["layers.0.self_attn.rotary.inv_freq"] = torch.zeros(3)
    del weights["layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"unknown keys \['layers.0.self_attn.rotary.inv_freq'\], "
                                         r"missing keys \['layers.1.mlp.up_proj.weight'\]"):
        load_dflash_state(write_checkpoint(tmp_path / "bad", weights=weights))
    weights = public_weights()
    weights["fc.weight"] = weights["fc.weight"][:, :H].contiguous()
    with pytest.raises(ValueError, match="wrong shapes.*fc.weight"):
        load_dflash_state(write_checkpoint(tmp_path / "shape", weights=weights))
    cfg = public_config()
    cfg["dflash_config"] = {"target_layer_ids": TARGET_LAYERS}
    with pytest.raises(ValueError, match="mask_token_id"):
        load_dflash_state(write_checkpoint(tmp_path / "nomask", cfg=cfg))
    with pytest.raises(FileNotFoundError, match="nowhere: no such directory"):
        load_dflash_state(tmp_path / "nowhere")


def test_loader_names_the_file_on_damaged_or_misplaced_input(tmp_path):
    """Every bad checkpoint is a ValueError / FileNotFoundError naming the file, never a raw
    JSON, safetensors or attribute error."""
    from ddtree_lab.models import RidgeDrafter

    good = write_checkpoint(tmp_path / "good")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cfg/config.json: Expecting"):
        load_dflash_state(tmp_path / "cfg")
    (tmp_path / "cfg" / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        load_dflash_state(tmp_path / "cfg")
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        load_dflash_state(write_checkpoint(tmp_path / "b1", cfg=public_config(block_size=1)))
    broken = write_checkpoint(tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"broken/model.safetensors: not a readable safetensors file"):
        load_dflash_state(broken)
    with pytest.raises(ValueError, match="not a directory"):
        load_dflash_state(good / "model.safetensors")
    (good / "model_card.json").write_text("{")
    with pytest.raises(ValueError, match=r"model_card.json: not valid JSON"):
        DFlashDrafter.load(TinyTarget(), good)
    # the ridge loader: a directory, a DFlash file, a non-safetensors file, a missing file
    with pytest.raises(ValueError, match="a directory, not a ridge safetensors file"):
        RidgeDrafter.load(TinyTarget(), good)
    with pytest.raises(ValueError, match=r"not ridge weights, lacks tensors \['basis', 'heads', 'temperatures'\]"):
        RidgeDrafter.load(TinyTarget(), good / "model.safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        RidgeDrafter.load(TinyTarget(), tmp_path / "cfg" / "config.json")
    with pytest.raises(FileNotFoundError, match="no such file"):
        RidgeDrafter.load(TinyTarget(), tmp_path / "none.safetensors")


def test_forward_matches_the_independent_implementation_through_the_cache(tmp_path):
    """Two requests of different context lengths drafted in one batch; request 0's cache is built
    in pieces with a crop (a rejected tail re-committed), so the incremental cache must equal the
    from-scratch recomputation."""
    weights = public_weights()
    target = TinyTarget()
    drafter = DFlashDrafter.load(target, write_checkpoint(tmp_path / "ckpt", weights=weights))
    g = torch.Generator().manual_seed(5)
    feats = [torch.randn(9, len(TARGET_LAYERS) * H, generator=g), torch.randn(4, len(TARGET_LAYERS) * H, generator=g)]
    drafter.start(2)
    drafter.commit(0, feats[0][:3], 0)
    drafter.commit(0, torch.randn(4, len(TARGET_LAYERS) * H, generator=g), 3)  # a tail that gets replaced
    assert drafter.cache_length(0) == 7
    drafter.commit(0, feats[0][3:9], 3)  # crop to 3, then append the real features
    drafter.commit(1, feats[1], 0)
    ctx = DraftContext(requests=[0, 1], anchor_token_ids=torch.tensor([7, 11]), positions=torch.tensor([9, 4]),
                       committed_ids=[[0] * 10, [0] * 5])
    got = drafter.draft_logits(ctx)
    assert got.shape == (2, L - 1, V) and got.dtype == torch.float32
    for i, (f, a) in enumerate(zip(feats, [7, 11])):
        want = reference_logits(weights, target, f, a, V - 1)
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)
    # the anchor matters, and each request only sees its own context
    other = drafter.draft_logits(DraftContext([1], torch.tensor([12]), torch.tensor([4]), [[0] * 5]))
    assert (other[0] - got[1]).abs().max() > 1e-3


def test_lifecycle_errors_are_named(tmp_path):
    drafter = DFlashDrafter.load(TinyTarget(), write_checkpoint(tmp_path / "ckpt"))
    drafter.start(1)
    width = len(TARGET_LAYERS) * H
    with pytest.raises(ValueError, match="request 0: commit at position 2 but the draft cache holds 0"):
        drafter.commit(0, torch.zeros(1, width), 2)
    with pytest.raises(ValueError, match=rf"features must be \[n_new, {width}\]"):
        drafter.commit(0, torch.zeros(1, H), 0)
    with pytest.raises(ValueError, match="request 3 was not started"):
        drafter.commit(3, torch.zeros(1, width), 0)
    drafter.commit(0, torch.zeros(2, width), 0)
    with pytest.raises(ValueError, match="anchor at position 3 but the draft cache holds 2"):
        drafter.draft_logits(DraftContext([0], torch.tensor([1]), torch.tensor([3]), [[1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="must both be"):
        DraftContext([0, 1], torch.tensor([1]), torch.tensor([3]), [[1], [2]])


def test_save_then_load_round_trips_in_fp16(tmp_path):
    target = TinyTarget()
    drafter = DFlashDrafter.load(target, write_checkpoint(tmp_path / "a"))
    drafter.save(tmp_path / "b", record={"name": "tiny-dflash"})
    again = DFlashDrafter.load(target, tmp_path / "b")
    saved = json.loads((tmp_path / "b" / "config.json").read_text())
    assert saved["vocab_size"] == target.vocab_size  # engines size the shared LM head from it
    assert again.name == "tiny-dflash" and again.model.config.to_dict() == {**drafter.model.config.to_dict(),
                                                                            "vocab_size": target.vocab_size}
    for k, v in drafter.model.state_dict().items():
        torch.testing.assert_close(again.model.state_dict()[k], v.half().float())


# -- the drafter shipped for the embedded default target ---------------------------------------------

def test_shipped_drafter_reproduces_its_recorded_held_out_hit_rate(target):
    """The fp16 weights in fixtures/ (the default drafter, trained on vLLM's data) load into the
    public layout and give, through the drafter's own start/commit/draft_logits, the held-out hit
    rates its model card records."""
    from ddtree_lab.models.dflash import block_hit_rates, default_dflash_path

    path = default_dflash_path()
    drafter = DFlashDrafter.load(target, path)
    assert drafter.block_size == 16
    assert drafter.model.config.num_hidden_layers == drafter.record["architecture"]["layers"] in (1, 2)
    assert sum(f.stat().st_size for f in path.iterdir()) < 20e6
    card = drafter.record["held_out_eval"]
    prompts = json.loads((default_dflash_path().parent / "dflash_prompts.json").read_text())
    assert card["sequences"] and all(isinstance(ids, list) for ids, _ in card["sequences"])
    held_text = {target.decode(ids[:plen]) for ids, plen in card["sequences"]}
    # really held out: no training prompt of either set is in a held-out sequence
    assert not any(p in t for t in held_text for p in prompts["train"] + prompts["engine_train"])
    got = block_hit_rates(drafter, card["sequences"], stride=card["stride"])
    assert got["anchors"] == card["anchors"]
    assert got["chain_tau"] == pytest.approx(card["chain_tau"], abs=0.02)
    for k, (a, b) in enumerate(zip(got["top1_by_position"], card["top1_by_position"])):
        assert a == pytest.approx(b, abs=0.02), f"position {k + 1}"
    # far above chance (1 / 49,152) and above the ridge drafter's 16% at the first position
    assert got["top1_by_position"][0] > 0.2


def test_lab_loads_either_drafter():
    from ddtree_lab import notebook

    target, drafter = notebook.load_default(drafter="dflash")
    assert isinstance(drafter, DFlashDrafter) and drafter.block_size == 16
    ridge = notebook.load_drafter(target, "ridge")
    assert type(ridge).__name__ == "RidgeDrafter"
    _, default = notebook.load_default()
    assert type(default).__name__ == {"dflash": "DFlashDrafter", "ridge": "RidgeDrafter"}[notebook.DEFAULT_DRAFTER]
    # a path works too: a directory is a DFlash checkpoint, a file ridge weights
    from ddtree_lab.models import default_drafter_path
    from ddtree_lab.models.dflash import default_dflash_path

    assert isinstance(notebook.load_drafter(target, str(default_dflash_path())), DFlashDrafter)
    assert type(notebook.load_drafter(target, str(default_drafter_path()))).__name__ == "RidgeDrafter"
    with pytest.raises(ValueError, match="drafter must be 'dflash', 'ridge' or an existing path, got 'eagle'"):
        notebook.load_default(drafter="eagle")
    with pytest.raises(ValueError, match="got 123"):
        notebook.load_drafter(target, 123)
    import ddtree_lab as dl

    with pytest.raises(ValueError, match="budget must be in"):  # refused when made, before any prompt
        dl.LiveSession(target, drafter, budget=-1)
    for bad in ("eagle", ""):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            notebook.load_drafter(target, bad)
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            notebook.load_default(drafter=bad)


def test_greedy_ddtree_with_the_dflash_drafter_equals_plain_greedy_decoding(target):
    """The session's drafter lifecycle (start, commit after prefill and after every step,
    draft_logits) with the shipped DFlash drafter is lossless at T = 0."""
    import ddtree_lab as dl

    drafter = DFlashDrafter.load(target)
    prompts = ["Explain gravity.", "Tell me about owls, please."]
    run = dl.LiveSession(target, drafter, budget=16, sampling=dl.SamplingParams(temperature=0.0)).run(
        prompts, max_new_tokens=12)
    for b, p in enumerate(prompts):
        assert run.generated_tokens(b) == target.greedy_decode(target.encode_prompt(p), 12)


def test_tau_budget_figure_draws_one_line_per_drafter_and_temperature(tmp_path):
    from ddtree_lab.views.tau import load_tau_records, tau_budget_figure

    rows = [{"drafter": d, "temperature": t, "config": c, "budget": b, "tau": 1 + b / 100 + (d == "x")}
            for d in ("x", "y") for t in (0.0, 0.8) for c, b in [("chain", 15), ("ddtree", 8), ("ddtree", 32)]]
    path = tmp_path / "tau.json"
    path.write_text(json.dumps({"rows": rows}))
    fig = tau_budget_figure(load_tau_records(path))
    names = [t.name for t in fig.data]
    assert len(names) == 8 and "x, T=0.8: DDTree" in names and "y, T=0: chain" in names
    tree = next(t for t in fig.data if t.name == "x, T=0: DDTree")
    assert list(tree.x) == [8, 32] and list(tree.y) == pytest.approx([2.08, 2.32])
    with pytest.raises(ValueError, match="no DDTree rows"):
        tau_budget_figure([r for r in rows if r["config"] == "chain"])
    path.write_text(json.dumps({"rows": [{"drafter": "x"}]}))
    with pytest.raises(ValueError, match="lacks"):
        load_tau_records(path)


def test_a_vocab_size_other_than_the_targets_is_refused(tmp_path):
    """The drafter shares the target's LM head: a config.json whose vocab_size says otherwise (an
    engine would size the head from it) is refused with the two sizes named."""
    target = TinyTarget()
    path = write_checkpoint(tmp_path / "a")
    cfg = json.loads((path / "config.json").read_text())
    cfg["vocab_size"] = target.vocab_size + 1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"vocab_size {target.vocab_size + 1} != the target's vocabulary "
                                         rf"\({target.vocab_size}\)"):
        DFlashDrafter.load(target, path)


def test_the_shipped_drafters_config_names_the_embedded_targets_vocabulary():
    from ddtree_lab.models.dflash import default_dflash_path

    cfg = json.loads((default_dflash_path() / "config.json").read_text())
    assert cfg["vocab_size"] == 49152 and cfg["architectures"] == ["DFlashDraftModel"]
