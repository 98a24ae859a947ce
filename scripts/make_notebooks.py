"""Write the notebooks in labs/ from their cell sources, then execute them in place so they
carry static outputs (SVG trees, HTML text) that read without a kernel.

    python scripts/make_notebooks.py [--no-execute]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat
from notebook_outputs import execute

LABS = Path(__file__).resolve().parent.parent / "labs"

LIVE_STEP = [
    ("md", """# 01 · Live DDTree steps on the embedded default target

This notebook runs DDTree speculative decoding **live** on SmolLM2-135M-Instruct (the
embedded default target, fp32, on the GPU when there is one: `DEVICE` in the first cell) with the DFlash drafter trained for it (block size
L = 16; `fixtures/drafters/smollm2_dflash_b16`), first greedily, then at temperature 0.8, and draws every step.

How to read a step's tree (drawn left to right: depth grows to the right): each node shows
`#i`, its index (the `node` column of the decision tables), and its token, then `p`, the
**target p** (the target's probability of the token in its parent's row under the request's
sampling parameters; for greedy steps the softmax of the raw logits), `q`, the **drafter q**
(the drafter's probability of the token at its depth), and `r`, its rank among the drafter's
top-k. Siblings run top to bottom in sibling order (descending log-weight). **Green**: the
accepted path; **red, dashed**: siblings the verifier visited and rejected; grey notes:
subtrees the verifier never reached, with the count of hidden nodes; **blue box**: the bonus
token with its target p and its **residual p** (its probability renormalised within the
residual). Hover a node for every number.

Use: run all cells (a first run converts the GGUF weights once, about 40 s). Change the
prompt, the budget `B` or the sampling parameters in the cells below and run again; the
slider browses every step with its decision log (coin, cumulative mass, verdict); it opens on
the step where the walk accepted most. To walk
one step decision by decision, open `02_verify_stepper.ipynb`."""),
    ("code", """import torch
import ddtree_lab as dl
from ddtree_lab import notebook, views
from IPython.display import HTML

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the device choice: "cpu" stays on the CPU
target, drafter = notebook.load_default(device=DEVICE)
print(target.metadata())
held_out = drafter.metadata()["record"]["held_out_eval"]  # the drafter's model card
print(drafter.name, "| held-out top-1 by position:", held_out["top1_by_position"][:6], "| chain tau", held_out["chain_tau"])"""),
    ("md", "## Greedy (temperature 0)"),
    ("code", """greedy = dl.LiveSession(target, drafter, budget=32, sampling=dl.SamplingParams(temperature=0.0))
run_greedy = greedy.run("Explain why the sky is blue in two sentences.", max_new_tokens=24)
HTML(notebook.summary_html(run_greedy))"""),
    ("code", "notebook.show_text(run_greedy)"),
    ("md", """The step where the walk went deepest (a static picture; wide fans show their first 12
children, the rest in one grey note), then a slider over every step, opening on that one. Step 0
is a poor first look: its root fans out over every first-level draft."""),
    ("code", """best = views.informative_step(run_greedy)
print(f"step {best.step}: accepted {best.accept_length} draft token{'s' if best.accept_length != 1 else ''}")
notebook.show_step(run_greedy, run_greedy.steps.index(best))"""),
    ("code", "notebook.step_browser(run_greedy)"),
    ("md", "## Temperature 0.8"),
    ("code", """sampled = dl.LiveSession(target, drafter, budget=32, sampling=dl.SamplingParams(temperature=0.8, seed=7))
run_sampled = sampled.run("Explain why the sky is blue in two sentences.", max_new_tokens=24)
HTML(notebook.summary_html(run_sampled))"""),
    ("code", "notebook.show_text(run_sampled)"),
    ("code", """best = views.informative_step(run_sampled)
print(f"step {best.step}: accepted {best.accept_length} draft token{'s' if best.accept_length != 1 else ''}")
notebook.show_step(run_sampled, run_sampled.steps.index(best))"""),
    ("code", "notebook.step_browser(run_sampled)"),
    ("md", """## The decision log as text, saved traces and replay

A trace file holds every step; loading it never runs code. `replay` re-runs the reference
verifier on each stored step and checks the recorded output bit for bit."""),
    ("code", """print(notebook.step_text(run_sampled, 0))
import tempfile, pathlib
path = dl.save_trace(run_sampled, pathlib.Path(tempfile.mkdtemp()) / "01_live_step.ddtrace.safetensors")
loaded = dl.load_trace(path)
for step in loaded.steps:
    dl.replay(step)
print(f"replayed {len(loaded.steps)} steps bit for bit; file {path.stat().st_size / 1e3:.0f} kB")"""),
]

SGLANG = [
    ("md", """# 06 · SGLang: recorded verify steps, replayed by the lab

This notebook opens a **recording of SGLang's own verify kernels**, replays every recorded row
with the lab's verifiers, shows where SGLang and the lab disagree and why, and draws the
recorded trees with the lab's views (a recording converts to lab step traces).

The embedded recording (`fixtures/sglang_cpu_recording`) was made on a CPU by running SGLang's
Triton kernels under `TRITON_INTERPRET=1` through the lab's recorder
(`scripts/make_sglang_fixture.py`): a greedy tree verify of three DDTree trees, two batches of
SGLang's chain sampler with one-hot draft probabilities (the target-only rule), and one batch
of its rejection sampler with real draft probabilities.

**Your own recording.** Start SGLang with the recorder switched on (every scheduler process
inherits it):

```bash
DDTREE_LAB_SGLANG_RECORD=/tmp/rec \\
PYTHONPATH=$(ddtree-lab sglang hook-dir):$PYTHONPATH \\
python -m sglang.launch_server --model-path ... --speculative-algorithm EAGLE ...
```

then set `RECORDING` below to `/tmp/rec/sglang-rank0-pid<PID>` and run all cells. Nothing
here needs sglang installed or a GPU."""),
    ("code", """import os
import torch

if not torch.cuda.is_available():  # before triton is imported: the lab's Triton backend runs interpreted below
    os.environ.setdefault("TRITON_INTERPRET", "1")
from IPython.display import HTML, SVG, display

from ddtree_lab import notebook, sglang, views

RECORDING = "../fixtures/sglang_cpu_recording"
recording = sglang.load_recording(RECORDING)
meta = recording.metadata
print(f"{len(recording)} recorded verify calls, {recording.num_rows} rows; {meta['source']}, "
      f"sglang {meta['sglang']}, torch {meta['torch']}, interpreted Triton: {meta['triton_interpret']}")
for i, step in enumerate(recording.steps):
    print(f"  step {i}: {step['kind']:6s} kernel {step['kernel']}, N = {step['draft_token_num']}, "
          f"requests {step['request_ids']}")"""),
    ("md", """## Replay every recorded row with the lab's reference verifier

One line per request and step: `agrees`, `differs` (with the by-design explanation when the
lab knows one) or `not replayable` (SGLang ran something the lab does not implement)."""),
    ("code", """results = sglang.replay_recording(recording, backend="reference")
print("\\n".join(sglang.replay_report(results)))"""),
    ("md", """## The recording as lab step traces

`recording_to_trace` turns every replayable row into a lab `Step` (request ids from
SGLang, the lab's decision log, SGLang's own output and the verdict in `step.extra`), so the
lab's summaries, views, `ddtree-lab render` and `dl.replay` work on it. Draft log-weights and
ranks are not recorded by SGLang: the views show them as `nan` / `-1`."""),
    ("code", """run = sglang.recording_to_trace(recording)
display(HTML(notebook.summary_html(run)))
for skipped in run.metadata["skipped_rows"]:
    print(f"skipped: step {skipped['step']} {skipped['request_id']}: {skipped['why']}")"""),
    ("md", """## A recorded tree

Step 0, request `req-0`: the DDTree tree SGLang verified greedily, drawn by the lab's views:
the accepted path green, siblings the walk rejected red, nodes never reached grey, the bonus
token a blue box."""),
    ("code", """first = run.steps[0]
display(SVG(views.step_svg(first, run)))
display(HTML(views.decisions_table_html(views.step_view(first, run))))"""),
    ("md", """## A sampled step, decision by decision

Step 1 ran SGLang's chain sampler with one-hot draft probabilities, i.e. the target-only rule:
accept node *i+1* iff the coin at node *i* is `< p_i(token)`. The lab's decision log shows each
coin and the mass it was compared with."""),
    ("code", """sampled = max((s for s in run.steps if s.step == 1), key=lambda s: s.extra["sglang_accept_length"])
print(f"request {sampled.request_id}: SGLang accepted {sampled.extra['sglang_accept_length']} draft tokens, "
      f"lab {sampled.accept_length}")
display(HTML(views.decisions_table_html(views.step_view(sampled, run))))
display(SVG(views.step_svg(sampled, run)))"""),
    ("md", """## Where SGLang and the lab differ

Step 2, `req-4`: node 1's drafted token (7) holds all of the root row's mass: its float32
probability is `1 - 2**-24` (printed `0.99999994`), every other entry of the row is 0, and the
coin at the root equals it. SGLang compares `u < S` in float32, so it rejects node 1 and draws
its bonus from the empty residual: it emits token 39 = `V - 1` (`V = 40`), a token the target
gives probability 0, with accept length 0. The lab follows exact arithmetic: the children hold
the whole row, so `S = 1 > u`, it accepts node 1 and walks on (accepted path `[0, 1, 2, 3]`,
emitted `[7, 12, 5, 11]`). The differences below are SGLang's output (`recorded`) against the
lab's (`replayed`); the table and the drawing are the lab's walk."""),
    ("code", """for s in run.steps:
    if s.extra["verdict"] == "differs":
        print(f"step {s.step} {s.request_id}:")
        for line in s.extra["differences"]:
            print("   ", line)
        print("   explanation:", s.extra["explanation"])
        display(HTML(views.decisions_table_html(views.step_view(s, run))))
        display(SVG(views.step_svg(s, run)))"""),
    ("md", """## Every lab backend

The same replay with each of the lab's verify backends. Every backend gets the same input (the
recorded rows' logarithms at temperature 1), so they classify every row alike. On a CPU the
Triton backend runs under `TRITON_INTERPRET=1` (set in the first cell, before triton is
imported); a backend that cannot run here is listed with the reason."""),
    ("code", """from ddtree_lab.sglang.kernels import lab_verifiers
from ddtree_lab.verify import select_backend

backends = lab_verifiers()
for backend in backends:
    print(f"{backend}: {sglang.replay_report(sglang.replay_recording(recording, backend))[-1]}")
if "triton" not in backends:
    try:
        select_backend("triton", "cuda" if torch.cuda.is_available() else "cpu")
    except (RuntimeError, ImportError) as exc:
        print(f"triton: not run: {exc} (on a CPU set TRITON_INTERPRET=1 before importing torch / triton)")"""),
]

VERIFY_STEPPER = [
    ("md", """# 02 · The verify stepper: one decision at a time

What it shows: a recorded DDTree step, walked by the verifier one event at a time. Each
*event* is the verdict on one child (`consider`), a move to an accepted child (`move`), or
the final bonus draw (`bonus`).

How to use it: pick a request and a step with the selector and the **step** slider, then
press **next ▶** (or drag the **decision** slider). At each decision you see

* the tree (left to right: depth grows to the right, siblings top to bottom in sibling
  order; `#i` is the node index used in every table): the node the walk stands on has an
  **orange border**, the node judged last is **yellow**, judged siblings are red (rejected)
  or green (accepted), nodes not judged yet are dotted;
* the verdict: the coin `u` against the cumulative mass `S_k` (sampled) or the argmax
  comparison (greedy);
* the children of the current node with their **target p**, their segment of the
  cumulative mass, **accept p** (the exact probability that the walk accepts the child once
  it stands here) and **path p** (from the root), and the mass bar 0..1 with the coin drawn
  on it;
* at the end the bonus draw: the row's top tokens with the rejected siblings struck out,
  the **residual p** of each (renormalised within the residual), the residual mass, the
  final coin and the chosen token.

**What-if**: move the *what-if u* slider to re-run the step's (pure) verifier with another
coin at the current node. The slider stops once inside each child's segment `[S_k-1, S_k)`
(a segment 0.0004 wide is one stop, like a wide one), once in the residual (reject every
child) and at the recorded coin; the answer appears beside the slider and the what-if walk is
drawn on the tree in **purple**. At a leaf no coin decides anything (the bonus is drawn with
the final coin), so the slider is off there.

The first part reads a recorded trace (`fixtures/traces/`, no model); the last part runs
the embedded default target live for a few tokens and adds steps with a button."""),
    ("code", """import ddtree_lab as dl
from ddtree_lab import notebook, views
from IPython.display import HTML, SVG

run = notebook.fixture_trace("smollm2_t08_b32")   # SmolLM2-135M, temperature 0.8, budget 32
HTML(notebook.summary_html(run))"""),
    ("md", "## The stepper on a recorded sampled run"),
    ("code", """stepper = notebook.verify_stepper(run, request=1, step=2)
stepper"""),
    ("md", """A static copy of what the stepper shows after its third event (readable without a
kernel):"""),
    ("code", """stepper.go(3)
HTML(stepper.verdict_html() + stepper.picture_svg() + stepper.details_html())"""),
    ("md", """## Greedy steps: the argmax comparison

A greedy step has no coins: the walk accepts the child whose token is the target's argmax.
`target p` is still the target's softmax probability (temperature 1) of each token."""),
    ("code", """greedy_run = notebook.fixture_trace("smollm2_greedy_b32")
greedy_stepper = notebook.verify_stepper(greedy_run)
greedy_stepper"""),
    ("md", """## The same step as text

Every picture and table above renders one `StepView`; here are its text forms (the CLI
prints the same: `ddtree-lab render TRACE --step K --format text|decisions`)."""),
    ("code", """view = views.step_view(run.for_request(1)[2], run, collapse_unvisited=True)
print(views.to_text(view))
print(views.decisions_text(view))"""),
    ("md", """## Live: a few tokens on the embedded default target

The button under the step slider runs one more `LiveSession` step and shows it (the
notebook hands the stepper a callable; the stepper never touches the model)."""),
    ("code", """target, drafter = notebook.load_default()
session = dl.LiveSession(target, drafter, budget=16, sampling=dl.SamplingParams(temperature=0.8, seed=3))
session.start("Name three colours.")
session.step(max_new_tokens=12)   # one step; the request stops at 12 new tokens
live = notebook.verify_stepper(session.trace(), more=notebook.live_more(session, max_new_tokens=12))
live"""),
    ("code", """live.run_more()   # what the button does
print(f"{len(live.steps)} live steps recorded; showing step {live.trace.step}")"""),
]

NOTEBOOKS = {"01_live_step.ipynb": LIVE_STEP, "02_verify_stepper.ipynb": VERIFY_STEPPER, "06_sglang.ipynb": SGLANG}


def build(cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
                for kind, src in cells]
    return nb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--no-execute", action="store_true")
    ap.add_argument("names", nargs="*", help="notebooks to write (default: all)")
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
