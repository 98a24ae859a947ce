"""A serving-shape recording at scale: record, open, info, render, export to Parquet, query with DuckDB.

A synthetic recording (:mod:`ddtree_lab.io.synthetic`: real DDTree builds, buffers and verify
outputs on made-up rows; no model) of 64 requests x 1,024 new tokens, budget B=64, V=49,152,
level ``light``, written append-only (:class:`ddtree_lab.io.append_trace.TraceWriter`, one
segment per batch step, as ``LiveSession(record_to=...)`` writes) under ``--out``; built once
and reused. For each size (the full one, a tenth and a hundredth of the tokens per request),
each phase runs in its own process so that its time (after imports) and peak memory (the
process's maximum resident set, imports included; ``baseline`` is that of a process that only
imported the lab) are its own:

* ``record``: the synthetic generator plus the writes; ``write`` is the writes alone;
* ``open``: :func:`ddtree_lab.io.load`; ``info``: ``ddtree-lab info`` (open + print);
* ``render``: ``ddtree-lab render RUN --step K --request 0`` (open + one step's text render);
* ``export``: ``ddtree-lab export RUN --parquet DIR`` (every node);
* ``query``: :func:`ddtree_lab.analysis.large.acceptance_by_depth_sql` over every node.

Goals (issue 17): at the full size open + info <= 3 s and peak memory <= 1 GB, the per-depth
query <= 2 s, every cost at most linear in the size. ``--live`` also measures the append-only
overhead on a light live step (bs=4, B=32, SmolLM2 on the CPU): the mean step wall time with
and without ``record_to``.

    python benchmarks/scale.py [--sizes 1 0.1 0.01] [--out benchmarks/.scale] [--live]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUESTS, TOKENS, BUDGET, VOCAB = 64, 1024, 64, 49152


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def build(path: Path, tokens: int, requests: int = REQUESTS, budget: int = BUDGET, vocab: int = VOCAB) -> dict:
    """Record the synthetic run to ``path`` (append-only); returns times (seconds) and counts."""
    from ddtree_lab.io.append_trace import TraceWriter
    from ddtree_lab.io.synthetic import SyntheticShape, synthetic_steps

    shape = SyntheticShape(requests=requests, budget=budget, vocab=vocab, level="light")
    meta = {"vocab_size": vocab, "budget": budget, "source": "synthetic serving shape", "record": "light",
            "requests": [{"request": b, "request_id": f"r{b}", "prompt": None, "params": {"temperature": 1.0},
                          "generated_token_ids": [], "finish_reason": None} for b in range(requests)]}
    start = time.perf_counter()
    w = TraceWriter(path, meta)
    generated = [0] * requests
    write, k, records = 0.0, 0, 0
    while any(g < tokens for g in generated):
        active = [b for b in range(requests) if generated[b] < tokens]
        steps = [s for s in synthetic_steps(shape, 0, k, [64 + g for g in generated]) if s.request in active]
        for s in steps:
            generated[s.request] += s.accept_length + 1
        t = time.perf_counter()
        w.write_steps(steps, {})
        write += time.perf_counter() - t
        records += len(steps)
        k += 1
    for b in range(requests):
        meta["requests"][b]["finish_reason"] = "length"
    t = time.perf_counter()
    w.write_metadata(meta, {})
    w.close()
    write += time.perf_counter() - t
    if w.stopped:
        raise SystemExit(w.stopped)
    return {"seconds": time.perf_counter() - start, "write": write, "steps": k, "records": records,
            "bytes": path.stat().st_size}


def phase(name: str, path: Path, pq: Path) -> dict:
    """One phase, in this process (module docstring); prints nothing but its JSON result."""
    import contextlib
    import io

    from ddtree_lab.cli import main

    base = _peak_mb()
    start = time.perf_counter()
    out: dict = {}
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink):
        if name == "open":
            from ddtree_lab.io import load

            run = load(path)
            out["records"] = len(run.steps)
        elif name == "info":
            assert main(["info", str(path)]) == 0
        elif name == "render":
            from ddtree_lab.io import load

            k = len(load(path).records) // 128  # a step in the run's middle (the request 0 record of it)
            assert main(["render", str(path), "--step", str(k), "--request", "0"]) == 0
        elif name == "export":
            assert main(["export", str(path), "--parquet", str(pq)]) == 0
        elif name == "query":
            from ddtree_lab.analysis.large import acceptance_by_depth_sql, query

            out["by_depth"] = acceptance_by_depth_sql(pq)
            out["nodes"] = query(pq, "SELECT count(*) FROM nodes")[0][0]
    out.update({"seconds": time.perf_counter() - start, "peak_mb": _peak_mb(), "baseline_mb": base})
    return out


def run_phase(name: str, path: Path, pq: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, __file__, "--phase", name, "--path", str(path), "--parquet", str(pq)],
                          env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"phase {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(size: float, out: Path) -> dict:
    tokens = max(1, round(TOKENS * size))
    path = out / f"serving-{tokens}.ddtrace"
    pq = out / f"serving-{tokens}.parquet"
    result = {"size": size, "tokens": tokens}
    from ddtree_lab.io import load

    reuse = path.exists() and getattr(load(path), "closed", False)
    if reuse:
        result["record"] = {"reused": True, "bytes": path.stat().st_size}
    else:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run([sys.executable, __file__, "--phase", "record", "--path", str(path), "--tokens",
                               str(tokens)], env=env, capture_output=True, text=True, timeout=7200)
        if done.returncode != 0:
            raise SystemExit(f"record failed:\n{done.stderr[-3000:]}")
        result["record"] = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("open", "info", "render", "export", "query"):
        result[name] = run_phase(name, path, pq)
    return result


def live_overhead(tokens: int = 24, repeats: int = 3) -> dict:
    """A light live step at bs=4, B=32: the append-only recorder's own time per step (its calls
    timed inside the session) and the mean step wall time with and without ``record_to``
    (alternating runs after a warm-up round; on a shared machine the wall-time difference is
    noisier than the recorder's own time)."""
    import tempfile

    import ddtree_lab as dl
    from ddtree_lab import notebook
    from ddtree_lab.io import live_record

    target, drafter = notebook.load_default(device="cpu", drafter="ridge")
    prompts = ["Explain why the sky is blue.", "Write a short poem about the sea.", "What are three uses of copper?",
               "Give me a recipe for tomato soup."]
    own = {"seconds": 0.0, "steps": 0}
    for name in ("inputs", "steps"):  # time the recorder's two per-step calls
        real = getattr(live_record.SessionRecorder, name)

        def timed(self, *a, _real=real, **k):
            t = time.perf_counter()
            try:
                return _real(self, *a, **k)
            finally:
                own["seconds"] += time.perf_counter() - t

        setattr(live_record.SessionRecorder, name, timed)
    times = {"memory": [], "append-only": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats + 1):
            for mode in ("memory", "append-only"):
                kw = {"record_to": Path(tmp) / "live.ddtrace"} if mode == "append-only" else {}
                s = dl.LiveSession(target, drafter, budget=32, record="light", **kw)
                s.start(prompts)
                t, n = time.perf_counter(), 0
                while any(not q.finished for q in s.requests):
                    s.step(tokens)
                    n += 1
                s.close_recording()
                if r:  # the first round warms up
                    times[mode].append((time.perf_counter() - t) / n)
                    if mode == "append-only":
                        own["steps"] += n
                elif mode == "append-only":
                    own["seconds"] = 0.0
    mem = sum(times["memory"]) / len(times["memory"])
    app = sum(times["append-only"]) / len(times["append-only"])
    per_step = own["seconds"] / max(own["steps"], 1)
    return {"memory_step_ms": 1e3 * mem, "append_step_ms": 1e3 * app, "wall_overhead": app / mem - 1.0,
            "recorder_ms": 1e3 * per_step, "overhead": per_step / mem, "runs": repeats}


def report(results: list[dict], live: dict | None) -> list[str]:
    lines = [f"synthetic serving-shape recording: {REQUESTS} requests, B={BUDGET}, V={VOCAB}, level light, "
             "append-only (one segment per batch step)"]
    for r in results:
        rec = r["record"]
        lines.append(f"size {r['size']:g} ({r['tokens']} tokens/request): {r['open']['records']} records, "
                     f"{r['query']['nodes']} nodes, file {rec['bytes'] / 1e6:.1f} MB")
        if rec.get("reused"):
            lines.append("  record: reused (built by an earlier run)")
        else:
            lines.append(f"  record: {rec['seconds']:.1f} s in all ({rec['write']:.2f} s writing, "
                         f"{1e3 * rec['write'] / rec['steps']:.2f} ms per batch step), {rec['steps']} batch steps")
        for name in ("open", "info", "render", "export", "query"):
            p = r[name]
            lines.append(f"  {name:7s} {p['seconds']:7.2f} s   peak {p['peak_mb']:7.0f} MB "
                         f"(after imports {p['baseline_mb']:.0f} MB)")
    full = next((r for r in results if r["size"] == 1), None)
    if full is not None:
        oi = full["info"]["seconds"]
        peak = max(full[n]["peak_mb"] for n in ("open", "info", "render", "export", "query"))
        q = full["query"]["seconds"]
        lines.append(f"goal open + info <= 3 s: {oi:.2f} s ({'met' if oi <= 3 else 'MISSED'})")
        lines.append(f"goal peak memory <= 1 GB: {peak:.0f} MB ({'met' if peak <= 1024 else 'MISSED'})")
        lines.append(f"goal per-depth query <= 2 s: {q:.2f} s ({'met' if q <= 2 else 'MISSED'})")
    else:
        lines.append("full size not run: the goals at the full size are not measured")
    by = sorted(results, key=lambda r: r["size"])
    if len(by) >= 2:
        a, b = by[0], by[-1]
        grow = b["open"]["records"] / a["open"]["records"]
        lines.append(f"growth from size {a['size']:g} to {b['size']:g}: records x{grow:.1f}; "
                     + ", ".join(f"{n} x{b[n]['seconds'] / max(a[n]['seconds'], 1e-9):.1f}"
                                 for n in ("open", "info", "render", "export", "query")))
    if live is not None:
        lines.append(f"live light step, bs=4, B=32 (SmolLM2, CPU, {live['runs']} runs each): the recorder's own time "
                     f"{live['recorder_ms']:.2f} ms per step = {100 * live['overhead']:.2f}% of a "
                     f"{live['memory_step_ms']:.1f} ms step (goal <= 5%: "
                     f"{'met' if live['overhead'] <= 0.05 else 'MISSED'}); step wall time {live['memory_step_ms']:.1f} "
                     f"ms in memory, {live['append_step_ms']:.1f} ms append-only ({100 * live['wall_overhead']:+.1f}%, "
                     "alternating runs on a shared machine)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.01, 0.1, 1.0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / ".scale"))
    ap.add_argument("--live", action="store_true", help="also the append-only overhead on a live light step")
    ap.add_argument("--live-only", action="store_true", help="only the live overhead")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--parquet", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase == "record":
        print(json.dumps(build(Path(args.path), args.tokens)))
        return
    if args.phase:
        print(json.dumps(phase(args.phase, Path(args.path), Path(args.parquet))))
        return
    if args.live_only:
        print("\n".join(report([], live_overhead())[2:]))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [measure(s, out) for s in sorted(args.sizes)]
    live = live_overhead() if args.live else None
    print("\n".join(report(results, live)))


if __name__ == "__main__":
    main()
