"""Write labs/03_greedy_vs_sampling.ipynb and labs/04_topk_topp_tuner.ipynb from their cell
sources (the builder and executor of scripts/make_notebooks.py), then execute them in place.

    python scripts/make_notebooks_tuner.py [--no-execute] [names...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from notebook_outputs import execute

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_notebooks import LABS, build

SETUP = """import torch
torch.set_num_threads(1)  # the lab's machines are small and shared
import plotly.io as pio
pio.renderers.default = "plotly_mimetype"  # JupyterLab renders the figures; the notebook stays small
import ddtree_lab as dl
from ddtree_lab import notebook
from IPython.display import HTML, SVG, display"""

GREEDY_VS_SAMPLING = [
    ("md", """# 03 · Greedy against temperature sampling on one live batch

One live batch on the embedded default target (SmolLM2-135M-Instruct) with its DFlash drafter,
the **same prompt** under three settings: greedy (T = 0), T = 0.7, and T = 1.0 with top-p 0.9.
Every figure below reads the recorded `Step`s only (`ddtree_lab.views.compare`), so the
same cells work on a loaded trace file.

Words: *accept length* counts accepted draft tokens; *τ* = accept length + 1 (the bonus
token). The **exact expected accept length** of a step's tree under the target-only rule is
the sum over its nodes of the product of target probabilities along each node's path; no
lossless verifier can beat it on that tree. The **drafter's estimate** is the same sum with the
drafter's path probabilities: the gap between the two is the drafter's calibration."""),
    ("code", SETUP + """
from ddtree_lab.views import compare

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the device choice: "cpu" stays on the CPU
target, drafter = notebook.load_default(device=DEVICE)
settings = [dl.SamplingParams(temperature=0.0),
            dl.SamplingParams(temperature=0.7, seed=1),
            dl.SamplingParams(temperature=1.0, top_p=0.9, seed=2)]
prompt = "Explain why the sky is blue in two sentences."
session = dl.LiveSession(target, drafter, budget=32, sampling=settings)
run = session.run([prompt] * len(settings), max_new_tokens=24)
HTML(compare.summary_html(run))"""),
    ("md", "## τ per step and its distribution"),
    ("code", "compare.tau_figure(run)"),
    ("code", "compare.tau_distribution_figure(run)"),
    ("md", """## Calibration: observed, exact expected, drafter's estimate

Greedy rows are one-hot, so for T = 0 the exact expectation equals what was accepted. For
sampled requests the observed value scatters around the exact expectation; the drafter's
estimate sits above it where the drafter is over-confident."""),
    ("code", "compare.calibration_figure(run)"),
    ("md", "## Acceptance by depth and which sibling was accepted"),
    ("code", "compare.acceptance_figure(run)"),
    ("code", "compare.sibling_rank_figure(run)"),
    ("md", """## Sibling-conditioned drafter quality

How often the drafter's best token at depth d+1 is the token the target emits there, split by
whether the node accepted at depth d was the drafter's rank-0 token or a lower-ranked sibling.
A block drafter proposes all depths at once, implicitly assuming its own top tokens, so its
quality tends to drop after a lower sibling is accepted."""),
    ("code", "compare.sibling_quality_figure(run)"),
    ("md", "## Tokens per second (from the recorded stage timings)"),
    ("code", "compare.throughput_figure(run)"),
    ("md", "## The trees of one step, one per request (each scrolls sideways when wide)"),
    ("code", "HTML(compare.trees_html(run, step=1))"),
    ("md", """## Does a sampled request look greedy?

A sampled request whose emitted tokens were *all* the target argmax is suspicious (a serving
engine that verifies sampled requests greedily produces exactly this). The table gives the
probability of that under the request's own law if the verifier is lossless; a request is
flagged when it is below 10⁻³ over at least 16 tokens."""),
    ("code", "HTML(compare.looks_greedy_html(run))"),
]

TUNER = [
    ("md", """# 04 · Top-k / top-p / budget tuner on a recorded run

Move the sliders: the tuner re-analyses every recorded step of a trace (format v2) under the
chosen temperature, top-k, top-p, min-p and budget B' ≤ the recorded B, **without running a
model**: per step and on average the exact expected τ under the target-only rule, the target
mass the tree covers at each depth, and the selected step's tree with each node's target
probability `p` and its reach probability (the chance the walk accepts it). Pick the step as in
the verify stepper: a **request**, then a **step** among that request's steps; the per-step
chart marks it in red, separates the requests, and keeps its y axis fixed (the largest
possible τ) so bars compare across settings.

