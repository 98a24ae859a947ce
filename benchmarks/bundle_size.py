"""Bundle sizes (goal: <= 200 KB for B = 32 on SmolLM2) and trace sizes (goal: <= 5 MB per 64
generated tokens), measured on the shipped fixtures and the SGLang CPU recording.

    python benchmarks/bundle_size.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import ddtree_lab as dl
from ddtree_lab.io import bundle as bd
from ddtree_lab.threads import configure_threads

ROOT = Path(__file__).resolve().parent.parent


def _bundle_sizes(run, out: Path) -> list[int]:
    sizes = []
    for s in run.steps:
        d = bd.save_bundle(bd.make_bundle(run, s), out / f"{s.step}_{s.request}")
        assert bd.replay_bundle(d).ok, (s.step, s.request)
        sizes.append(sum(p.stat().st_size for p in d.iterdir()))
    return sizes


def main() -> None:
    configure_threads()
    from ddtree_lab.sglang import load_recording, recording_to_trace

    runs = {p.name: dl.load_trace(p) for p in sorted((ROOT / "fixtures" / "traces").glob("*.ddtrace.safetensors"))}
    runs["sglang_cpu_recording (converted)"] = recording_to_trace(load_recording(ROOT / "fixtures" / "sglang_cpu_recording"))
    print(f"{'source':40s} {'steps':>5s} {'trace MB/64 tok':>15s} {'bundle kB: median':>18s} {'max':>6s} {'s/bundle':>9s}")
    for name, run in runs.items():
        per64 = "-"
        path = ROOT / "fixtures" / "traces" / name
        if path.exists():
            tokens = sum(len(r["generated_token_ids"]) for r in run.metadata["requests"])
            per64 = f"{path.stat().st_size / tokens * 64 / 1e6:.2f}"
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            sizes = _bundle_sizes(run, Path(tmp))
            per = (time.perf_counter() - t0) / len(sizes)
        print(f"{name:40s} {len(sizes):5d} {per64:>15s} {statistics.median(sizes) / 1e3:18.1f} {max(sizes) / 1e3:6.1f} "
              f"{per:9.2f}")
    print("goals: trace <= 5 MB per 64 generated tokens (B=32); bundle <= 200 kB (B=32)")


if __name__ == "__main__":
    main()
