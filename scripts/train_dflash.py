"""Train the DFlash drafter of the embedded default target (SmolLM2-135M-Instruct) on this CPU.

Recipe (DFlash, arXiv 2602.06036, section on training; z-lab/dflash for the architecture):

1. Data: ``scripts/make_dflash_engine_data.py`` (the default: vLLM's answers to 6,200 training
   prompts, each shard checked against the lab's target, features from the lab's forward; in
   ``<cache>/dflash_engine_data``) or ``scripts/make_dflash_data.py`` (the lab's own ``generate``
   on 620 prompts; ``--data <cache>/dflash_data``). Shards that appear while the run trains are
   added every ``--reload-minutes``.
2. Every step takes ``--batch`` sequences and ``--blocks`` random anchor positions ``a`` per
   sequence (inside the generated part). Each block ``[ids[a], mask x (L-1)]`` sees the context
   features of positions ``< a`` and the other tokens of its own block (no causal mask inside),
   never another block; position ``k`` predicts ``ids[a + k]``.
3. Loss: cross-entropy with weight ``exp(-(k-1)/gamma)`` on position ``k``. The target is
   frozen; its embedding and LM head are shared and frozen. To fit this CPU the softmax runs
   over the tokens the training text contains plus ``--negatives`` random other tokens drawn
   afresh every step (a sampled softmax; evaluation always uses the full vocabulary).
4. AdamW, linear warm-up then cosine decay over a wall-clock budget (``--minutes``): the run
   stops on time. A checkpoint (public DFlash layout, fp16) and the loss curve are written every
   ``--checkpoint-minutes`` so a partial run still yields weights, with the whole training state
   (fp32 weights, AdamW moments, step, time spent, random states, logs; safetensors + JSON, no
   pickle) in ``--state``: ``--resume`` continues from it, in this session or a later one, on the
   same schedule (the budget counts the minutes already spent).

    python scripts/train_dflash.py [--minutes 45] [--layers 2] [--threads 2] [--out fixtures/drafters/smollm2_dflash_b16]
    python scripts/train_dflash.py --resume --minutes 90   # the same run, its budget raised to 90 min
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ddtree_lab.models import cache_dir, load_default_target
from ddtree_lab.models.dflash import (DFlashConfig, DFlashDraftModel, DFlashDrafter, block_hit_rates, target_features,
                                      default_dflash_path)

REPO = Path(__file__).resolve().parents[1]


def default_data_dir() -> Path:
    return cache_dir() / "dflash_engine_data"


def data_files(split: str, data: Path) -> list[Path]:
    """The shard files of ``split`` (``train`` / ``heldout``) in ``data`` (written by
    make_dflash_engine_data.py or make_dflash_data.py; rejected shards have none)."""
    # not the engine's raw ``<shard>.features.safetensors``: only shards the check stage passed
    return sorted(f for f in data.glob(f"{split}_*.safetensors") if not f.name.endswith(".features.safetensors"))


def load_split(split: str, data: Path, skip: set[str] = frozenset()) -> tuple[list[dict], dict, list[str]]:
    """Every sequence of ``split`` in ``data`` but those of the files named in ``skip``; returns
    ``(rows, metadata of the last file, names of the files read)``."""
    rows, meta = [], {}
    files = [f for f in data_files(split, data) if f.name not in skip]
    if not files and not skip:
        raise FileNotFoundError(f"no {split} data in {data}: run scripts/make_dflash_engine_data.py "
                                "(or scripts/make_dflash_data.py with --data <cache>/dflash_data)")
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            meta = h.metadata()
            n = len([k for k in h.keys() if k.startswith("ids.")])
            for j in range(n):
                rows.append({"ids": h.get_tensor(f"ids.{j}"), "features": h.get_tensor(f"features.{j}"),
                             "prompt_len": int(h.get_tensor(f"prompt_len.{j}")[0]), "sampled": meta["sampled"]})
    return rows, meta, [f.name for f in files]


def data_record(data: Path) -> dict:
    """How the data was made, for the model card: ``{generator, decoding, seconds, threads,
    new_tokens, engine}`` from the engine data's ``manifest.json`` or make_dflash_data.py's
    ``record.json`` (an empty dict when neither exists)."""
    if (data / "manifest.json").exists():
        m = json.loads((data / "manifest.json").read_text())
        sh = m.get("shards", {})
        eng = sorted({f"vllm {v['vllm_version']}" for v in sh.values()})
        thr = sorted({v.get("engine_threads") for v in sh.values()} - {None})
        rejected = sorted(k for k, v in sh.items() if not v["verdict"]["passed"])
        return {"generator": "scripts/make_dflash_engine_data.py", "engine": ", ".join(eng),
                "decoding": "2 of 3 shards greedy, 1 of 3 sampled at T=0.7; held-out greedy",
                "new_tokens": "160-256 (drawn per request)", "threads": thr[0] if len(thr) == 1 else thr,
                "engine_seconds": sum(v["generate_seconds"] for v in sh.values()),
                "check_seconds": sum(v["verdict"]["forward_seconds"] for v in sh.values()),
                "seconds": sum(v["generate_seconds"] + v["verdict"]["forward_seconds"] for v in sh.values()),
                "rejected_shards": rejected,
                "checks": {k: {kk: v["verdict"].get(kk) for kk in ("check", "tokens", "mismatches", "ties", "p_value",
                                                                    "passed")} for k, v in sorted(sh.items())}}
    if (data / "record.json").exists():
        r = json.loads((data / "record.json").read_text())
        return {"generator": "scripts/make_dflash_data.py", "engine": "the lab (transformers generate)",
                "decoding": r.get("decoding", "2 of 3 batches greedy, 1 of 3 sampled at T=0.7"),
                "new_tokens": str(r.get("new_tokens")), "threads": r.get("threads"), "seconds": r.get("seconds")}
    return {}


def make_batch(rows: list[dict], batch: int, blocks: int, L: int, rng: random.Random):
    """Sample a training batch (module docstring, step 2): ``batch`` sequences, ``blocks``
    random anchors in the generated part of each. Returns :func:`blocks_for`'s tensors."""
    chosen = rng.sample(rows, batch)
    anchors = []
    for r in chosen:
        lo, hi = max(1, r["prompt_len"]), r["ids"].shape[0] - 2
        anchors.append([rng.randint(lo, hi) for _ in range(blocks)] if hi >= lo else [hi] * blocks)
    return blocks_for(chosen, anchors, L)


