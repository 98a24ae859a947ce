"""Write the notebooks in labs/ from their cell sources, then execute them in place so they
carry static outputs (SVG trees, HTML text) that read without a kernel.

    python scripts/make_notebooks.py [--no-execute]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat
from nbclient import NotebookClient

LABS = Path(__file__).resolve().parent.parent / "labs"

LIVE_STEP = [
    ("md", """# 01 · Live DDTree steps on the embedded default target

This notebook runs DDTree speculative decoding **live** on SmolLM2-135M-Instruct (the
embedded default target, fp32 on the CPU) with the project's ridge drafter (block size
L = 16), first greedily, then at temperature 0.8, and draws every step.

How to read a step's tree: each node shows its token, its depth `d`, its rank `r` among the
drafter's top-k at that depth, its node log-weight `logw` under the drafter, and `p`, the
target probability of the token in its parent's row. Children run left to right in sibling
order (descending log-weight). **Green**: the accepted path; **red, dashed**: siblings the
verifier visited and rejected; **grey**: never reached; **blue box**: the bonus token.

Use: run all cells (a first run converts the GGUF weights once, about 40 s). Change the
prompt, the budget `B` or the sampling parameters in the cells below and run again; the
slider browses every step with its decision log (coin, cumulative mass, verdict)."""),
    ("code", """import ddtree_lab as dl
from ddtree_lab import lab
from IPython.display import HTML

target, drafter = lab.load_default()
print(target.metadata())
print(drafter.metadata()["record"]["held_out_top8_hit_rate"])"""),
    ("md", "## Greedy (temperature 0)"),
    ("code", """greedy = dl.LiveSession(target, drafter, budget=32, sampling=dl.SamplingParams(temperature=0.0))
run_greedy = greedy.run("Explain why the sky is blue in two sentences.", max_new_tokens=48)
HTML(lab.summary_html(run_greedy))"""),
    ("code", "lab.show_text(run_greedy)"),
    ("md", "The first steps' trees (static pictures; the slider below browses all of them):"),
    ("code", "lab.show_steps(run_greedy, limit=3)"),
    ("code", "lab.step_browser(run_greedy)"),
    ("md", "## Temperature 0.8"),
    ("code", """sampled = dl.LiveSession(target, drafter, budget=32, sampling=dl.SamplingParams(temperature=0.8, seed=7))
run_sampled = sampled.run("Explain why the sky is blue in two sentences.", max_new_tokens=48)
HTML(lab.summary_html(run_sampled))"""),
    ("code", "lab.show_text(run_sampled)"),
    ("code", "lab.show_steps(run_sampled, limit=3)"),
    ("code", "lab.step_browser(run_sampled)"),
    ("md", """## The decision log as text, saved traces and replay

A trace file holds every step; loading it never runs code. `replay` re-runs the reference
verifier on each stored step and checks the recorded output bit for bit."""),
    ("code", """print(lab.step_text(run_sampled, 0))
path = dl.save_trace(run_sampled, "/tmp/01_live_step.ddtrace.safetensors")
loaded = dl.load_trace(path)
for step in loaded.steps:
    dl.replay(step)
print(f"replayed {len(loaded.steps)} steps bit for bit; file {path.stat().st_size / 1e3:.0f} kB")"""),
]

NOTEBOOKS = {"01_live_step.ipynb": LIVE_STEP}


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
            NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(LABS)}}).execute()
        nbformat.write(nb, LABS / name)
        print(f"wrote labs/{name}")


if __name__ == "__main__":
    main()
