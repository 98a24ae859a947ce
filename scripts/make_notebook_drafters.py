"""Write labs/07_drafters.ipynb (DFlash against ridge: τ against budget, trees side by side) and
execute it in place so it carries static outputs.

    python scripts/make_notebook_drafters.py [--no-execute]
"""

from __future__ import annotations

from pathlib import Path

from notebook_outputs import main_for

LABS = Path(__file__).resolve().parent.parent / "labs"

CELLS = [
    ("md", """# 07 · Drafters: the DFlash drafter trained here against the ridge drafter

The embedded default target (SmolLM2-135M-Instruct, fp32, CPU) has two drafters of block size
L = 16:

* **DFlash** (`fixtures/drafters/smollm2_dflash_b16`, the lab's default): two Qwen3-style layers
  that read five of the target's layers by KV injection (`ddtree_lab/models/dflash.py`, the
  public DFlash architecture), trained on this CPU by `scripts/train_dflash.py` on 1.0M tokens
  of text the target wrote through vLLM's CPU engine (`scripts/make_dflash_engine_data.py`,
  every shard checked against the lab's own target first; see its model card);
* **ridge** (`fixtures/drafters/smollm2_ridge_b16.safetensors`): per-offset linear heads fitted in closed form,
  kept for comparison (the fixture traces in `fixtures/traces/` were recorded with it).

The figure shows the accept length τ (accepted draft tokens + 1 per step) that
`benchmarks/live_tau.py` measured on held-out prompts, for DDTree trees of budget B and for the
chain (the drafter's argmax block, DFlash's own verification). Below it, a live greedy run of
each drafter on the same prompt and each one's step that accepted most (the first such step):
compare how deep each tree's accepted path goes and how the drafter spread its budget."""),
    ("code", """import ddtree_lab as dl
from ddtree_lab import notebook
from ddtree_lab.models import RidgeDrafter
from ddtree_lab.views.tau import load_tau_records, tau_budget_figure

target, dflash = notebook.load_default()        # the default drafter: DFlash
ridge = RidgeDrafter.load(target)
card = dflash.record["held_out_eval"]
print(dflash.name, "| held-out top-1 by position:", card["top1_by_position"][:6], "| chain tau", card["chain_tau"])"""),
    ("md", "## τ against budget (measured by `benchmarks/live_tau.py`)"),
    ("code", """rows = load_tau_records("../benchmarks/live_tau.json")
tau_budget_figure(rows)"""),
    ("md", "## Each drafter live, greedy, budget 32: its step that accepted most"),
    ("code", """prompt = "Tell me something interesting about lighthouses."
runs = {}
for name, d in (("dflash", dflash), ("ridge", ridge)):
    runs[name] = dl.LiveSession(target, d, budget=32, sampling=dl.SamplingParams(temperature=0.0)).run(prompt, max_new_tokens=16)
    taus = [s.accept_length + 1 for s in runs[name].steps]
    print(f"{name:>6}: {len(taus)} steps, tau per step {taus}")"""),
    ("code", """from ddtree_lab import views

for name, run in runs.items():
    best = views.informative_step(run)
    print(f"{name}: step {best.step} accepted {best.accept_length} draft token{'s' if best.accept_length != 1 else ''} (tau {best.accept_length + 1})")
    notebook.show_step(run, run.steps.index(best))"""),
]


def main() -> None:
    main_for(__doc__, CELLS, LABS, "07_drafters.ipynb")


if __name__ == "__main__":
    main()