The trace stores each row's top-64 raw logits, every node's own logit and the row's
log-sum-exp. Whatever depends only on the top 64 (every top-k ≤ 64, at any temperature, and
top-p / min-p cuts inside them) is exact; elsewhere the value shown is the midpoint ± half of
the interval the stored data allow (a rigorous bound: `ddtree_lab.analysis.token_prob_bounds`).

The budget works from one recording because the first B' nodes of a best-first tree are
exactly the tree of budget B'. The button re-runs the prompts live with the chosen parameters
(through the function below, the widget never touches a model) and shows the observed τ beside
the predicted one."""),
    ("code", SETUP + """
from pathlib import Path
from ddtree_lab.views.tuner import Tuner

run = dl.load_trace(Path("..") / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors")
print(f"{len(run.steps)} recorded steps, {len(run.metadata['requests'])} requests, "
      f"recorded B = {run.metadata['budget']}")"""),
    ("code", """target, drafter = notebook.load_default(drafter="ridge")  # the drafter the fixture trace was recorded with
prompts = [r["prompt"] for r in run.metadata["requests"]][:1]

def live(params, budget):
    \"\"\"Re-run the first recorded prompt live (24 tokens) with the tuner's parameters.\"\"\"
    session = dl.LiveSession(target, drafter, budget=max(budget, 1), sampling=params)
    return session.run(prompts, max_new_tokens=24)

tuner = Tuner(run, live=live)
tuner"""),
    ("md", "The same numbers without widgets (what a test or a script reads):"),
    ("code", """from ddtree_lab.views.tuner import expected_tau_text
for p in [dl.SamplingParams(temperature=0.8), dl.SamplingParams(temperature=0.8, top_k=20),
          dl.SamplingParams(temperature=1.0, top_p=0.9), dl.SamplingParams(temperature=0.0)]:
    for budget in (32, 8):
        print(f"{p.label():<24} B'={budget:<3} expected τ = {expected_tau_text(tuner.state.data, p, budget)}")"""),
    ("md", "Pressing the button (here from code) runs the live re-run and shows observed against predicted:"),
    ("code", """tuner.live_button.click()
HTML(tuner.live_out.value)"""),
    ("md", """## Which tree? Tree policies compared on the same steps

The sliders above re-analyse the recorded tree. The picker below asks the bigger question: on
recorded steps, what would **another tree** have given? Its steps are a fresh live recording
with the lab's default DFlash drafter (the drafter of `benchmarks/tree_policies.json`; the
fixture trace above was recorded with the weaker ridge drafter): 4 held-out prompts, 32 new
tokens, T = 0.8, DDTree at B = 32. For each step and each policy of
`ddtree_lab.analysis.policies` (DDTree best-first, the chain, beams, a per-depth cap, the
cost-driven budget) the policy's tree is built from the step's recorded draft and its **exact**
E[τ] computed under the target-only rule (`ddtree_lab.analysis.counterfactual`): from the
recorded rows where the recording covers the tree, else from ONE target tree forward per step
over the union of all the trees. This cell runs the model once; the picker only reads the
results. The tokens/s panel reads `benchmarks/tree_policies.json` (the benchmark's measured
cost model and its live runs), with plain decoding and the chain as horizontal lines.

A counterfactual from one recorded trajectory is biased: the benchmark prints it beside the
live τ of each policy (`bias`).

**Why the chain has 15 nodes at B = 16 (and at B = 32).** The drafter is a block drafter of
L = 16: from the anchor it predicts the L-1 = 15 tokens after it, one position each. The chain
places one node per position (`policies.chain_policy` builds `min(B, L-1)` nodes), so it never
has more than 15 nodes; the picker's summary line says so whenever a policy's trees have
fewer nodes than B. The tree policies also spend the budget on siblings, so they place more."""),
    ("code", """from ddtree_lab.analysis import policies, counterfactual
from ddtree_lab.views.policies import PolicyPicker, load_policy_records

import json
dflash = notebook.load_drafter(target, "dflash")  # the default drafter, on the same target
held_out = json.loads((Path("..") / "fixtures" / "drafters" / "dflash_prompts.json").read_text())["held_out"][:4]
rec = dl.LiveSession(target, dflash, budget=32, sampling=dl.SamplingParams(temperature=0.8, seed=1)).run(held_out, max_new_tokens=32)
sub = dl.Run(metadata=rec.metadata, steps=rec.steps[:12], token_texts=rec.token_texts)
bench = Path("..") / "benchmarks" / "tree_policies.json"
meta, rows = load_policy_records(bench) if bench.exists() else (None, None)
cm = (policies.CostModel.from_dict(meta["cost_model"]) if meta else
      counterfactual.measure_cost_model(target, counterfactual.step_prefix_ids(sub, sub.steps[0]) + [int(sub.steps[0].node_token_ids[0])],
                                        sub.steps[0].draft, (1, 9, 33), repeats=1))
