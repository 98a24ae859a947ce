"""Write labs/08_bug_zoo.ipynb (the bug zoo: each planted fault's symptom and what `diagnose` names)
and execute it in place so it carries static outputs.

    python scripts/make_notebook_bug_zoo.py [--no-execute]
"""

from __future__ import annotations

from pathlib import Path

from notebook_outputs import main_for

LABS = Path(__file__).resolve().parent.parent / "labs"

CELLS = [
    ("md", """# 08 · The bug zoo: name the bug, not the symptom

Most bugs of tree speculative decoding live outside the verifier rule, and each is first seen as
a symptom: τ drops, acceptance by depth collapses, a request decodes differently than plain
greedy. `ddtree-lab diagnose RUN [--model default]` (in Python `ddtree_lab.diagnose(run, model)`)
runs every check the recording allows and names the cause: the tree mask or positions that
reproduce the recorded rows, a KV commit that kept the wrong rows, the drafter input that was
wrong, the sampling transform the rows follow, the rule the verifier that ran follows, a final
coin that reuses a walk coin.

`ddtree_lab.faults` plants each of those bugs as a named switch on `LiveSession` (off by
default). `benchmarks/bug_zoo.py` plants every kind in a short live run of the embedded default
and records what a user sees first and what `diagnose` says; its saved results are read first
below (the detection matrix: kind × check). Then one fault is planted live: look at its symptom,
then at the one line `diagnose` prints. To file a bug from your own engine's recording, run
`ddtree-lab diagnose` on it first and paste its lines."""),
    ("code", """import json

from IPython.display import HTML, display

import ddtree_lab as dl
from ddtree_lab import notebook
from ddtree_lab.faults import FAULT_KINDS

zoo = json.load(open("../benchmarks/bug_zoo.json"))
checks = zoo["checks"]
print(f"clean run: tau {zoo['clean']['tau']}, P(accept >= 1, 2, 3) {zoo['clean']['acceptance_by_depth']}")
display(HTML(notebook.table_html(["kind", "tau", *checks, "named/observable"],
                                 [[r["kind"], f"{r['tau']:.2f}", *(r["cells"].get(c, "?") for c in checks),
                                   f"{r['named']}/{r['observable']}"] for r in zoo["zoo"]])))
alarms = sum(a["findings"] > 0 for a in zoo["false_alarms"])
t = zoo["timings"]
print(f"false alarms: {alarms} of {len(zoo['false_alarms'])} clean runs")
print(f"diagnose on a run of {t['step_records']} step records ({t['decoding_steps']} decoding steps), "
      f"models loaded once in {zoo['load_s']} s:")
print(f"  {'without a model':<16s} {t['no_model_s']:>6.2f} s")
print(f"  {'with the model':<16s} {t['with_model_s']:>6.2f} s")"""),
    ("md", """N: the check names the planted fault; f: it flags something but not with this name; `.`: it
ran and found nothing; `-`: it could not run (it says why; that never counts as passing). The τ
column is the symptom: some kinds barely move it (siblings visible, a batch-only mask), some are
lossless and only slow (a wrong drafter anchor), some change the output law without moving it
much (the verifier rules). Only the cause tells them apart.

The `output-law` column is the one check that reads neither coins nor decisions: it tests the
recorded outputs across steps (accepted paths and bonus tokens) against the exact law of a
lossless verifier on the recorded rows, so it still sees a verifier whose recorded coins are
not the ones it used. Being statistical it needs steps; its power and false alarms alone, on
synthetic runs whose coins were replaced:"""),
    ("code", """law = zoo["output_law"]
print(f"false alarms: {law['clean_flagged']} of {law['clean_runs']} clean runs")
for kind, cells in law["faults"].items():
    print(f"{kind:28s} flagged in {cells['25']}/{law['runs_per_cell']} runs at 100 step records, "
          f"{cells['100']}/{law['runs_per_cell']} at 400")"""),
    ("md", """## One fault live: the tree mask shows earlier siblings"""),
    ("code", """target, drafter = notebook.load_default()
params = dl.SamplingParams(temperature=0.0)
clean = dl.LiveSession(target, drafter, budget=16, sampling=params).run("Tell me about lighthouses.", max_new_tokens=12)
buggy = dl.LiveSession(target, drafter, budget=16, sampling=params,
                       faults=["mask-siblings-visible"]).run("Tell me about lighthouses.", max_new_tokens=12)
buggy.metadata.pop("planted_faults")   # diagnose never reads it; a real engine's trace has none
tau = lambda run: sum(s.accept_length + 1 for s in run.steps) / len(run.steps)
print(f"symptom: tau {tau(buggy):.2f} with the fault, {tau(clean):.2f} without")
print("clean text:", repr(target.decode(clean.metadata["requests"][0]["generated_token_ids"])))
print("buggy text:", repr(target.decode(buggy.metadata["requests"][0]["generated_token_ids"])))
if tau(buggy) == tau(clean) and clean.metadata["requests"][0]["generated_token_ids"] == buggy.metadata["requests"][0]["generated_token_ids"]:
    print("no symptom at all here: the same tau and the same greedy text; the fault shows only in the tree's rows")"""),
    ("md", "Without the model, the recording alone passes every check (the rows are self-consistent): "
           "the tree forward can only be judged against a fresh forward of the target."),
    ("code", """print(dl.diagnose(buggy).text())"""),
    ("code", """d = dl.diagnose(buggy, model=(target, drafter), confirm=False)
print(d.text())"""),
    ("md", "The step it names, drawn (the node it names is the first whose row is wrong):"),
    ("code", """f = next(f for f in d.findings if f.fault)
notebook.show_step(buggy, next(i for i, s in enumerate(buggy.steps) if s.step == f.step and s.request == f.request))"""),
]


def main() -> None:
    main_for(__doc__, CELLS, LABS, "08_bug_zoo.ipynb")


if __name__ == "__main__":
    main()
