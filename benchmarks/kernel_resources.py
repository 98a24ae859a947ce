"""Compiled resource usage of every lab Triton kernel configuration, per GPU architecture.

Compiles each launcher configuration (``ddtree_lab.kernels.resources.CONFIGS``) for sm_80,
sm_90 and sm_100 (where this triton ships a Blackwell ptxas), no GPU needed, and prints one
Markdown table: registers, ptxas spill stores / loads, stack, static and triton shared memory,
warps, compile time. ``--write`` replaces the section "Triton kernels: compiled resource usage"
of docs/BENCHMARKS.md with it (other sections are left as they are). Exit status 1 when a
configuration fails to compile or spills.

    python benchmarks/kernel_resources.py [--workers 2] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import triton

from ddtree_lab.kernels import resources

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "BENCHMARKS.md"
HEADING = "## Triton kernels: compiled resource usage"


def table(rows: list[dict]) -> str:
    head = ("| configuration | arch | warps | registers | spill stores / loads (B) | stack (B) | shared static / "
            "triton (B) | compile (s) |\n|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | sm_{r['arch']} | COMPILE ERROR: {r['error'].splitlines()[-1][:80]} "
                         "| | | | | |")
            continue
        lines.append(f"| {r['config']} | sm_{r['arch']} | {r['num_warps']} | {r['registers']} | "
                     f"{r['spill_stores']} / {r['spill_loads']} | {r['stack']} | {r['shared']} / {r['triton_shared']} "
                     f"| {r['compile_s']:.1f} |")
    return head + "\n".join(lines) + "\n"


def section(rows: list[dict], seconds: float, workers: int) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return (f"{HEADING}\n\n"
            f"Written by `python benchmarks/kernel_resources.py --write` ({when}; triton {triton.__version__}, "
            f"{platform.machine()} host with no GPU; {len(rows)} compiles in {workers} processes, {seconds:.0f} s "
            "wall). Every launcher configuration: logits dtype, the sampled kernel with the top-k survivor gather "
            "(`KCAP = 256`) and without it (`COMPACT_CAP = 0`, `KCAP = 16`), the greedy kernel; `BLOCK = 4096` "
            "(a CUDA launch at any vocabulary of 4,096 tokens or more), fusion off. Registers, stack and static "
            "shared memory from `cuobjdump --dump-resource-usage` of the cubin, spills from `ptxas -v`, triton "
            "shared = the dynamic shared memory triton allocates; compile time = `triton.compile` wall seconds on "
            "a cold cache (this CPU is shared, so times vary). "
            "`tests/test_verify_triton.py::test_every_kernel_configuration_compiles_for_sm80_sm90_sm100_without_spills` "
            "compiles the same set in CI and fails on a compile error or a spill.\n\n" + table(rows))


def write_section(text: str) -> None:
    old = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    start = old.find(HEADING)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        nxt = old.find("\n## ", start + len(HEADING))
        new = old[:start] + text + ("" if nxt < 0 else "\n" + old[nxt + 1:])
    DOC.write_text(new)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="parallel compile processes (default 2)")
    ap.add_argument("--write", action="store_true", help=f"write the section into {DOC.relative_to(ROOT)}")
    args = ap.parse_args()
    if args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    archs = resources.supported_archs()
    if not archs or resources.cuobjdump_path() is None:
        print("no ptxas / cuobjdump in this triton install: nothing compiled", file=sys.stderr)
        return 1
    t0 = datetime.datetime.now()
    rows = resources.measure(resources.CONFIGS, archs, workers=args.workers)
    seconds = (datetime.datetime.now() - t0).total_seconds()
    text = section(rows, seconds, args.workers)
    print(text)
    if args.write:
        write_section(text)
        print(f"wrote {DOC.relative_to(ROOT)}")
    bad = [r for r in rows if "error" in r or r["spills"]]
    for r in bad:
        print(f"FAIL {r['config']} sm_{r['arch']}: {r.get('error') or 'spills'}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