context = policies.PolicyContext(cost_model=cm)
results = counterfactual.run_counterfactuals(sub, list(policies.POLICIES), [4, 8, 16, 32], target=target, context=context)
picker = PolicyPicker(results, texts=sub, rows=rows, plain_tok_s=meta and meta["plain_tok_s"])
picker"""),
    ("md", """### The same steps, a GPU's cost

Whether a tree pays depends on what a wider forward costs. `benchmarks/tree_policies.h200.json`
holds the same exact E[τ] (the recordings and the target are this CPU's; τ does not depend on
the device) with the cost measured on one NVIDIA H200 (`scripts/gpu_check.sh`, eager PyTorch
and transformers in fp32, the architecture timed with random weights). There a tree forward
is bound by kernel launches, not by N: up to N = 129 rows its cost moves less with N than
between two runs, so the comparison with plain decoding turns around (the dashed line). Which
budget is best there is inside that noise; `docs/BENCHMARKS.md` gives both runs. The `cost`
policy builds other trees under that cost model: its markers are its own live runs."""),
    ("code", """from ddtree_lab.views.policies import tokens_per_second_figure

h200 = Path("..") / "benchmarks" / "tree_policies.h200.json"
if h200.exists():
    meta_h200, rows_h200 = load_policy_records(h200)
    display(tokens_per_second_figure(rows_h200, meta_h200["plain_tok_s"],
                                     title=f"Expected tokens/s against budget, cost measured on {meta_h200['cost_device']}"))
else:
    print(f"no H200 panel: {h200} is not here (it is in the repository's benchmarks/, beside labs/)")"""),
    ("md", """### Your own policy in about twenty lines

A policy is a plain function `(draft, anchor_token_id, budget, context) -> DDTreeBuildResult`.
Here: DDTree's best-first tree, cut where a node's drafter path probability falls below a
floor (a log-weight floor; the nodes left are still closed under "parent", since a path's
log-weight only falls with depth). The same counterfactual scores it beside the built-in ones."""),
    ("code", """import math
from ddtree_lab.build import DDTreeBuildResult

def floored_best_first(draft, anchor_token_id, budget, context=None, floor=math.log(0.02)):
    \"\"\"DDTree best-first, keeping only nodes whose path log-weight is >= floor.\"\"\"
    tree = policies.ddtree_policy(draft, anchor_token_id, budget, context)
    n = int(tree.num_nodes[0])
    keep = 1 + int((tree.node_logws[0, 1:n] >= floor).sum())  # tree order: log-weights never rise
    cut = lambda t: t[:, :keep]
    return DDTreeBuildResult(node_token_ids=cut(tree.node_token_ids), parents=cut(tree.parents),
                             depths=cut(tree.depths), ranks=cut(tree.ranks), node_logws=cut(tree.node_logws),
                             num_nodes=torch.tensor([keep]))

mine = {"floor2%": floored_best_first}
pick = lambda name: mine[name] if name in mine else policies.get_policy(name)
own = [r for s in sub.steps for r in counterfactual.step_counterfactuals(
    s, ["floor2%", "ddtree", "chain"], [8, 32], target=target, prefix_ids=counterfactual.step_prefix_ids(sub, s),
    context=context, policy_of=pick)]
for row in counterfactual.summarize(own):
    print(f"{row.policy:<8} B={row.budget:<3} mean nodes {row.mean_nodes:5.1f}  exact E[τ] sampled "
          f"{row.tau_sampled if row.tau_sampled is None else round(row.tau_sampled, 3)}")
PolicyPicker(own, texts=sub)"""),
]

NOTEBOOKS = {"03_greedy_vs_sampling.ipynb": GREEDY_VS_SAMPLING, "04_topk_topp_tuner.ipynb": TUNER}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--no-execute", action="store_true")
    ap.add_argument("names", nargs="*", help="notebooks to write (default: both)")
    args = ap.parse_args()
    for name, cells in NOTEBOOKS.items():
        if args.names and name not in args.names:
            continue
        nb = build(cells)
        if not args.no_execute:
            execute(nb, LABS, timeout=900)
        nbformat.write(nb, LABS / name)
        print(f"wrote labs/{name}")


if __name__ == "__main__":
    main()