def blocks_for(chosen: list[dict], anchors: list[list[int]], L: int):
    """The blocks anchored at ``anchors[b]`` in sequence ``chosen[b]`` (the same count per sequence).

    Returns ``(features [B, C, kH], ctx_pos [B, C], block_ids [B, nb*L], block_pos [B, nb*L],
    mask [B, nb*L, C + nb*L] bool, labels [B, nb, L-1] (-1 = none))``.
    """
    batch, blocks = len(chosen), len(anchors[0])
    c_max = max(r["features"].shape[0] for r in chosen)
    kh = chosen[0]["features"].shape[1]
    feats = torch.zeros(batch, c_max, kh, dtype=torch.float16)
    block_ids = torch.zeros(batch, blocks * L, dtype=torch.int64)
    block_pos = torch.zeros(batch, blocks * L, dtype=torch.int64)
    mask = torch.zeros(batch, blocks * L, c_max + blocks * L, dtype=torch.bool)
    labels = torch.full((batch, blocks, L - 1), -1, dtype=torch.int64)
    for b, r in enumerate(chosen):
        ids, t = r["ids"], r["ids"].shape[0]
        feats[b, : r["features"].shape[0]] = r["features"]
        for j, a in enumerate(anchors[b]):
            s = slice(j * L, (j + 1) * L)
            block_ids[b, s] = ids[a]  # position 0: the anchor; the rest are replaced by the mask
            block_pos[b, s] = torch.arange(a, a + L)
            mask[b, s, :a] = True
            mask[b, s, c_max + j * L : c_max + (j + 1) * L] = True
            n = min(L - 1, t - 1 - a)
            labels[b, j, :n] = ids[a + 1 : a + 1 + n]
    ctx_pos = torch.arange(c_max)[None].expand(batch, -1)
    return feats, ctx_pos, block_ids, block_pos, mask, labels


