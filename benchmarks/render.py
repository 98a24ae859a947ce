"""Render benchmark and fit report of the step picture (goal: a 256-node SVG in <= 150 ms).

    python benchmarks/render.py

Prints (1) the time to lower and lay out a random 256-node step as SVG
(``views.step_svg``: ``step_view`` + ``to_dot`` + graphviz ``dot``), full and collapsed,
median of several runs, and (2) for every step of the fixture traces, the SVG width and
height in CSS pixels with the notebooks' setting (unvisited subtrees collapsed) and without
collapse, and how many fit a notebook column (1,100 px wide).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

import ddtree_lab as dl
from ddtree_lab import views
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from step_examples import random_step

ROOT = Path(__file__).resolve().parent.parent
COLUMN = 1100


def timed(fn, repeats: int = 9) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    step, texts = random_step(budget=256)
    load = os.getloadavg()[0]
    print(f"render: {step.num_nodes}-node random step (budget 256), graphviz dot, median of 9; load average {load:.1f}")
    for label, opts in (("full tree", {}), ("unvisited collapsed", {"collapse_unvisited": True}),
                        ("min target p 0.01", {"min_target_p": 0.01}), ("max depth 3", {"max_depth": 3})):
        svg = views.step_svg(step, texts, **opts)
        w, h = views.svg_size(svg)
        lower = timed(lambda: views.to_dot(views.step_view(step, texts, **opts)))
        total = timed(lambda: views.step_svg(step, texts, **opts))
        print(f"  {label:22s} {total * 1e3:7.1f} ms (lowering + DOT {lower * 1e3:5.1f} ms)  svg {w:6.0f} x {h:6.0f} px")
    print(f"fit: fixture steps whose SVG is at most {COLUMN} px wide")
    for path in sorted((ROOT / "fixtures" / "traces").glob("*.ddtrace.safetensors")):
        run = dl.load_trace(path)
        for label, opts in (("collapsed (notebooks)", {"collapse_unvisited": True}), ("full", {})):
            sizes = [views.svg_size(views.step_svg(s, run, **opts)) for s in run.steps]
            fit = sum(w <= COLUMN for w, _ in sizes)
            ws, hs = [w for w, _ in sizes], [h for _, h in sizes]
            print(f"  {path.name:40s} {label:22s} {fit:3d}/{len(sizes)} fit; width max {max(ws):5.0f} "
                  f"median {statistics.median(ws):5.0f}; height max {max(hs):5.0f} median {statistics.median(hs):5.0f} px")


if __name__ == "__main__":
    main()