@torch.no_grad()
def quick_eval(model, rows: list[dict], L: int, mask_token_id: int, embed: torch.Tensor, head: torch.Tensor,
               stride: int = 8) -> dict:
    """Held-out hit rates through the training path (full vocabulary): top-1 by position,
    top-8 at position 1 and the greedy chain accept length, over every ``stride``-th anchor.
    ``rows`` carry features scaled as in training. A cheap progress signal; the model card's
    figures come from :func:`ddtree_lab.models.dflash.block_hit_rates` on the exported weights."""
    was = model.training
    model.eval()
    hits = torch.zeros(L - 1)
    counts = torch.zeros(L - 1)
    top8 = 0
    taus = []
    for r in rows:
        t = r["ids"].shape[0]
        anchors = list(range(max(1, r["prompt_len"]), t - 1, stride))
        if not anchors:
            continue
        feats, ctx_pos, block_ids, block_pos, mask, labels = blocks_for([r], [anchors], L)
        tokens = block_ids.clone()
        tokens.view(1, len(anchors), L)[:, :, 1:] = mask_token_id
        h = model.block_forward(embed[tokens], block_pos, model.context_kv(feats.float(), ctx_pos), mask)
        logits = h.view(len(anchors), L, -1)[:, 1:] @ head.T  # [n, L-1, V]
        pred = logits.argmax(-1)
        lab = labels[0]
        ok = (pred == lab) & (lab >= 0)
        hits += ok.sum(0).float()
        counts += (lab >= 0).sum(0).float()
        top8 += (logits[:, 0].topk(8, dim=-1).indices == lab[:, :1]).any(-1).sum().item()
        lead = torch.cumprod(ok.int(), dim=1).sum(1)
        taus += (1 + lead).tolist()
    model.train(was)
    rates = (hits / counts.clamp(min=1)).tolist()
    return {"anchors": len(taus), "top1": [round(x, 3) for x in rates], "top8_pos1": round(top8 / max(1, len(taus)), 3),
            "chain_tau": round(sum(taus) / max(1, len(taus)), 3)}


def save_state(state_dir: Path, model, opt, feature_scale: torch.Tensor, info: dict) -> None:
    """The whole training state: ``state.safetensors`` (fp32 weights ``model.*``, AdamW moments
    ``exp_avg.*`` / ``exp_avg_sq.*``, ``feature_scale``) and ``state.json`` (step, seconds spent,
    logs, random state, arguments). Written to ``.partial`` files then renamed, the JSON last."""
    from safetensors.torch import save_file

    state_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().float().contiguous() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                tensors[f"{key}.{names[id(p)]}"] = st[key].contiguous()
    tensors["feature_scale"] = feature_scale.contiguous()
    save_file(tensors, str(state_dir / "state.safetensors.partial"))
    (state_dir / "state.safetensors.partial").rename(state_dir / "state.safetensors")
    (state_dir / "state.json.partial").write_text(json.dumps(info) + "\n")
    (state_dir / "state.json.partial").rename(state_dir / "state.json")


def load_state(state_dir: Path) -> dict:
    """What :func:`save_state` wrote: ``{"tensors": {...}, "json": {...}}``."""
    from safetensors.torch import load_file

    return {"tensors": load_file(str(state_dir / "state.safetensors")),
            "json": json.loads((state_dir / "state.json").read_text())}


def restore_optimizer(opt, model, tensors: dict, step: int) -> None:
    """Put the saved AdamW moments back (the step count is the run's step)."""
    for n, p in model.named_parameters():
        if f"exp_avg.{n}" in tensors:
            opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": tensors[f"exp_avg.{n}"].clone(),
                            "exp_avg_sq": tensors[f"exp_avg_sq.{n}"].clone()}


def save_curve(log: list[dict], path: Path, quick: list[dict] | None = None) -> None:
    """The training loss per step (and its EMA) and, on a second axis, the held-out hit rates
    of :func:`quick_eval` (top-1 and top-8 at the first position) over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in log]
    loss = [e["loss"] for e in log]
    smooth, acc = [], None
    for x in loss:
        acc = x if acc is None else 0.95 * acc + 0.05 * x
        smooth.append(acc)
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    ax.plot(steps, loss, color="#bbb", lw=0.8, label="loss per step")
    ax.plot(steps, smooth, color="#1f77b4", lw=1.8, label="loss, EMA 0.95")
    ax.set_xlabel("step")
    ax.set_ylabel("weighted CE (sampled softmax)")
    ax.set_title("DFlash drafter for SmolLM2-135M-Instruct: training")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if quick:
        ax2 = ax.twinx()
        qs = [q["step"] for q in quick]
        ax2.plot(qs, [q["top1"][0] for q in quick], "o-", color="#d62728", ms=3, label="held-out top-1, position 1")
        ax2.plot(qs, [q["top8_pos1"] for q in quick], "s-", color="#2ca02c", ms=3, label="held-out top-8, position 1")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("held-out hit rate")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def card_json(record: dict) -> str:
    """The model card as JSON, one key per line but the held-out token ids on one line."""
    ev = record["held_out_eval"]
    text = json.dumps({**record, "held_out_eval": {**ev, "sequences": "@SEQUENCES@"}}, indent=1)
    return text.replace('"@SEQUENCES@"', json.dumps(ev["sequences"])) + "\n"


def write_card_md(record: dict, path: Path) -> None:
    """The model card as Markdown (the JSON beside it is the source)."""
    ev = record["held_out_eval"]
    a, d, r = record["architecture"], record["data"], record["recipe"]
    rows = " | ".join(f"{x:.2f}" for x in ev["top1_by_position"])
    engine_part = (f" (engine {d['engine_minutes']} min, the lab's checks and features {d['check_minutes']} min)"
                   if d.get("engine_minutes") is not None and "check_minutes" in d else "")
    checks = d.get("checks") or {}
    greedy = [c for c in checks.values() if c.get("mismatches") is not None]
    sampled = [c for c in checks.values() if c.get("p_value") is not None]
    pvals = ", ".join(f"{c['p_value']:.2g}" for c in sampled)
    checks_part = ""
    if checks:
        checks_part = (f" Every shard was checked against the lab's own target before training: greedy shards "
                       f"token for token, teacher-forced, on every 4th request ({sum(c['tokens'] for c in greedy)} "
                       f"tokens, {sum(c['mismatches'] for c in greedy)} mismatches, {sum(c['ties'] or 0 for c in greedy)} "
                       f"ties); sampled shards by the PIT of each token under the target's T = 0.7 law (KS p-values "
                       f"{pvals}). Rejected shards: "
                       f"{', '.join(d.get('rejected_shards') or []) or 'none'}.")
    text = f"""# {record['name']}: DFlash drafter for {record['target']}

A DFlash block drafter (KV injection of target features, block size {a['block_size']}) trained on this
project's CPU machine by `scripts/train_dflash.py`; weights in the public DFlash checkpoint layout
(`config.json`, `model.safetensors`, {a['weights_dtype']}). Load with
`DFlashDrafter.load(target)` (`ddtree_lab.models.dflash`).

- Architecture: {a['layers']} Qwen3-style layer(s), {a['parameters'] / 1e6:.2f} M parameters; context = target
  layers {a['target_layer_ids']} (outputs, HF `hidden_states[l + 1]`), projected by `fc`; mask token
  `{a['mask_token']}` (id {a['mask_token_id']}); the target's embedding and LM head are shared and frozen.
- Data: self-distillation. The target answered {d['train_sequences']} training prompts
  (`{d['prompts']}`, {d['new_tokens_per_prompt']} new tokens; {d['decoding']}) through {d.get('engine') or 'the lab'},
  {d['train_tokens']} tokens in all ({d.get('train_generated_tokens', '?')} generated, the rest prompts); made by
  `{d['generator']}` in {d['generation_minutes']} min on {d['generation_threads']} CPU thread(s){engine_part}.
  {d['held_out_sequences']} held-out prompts (other topics and templates) were answered greedily for evaluation
  only.{checks_part}
- Recipe: {('initialised from `' + r['init'] + '` (the previous drafter), then ') if r.get('init') else ''}{r['batch']} sequences x {r['blocks']} random anchors per step, loss weight exp(-(k-1)/{r['gamma']}),
  lr {r['lr']} ({r['optimizer']}), sampled softmax (the data's {r.get('softmax_tokens', 'all')} most frequent tokens + the batch's labels + {r['negatives']} random negatives).
- Run: {record['steps']} steps in {record['train_minutes']} min on {record['threads']} CPU thread(s); final loss (EMA)
  {record['final_loss_ema']}; data generation and training together {record['total_minutes']} min.
  Loss curve: `{record.get('curve', 'docs/dflash_loss.png')}`.

## Measured on held-out text ({ev['anchors']} anchors in {len(ev['sequences'])} sequences, every {ev['stride']}th position)

Top-1 hit rate of the argmax block by position k = 1..{len(ev['top1_by_position'])}:

{rows}

Greedy chain accept length (1 + leading hits): **{ev['chain_tau']}**. `tests/test_dflash.py` reproduces these
figures from the shipped weights. Live τ with DDTree trees: `benchmarks/live_tau.out.txt`.
"""
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(default_dflash_path()))
    ap.add_argument("--minutes", type=float, default=45.0, help="wall-clock training budget")
    ap.add_argument("--checkpoint-minutes", type=float, default=6.0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=16, help="anchors per sequence per step")
    ap.add_argument("--gamma", type=float, default=4.0, help="loss weight exp(-(k-1)/gamma)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--negatives", type=int, default=1024)
    ap.add_argument("--softmax-tokens", type=int, default=8192,
                    help="the sampled softmax always holds the data's most frequent tokens, this many")
    ap.add_argument("--eval-sequences", type=int, default=16, help="held-out sequences in the recorded hit rate")
    ap.add_argument("--eval-checkpoints", action="store_true",
                    help="also measure the held-out hit rate at intermediate checkpoints (costs CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: ddtree_lab.threads' choice for this machine)")
    ap.add_argument("--eval-minutes", type=float, default=2.0,
                    help="print held-out hit rates (quick_eval) this often")
    ap.add_argument("--data", default=None, help="data directory (default: <cache>/dflash_engine_data)")
    ap.add_argument("--state", default=None, help="training state directory (default: <cache>/dflash_train_state)")
    ap.add_argument("--resume", action="store_true", help="continue the run saved in --state")
    ap.add_argument("--curve", default=str(REPO / "docs" / "dflash_loss.png"), help="where the loss curve goes")
    ap.add_argument("--init", default=None,
                    help="start from this DFlash checkpoint directory (same layers and block size) instead of random weights")
    ap.add_argument("--reload-minutes", type=float, default=5.0, help="look for new data shards this often")
    args = ap.parse_args()
    data = Path(args.data) if args.data else default_data_dir()
    state_dir = Path(args.state) if args.state else cache_dir() / "dflash_train_state"
    if args.resume and not (state_dir / "state.json").exists():
        ap.error(f"--resume: no training state in {state_dir} (state.json)")
    for name, ok, rule in (
            ("minutes", args.minutes > 0, "> 0"), ("checkpoint_minutes", args.checkpoint_minutes > 0, "> 0"),
            ("eval_minutes", args.eval_minutes > 0, "> 0"), ("layers", args.layers >= 1, ">= 1"),
            ("block_size", args.block_size >= 2, ">= 2"), ("batch", args.batch >= 1, ">= 1"),
            ("blocks", args.blocks >= 1, ">= 1"), ("gamma", args.gamma > 0, "> 0"), ("lr", args.lr > 0, "> 0"),
            ("warmup", args.warmup >= 1, ">= 1"), ("negatives", args.negatives >= 0, ">= 0"),
            ("softmax_tokens", args.softmax_tokens >= 1, ">= 1"),
            ("eval_sequences", args.eval_sequences >= 1, ">= 1"), ("reload_minutes", args.reload_minutes > 0, "> 0"),
            ("threads", args.threads is None or args.threads >= 1, ">= 1")):
        value = getattr(args, name)
        if not ok or (isinstance(value, float) and not math.isfinite(value)):  # nan fails every comparison
            ap.error(f"--{name.replace('_', '-')} must be {rule}, got {value}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    else:
        from ddtree_lab.threads import configure_threads
        configure_threads()
    threads = torch.get_num_threads()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    for split in ("train", "heldout"):
        if not data_files(split, data):
            ap.error(f"no {split} data in {data}: run scripts/make_dflash_engine_data.py first")
    t_start = time.time()
    target = load_default_target()
    for p in target.model.parameters():
        p.requires_grad_(False)
    rows, meta, files_read = load_split("train", data)
    held, _, _ = load_split("heldout", data)
    layer_ids = json.loads(meta["layer_ids"])
    made = data_record(data)
    # Preconditioning of fc: the target's features span four orders of magnitude per dimension
    # (massive activations up to ~2e4 on a few dimensions), which makes Adam's steps on fc swamp
    # the context with noise. Training therefore sees every feature dimension divided by its RMS
    # over the training text, and the exported fc.weight is divided by the same scale, so the
    # shipped drafter reads the raw features (the public architecture, unchanged).
    saved = load_state(state_dir) if args.resume else None
    if saved is not None:
        feature_scale = saved["tensors"]["feature_scale"]
    else:
        sq = torch.zeros(rows[0]["features"].shape[1], dtype=torch.float64)
        count = 0
        for r in rows:
            sq += r["features"].double().pow(2).sum(0)
            count += r["features"].shape[0]
        feature_scale = (sq / count).sqrt().float().clamp(min=1e-2)
    for r in rows:
        r["features"] = (r["features"].float() / feature_scale).to(torch.float16)
    held_scaled = [dict(r, features=(r["features"].float() / feature_scale).to(torch.float16)) for r in held]
    tcfg = target.model.config
    L = args.block_size
    mask_token_id = target.tokenizer.convert_tokens_to_ids("<empty_output>")
    cfg = DFlashConfig(hidden_size=tcfg.hidden_size, num_hidden_layers=args.layers,
                       num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
                       head_dim=tcfg.head_dim, intermediate_size=tcfg.intermediate_size, block_size=L,
                       mask_token_id=int(mask_token_id), target_layer_ids=layer_ids,
                       rope_theta=float(tcfg.rope_parameters["rope_theta"]), rms_norm_eps=float(tcfg.rms_norm_eps),
                       num_target_layers=int(tcfg.num_hidden_layers),
                       extra={"architectures": ["DFlashDraftModel"], "model_type": "qwen3"})
    model = DFlashDraftModel(cfg)
    for _name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    with torch.no_grad():  # the output feeds the target's LM head: start at a tenth of its final-norm scale (small logits)
        model.norm.weight.copy_(0.1 * target.model.model.norm.weight)
    init_label = None
    if args.init:  # where the weights started: a path in this repository is named with its commit
        ip = Path(args.init).resolve()
        init_label = args.init
        if ip.is_relative_to(REPO):
            import subprocess

            rev = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h", "--", str(ip)],
                                 capture_output=True, text=True).stdout.strip()
            init_label = f"{ip.relative_to(REPO)}" + (f" at commit {rev}" if rev else "")
    if args.init and saved is None:
        init = DFlashDrafter.load(target, args.init, dtype=torch.float32).model
        if (init.config.num_hidden_layers, init.config.block_size) != (args.layers, L):
            raise SystemExit(f"--init {args.init}: {init.config.num_hidden_layers} layers, block size "
                             f"{init.config.block_size}; this run asks {args.layers}, {L}")
        model.load_state_dict(init.state_dict())
        with torch.no_grad():  # the checkpoint's fc reads raw features; training feeds them divided by the scale
            model.fc.weight.mul_(feature_scale[None, :])
        print(f"initialised from {args.init}", flush=True)
    head = target.model.get_output_embeddings().weight.detach()  # [V, H], frozen (tied to the embedding)
    embed = target.model.get_input_embeddings().weight.detach()
    def softmax_vocab(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``--softmax-tokens`` most frequent tokens of the data, and every other token."""
        counts = torch.bincount(torch.cat([r["ids"] for r in rows]), minlength=head.shape[0])
        k = min(args.softmax_tokens, int((counts > 0).sum()))
        vocab = torch.sort(torch.topk(counts, k).indices).values
        in_vocab = torch.zeros(head.shape[0], dtype=torch.bool)
        in_vocab[vocab] = True
        return vocab, torch.nonzero(~in_vocab)[:, 0]

    vocab, outside = softmax_vocab(rows)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    weights = torch.exp(-torch.arange(L - 1, dtype=torch.float32) / args.gamma)
    budget = args.minutes * 60
    out_dir = Path(args.out)
    log: list[dict] = []
    evals: list[dict] = []
    eval_seqs = [(r["ids"].tolist(), r["prompt_len"]) for r in held[: args.eval_sequences]]
    eval_feats = [target_features(target, ids, layer_ids) for ids, _ in eval_seqs]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{len(rows)} training sequences ({sum(r['ids'].numel() for r in rows)} tokens), {len(held)} held-out; "
          f"target layers {layer_ids}; drafter {args.layers} layers, {n_params / 1e6:.2f} M parameters; "
          f"softmax over the {vocab.numel()} most frequent data tokens + labels + {args.negatives} negatives", flush=True)

    def checkpoint(step: int, final: bool = False) -> dict:
        export = copy.deepcopy(model).eval()
        with torch.no_grad():
            export.fc.weight.div_(feature_scale[None, :])  # back to raw target features
        drafter = DFlashDrafter(target, export, name="smollm2-dflash-b16")
        drafter.save(out_dir)
        if final or args.eval_checkpoints:
            # Evaluate the fp16 weights as shipped (reloaded), through the drafter's own lifecycle.
            shipped = DFlashDrafter.load(target, out_dir, dtype=torch.float32)
            rates = block_hit_rates(shipped, eval_seqs, stride=4, features=eval_feats)
            evals.append({"step": step, "minutes": round(spent() / 60, 2), **rates})
        else:
            rates = evals[-1] if evals else {"anchors": 0, "top1_by_position": [], "chain_tau": None}
            rates = {k: rates[k] for k in ("anchors", "top1_by_position", "chain_tau")}
        model.train()
        record = {
            "name": "smollm2-dflash-b16", "target": target.name, "kind": "DFlash (KV injection), trained here",
            "final": final, "steps": step, "train_minutes": round(spent() / 60, 2),
            "total_minutes": round(spent() / 60 + made.get("seconds", float("nan")) / 60, 1),
            "architecture": {"layers": args.layers, "block_size": L, "target_layer_ids": layer_ids,
                             "mask_token": "<empty_output>", "mask_token_id": int(mask_token_id),
                             "parameters": n_params, "weights_dtype": "float16"},
            "data": {"generator": made.get("generator"), "engine": made.get("engine"),
                     "prompts": "fixtures/drafters/dflash_prompts.json",
                     "train_sequences": len(rows), "train_tokens": int(sum(r["ids"].numel() for r in rows)),
                     "train_generated_tokens": int(sum(r["ids"].numel() - r["prompt_len"] for r in rows)),
                     "new_tokens_per_prompt": made.get("new_tokens", meta.get("new_tokens")),
                     "decoding": made.get("decoding"), "held_out_sequences": len(held),
                     "generation_minutes": round(made.get("seconds", float("nan")) / 60, 2),
                     "engine_minutes": round(made.get("engine_seconds", float("nan")) / 60, 2),
                     "check_minutes": round(made.get("check_seconds", float("nan")) / 60, 2),
                     "generation_threads": made.get("threads"), "rejected_shards": made.get("rejected_shards", []),
                     "checks": made.get("checks", {}), "files": len(files_read)},
            "recipe": {k: getattr(args, k) for k in ("minutes", "batch", "blocks", "gamma", "lr", "warmup", "negatives",
                                                     "softmax_tokens", "seed")}
                      | {"init": init_label,
                         "optimizer": "AdamW(0.9, 0.95), wd 0.01, grad clip 1.0, warm-up + cosine over the time budget",
                         "loss": "CE weighted exp(-(k-1)/gamma), sampled softmax (frequent data tokens + the batch's labels + random negatives)",
                         "preconditioning": "fc trained on features divided by their per-dimension RMS; exported fc.weight divided by the same scale"},
            "final_loss_ema": round(ema, 4) if ema is not None else None,
            "held_out_eval": {"sequences": eval_seqs, "stride": 4, **rates},
            "evals": evals, "quick_evals": quick, "threads": threads,
            "curve": str(Path(args.curve).resolve().relative_to(REPO)) if Path(args.curve).resolve().is_relative_to(REPO)
            else args.curve,
        }
        (out_dir / "model_card.json").write_text(card_json(record))
        write_card_md(record, out_dir / "MODEL_CARD.md")
        (out_dir / "train_log.json").write_text(json.dumps(log) + "\n")
        save_state(state_dir, model, opt, feature_scale, {
            "step": step, "train_seconds": spent(), "log": log, "quick": quick, "evals": evals,
            "python_rng": rng.getstate(), "args": {k: v for k, v in vars(args).items() if k != "resume"},
            "layers": args.layers, "block_size": L, "files_read": files_read})
        save_curve(log, Path(args.curve), quick)
        tqdm.write(f"checkpoint step {step}: held-out top-1 by position {rates['top1_by_position'][:6]}..., "
                   f"chain tau {rates['chain_tau']}" + ("" if final or args.eval_checkpoints else " (last measured)"))
        return record

    quick: list[dict] = []
    ema = None
    step = 0
    spent_before = 0.0
    if saved is not None:
        j = saved["json"]
        if (j["layers"], j["block_size"]) != (args.layers, L):
            raise SystemExit(f"--resume: the saved run has {j['layers']} layers, block size {j['block_size']}; "
                             f"this one asks {args.layers}, {L}")
        model.load_state_dict({k[len("model."):]: v for k, v in saved["tensors"].items() if k.startswith("model.")})
        restore_optimizer(opt, model, saved["tensors"], j["step"])
        step, spent_before, log, quick, evals = j["step"], j["train_seconds"], j["log"], j["quick"], j["evals"]
        rng.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in j["python_rng"]))
        ema = log[-1]["loss"] if log else None
        print(f"resumed at step {step} after {spent_before / 60:.1f} min of training", flush=True)
    t_train = time.time()

    def spent() -> float:
        return spent_before + time.time() - t_train

    next_ckpt = t_train + args.checkpoint_minutes * 60
    next_eval = t_train + args.eval_minutes * 60
    next_reload = t_train + args.reload_minutes * 60
    bar = tqdm(desc="training", unit="step", mininterval=5)
    model.train()
    while True:
        frac = spent() / budget
        if frac >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        feats, ctx_pos, block_ids, block_pos, mask, labels = make_batch(rows, args.batch, args.blocks, L, rng)
        tokens = block_ids.clone()
        tokens.view(args.batch, args.blocks, L)[:, :, 1:] = mask_token_id
        ctx_kv = model.context_kv(feats.float(), ctx_pos)
        hidden = model.block_forward(embed[tokens], block_pos, ctx_kv, mask)
        hidden = hidden.view(args.batch, args.blocks, L, -1)[:, :, 1:]  # [B, nb, L-1, H]
        negatives = outside[torch.randint(outside.numel(), (args.negatives,))]
        # the frequent tokens, this batch's labels (a rare one too) and the random negatives
        sub = torch.unique(torch.cat([vocab, labels[labels >= 0], negatives]))
        lookup = torch.full((head.shape[0],), -1, dtype=torch.int64)
        lookup[sub] = torch.arange(sub.numel())
        logits = hidden @ head[sub].T
        valid = labels >= 0
        target_idx = lookup[labels.clamp(min=0)]
        ce = torch.nn.functional.cross_entropy(logits[valid], target_idx[valid], reduction="none")
        w = weights.expand_as(labels)[valid]
        loss = (ce * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        log.append({"step": step, "loss": round(loss.item(), 4), "lr": lr, "t": round(spent(), 1)})
        bar.update()
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.2e}", min=f"{spent() / 60:.1f}")
        if time.time() >= next_reload:  # shards the data stage finished since the last look
            new, _, new_files = load_split("train", data, skip=set(files_read))
            if new:
                for r in new:
                    r["features"] = (r["features"].float() / feature_scale).to(torch.float16)
                rows += new
                files_read += new_files
                vocab, outside = softmax_vocab(rows)
                tqdm.write(f"added {len(new_files)} shard(s): {len(rows)} sequences, "
                           f"{sum(r['ids'].numel() for r in rows)} tokens")
            next_reload = time.time() + args.reload_minutes * 60
        if time.time() >= next_eval:
            q = quick_eval(model, held_scaled, L, int(mask_token_id), embed, head)
            quick.append({"step": step, "minutes": round(spent() / 60, 2), "sequences": len(rows), **q})
            tqdm.write(f"step {step} ({quick[-1]['minutes']} min) loss {ema:.3f}: held-out top-1 {q['top1'][:4]} "
                       f"top-8@1 {q['top8_pos1']} chain tau {q['chain_tau']}")
            next_eval = time.time() + args.eval_minutes * 60
        if time.time() >= next_ckpt:
            checkpoint(step)
            next_ckpt = time.time() + args.checkpoint_minutes * 60
    bar.close()
    record = checkpoint(step, final=True)
    print(json.dumps({k: record[k] for k in ("steps", "train_minutes", "final_loss_ema")}), flush=True)
    print(f"total {(time.time() - t_start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
