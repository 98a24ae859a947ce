"""Compile the lab's Triton kernels for GPU architectures without a device and read each cubin's resource usage.

Every launcher configuration of :mod:`ddtree_lab.verify.triton` is a :class:`KernelConfig`:
the sampled kernel with the top-k survivor gather (``KCAP = 256``, ``COMPACT``) and without it
(``KCAP = 16``, what ``COMPACT_CAP = 0`` launches), and the greedy kernel, each for bfloat16,
float16 and float32 logits at ``BLOCK = 4096`` (what a CUDA launch uses for any vocabulary of
4,096 tokens or more), with the launchers' options
(:func:`ddtree_lab.kernels.tree_verify.launch_options`: fusion off, 8 warps, 4 without the gather).

:func:`measure` compiles them (``triton.compile`` to a cubin for ``sm_<arch>``; ``ptxas`` ships
in the triton wheel, no GPU needed) in worker processes, and reads ``REG / STACK / SHARED /
LOCAL`` from ``cuobjdump --dump-resource-usage`` (also in the wheel) and the spill stores /
loads from ``ptxas -v`` (``TRITON_DUMP_PTXAS_LOG``). A configuration *spills* when ptxas
reports spill stores or loads, or the cubin uses local memory (``LOCAL > 0``). A small
``STACK`` without spills is the stack frame of a non-inlined call (reported, not a failure).

The kernels must be imported without ``TRITON_INTERPRET``: the workers run with it removed.
Run ``python -m ddtree_lab.kernels.resources --arch 90 --config sampled-bf16-gather`` for one
configuration (JSON lines on stdout); ``benchmarks/kernel_resources.py`` writes the table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KernelConfig", "CONFIGS", "ARCHS", "supported_archs", "measure", "parse_resource_usage", "parse_ptxas_log",
           "cuobjdump_path"]

#: Architectures the compile check targets (sm_80 A100, sm_90 H100/H200, sm_100 B200).
ARCHS = (80, 90, 100)

_LOW = {"bf16": 16, "fp16": 13, "fp32": 0}
_TYPES = dict(stride_b="i64", stride_n="i64", V="i32", N="i32", temp_ptr="*fp32", topk_ptr="*i32",
              topp_ptr="*fp32", minp_ptr="*fp32", coin_ptr="*fp32", fcoin_ptr="*fp32", thr_ptr="*fp64",
              path_ptr="*i32", plen_ptr="*i32", dnode_ptr="*i32", dprob_ptr="*fp32", dmass_ptr="*fp32",
              dcount_ptr="*i32", btok_ptr="*i32", bkind_ptr="*i32", bmass_ptr="*fp64", bprob_ptr="*fp64",
              err_ptr="*i32", errnode_ptr="*i32", tok_ptr="*i64", nt_ptr="*i64", ns_ptr="*i64", nn_ptr="*i64",
              sx_ptr="*fp32", si_ptr="*i32")


@dataclass(frozen=True)
class KernelConfig:
    """One compiled variant: ``kernel`` ``"sampled"`` or ``"greedy"``, logits ``dtype``
    (``"bf16"``, ``"fp16"``, ``"fp32"``), ``block`` (BLOCK), ``kcap`` and ``compact`` (sampled only)."""

    kernel: str
    dtype: str
    block: int = 4096
    kcap: int = 256
    compact: bool = True

    @property
    def name(self) -> str:
        if self.kernel == "greedy":
            return f"greedy-{self.dtype}"
        return f"sampled-{self.dtype}-{'gather' if self.compact else 'nogather'}"

    def constexprs(self) -> dict:
        if self.kernel == "greedy":
            return {"BLOCK": self.block}
        return {"LOW": _LOW[self.dtype], "BLOCK": self.block, "KCAP": self.kcap, "COMPACT": self.compact}


#: Every launcher configuration (module docstring).
CONFIGS = tuple([KernelConfig("sampled", dt, 4096, 256, True) for dt in ("bf16", "fp16", "fp32")]
                + [KernelConfig("sampled", dt, 4096, 16, False) for dt in ("bf16", "fp16", "fp32")]
                + [KernelConfig("greedy", dt, 4096, 0, False) for dt in ("bf16", "fp16", "fp32")])


def _triton_bin() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def cuobjdump_path() -> Path | None:
    """The ``cuobjdump`` of the triton wheel (or on ``PATH``), ``None`` if neither exists."""
    p = _triton_bin() / "cuobjdump"
    if p.exists():
        return p
    found = shutil.which("cuobjdump")
    return Path(found) if found else None


def supported_archs() -> list[int]:
    """The :data:`ARCHS` this triton install can compile for: sm_80 and sm_90 with its ``ptxas``,
    sm_100 only with the ``ptxas-blackwell`` it ships (or ``TRITON_PTXAS_BLACKWELL_PATH``)."""
    b = _triton_bin()
    out = [a for a in (80, 90) if (b / "ptxas").exists() or os.environ.get("TRITON_PTXAS_PATH")]
    if (b / "ptxas-blackwell").exists() or os.environ.get("TRITON_PTXAS_BLACKWELL_PATH"):
        out.append(100)
    return out


def parse_resource_usage(text: str) -> dict:
    """``{"registers", "stack", "shared", "local"}`` (ints) of the first function in
    ``cuobjdump --dump-resource-usage`` output.

    Raises:
        ValueError: no ``Function ...: REG:..`` record in ``text``.
    """
    m = re.search(r"Function [^\n]*:\s*\n?\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if m is None:
        raise ValueError(f"no resource record in cuobjdump output: {text[:300]!r}")
    reg, stack, shared, local = (int(v) for v in m.groups())
    return {"registers": reg, "stack": stack, "shared": shared, "local": local}


def parse_ptxas_log(text: str) -> dict:
    """``{"spill_stores", "spill_loads", "stack_frame"}`` (bytes) from ``ptxas -v`` output.

    Raises:
        ValueError: no ``spill stores`` line in ``text`` (the log did not come back).
    """
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if m is None:
        raise ValueError(f"no 'bytes spill stores' line in the ptxas log: {text[-300:]!r}")
    frame, stores, loads = (int(v) for v in m.groups())
    return {"spill_stores": stores, "spill_loads": loads, "stack_frame": frame}


def _compile_here(config: KernelConfig, arch: int) -> dict:
    """Compile one configuration in this process (TRITON_INTERPRET must be unset)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget

    from . import tree_verify as tv

    fn = tv.sampled_verify_kernel if config.kernel == "sampled" else tv.greedy_verify_kernel
    const = config.constexprs()
    types = dict(_TYPES, logits_ptr="*" + config.dtype)
    sig = {k: "constexpr" if k in const else types[k] for k in inspect.signature(fn.fn).parameters}
    options = tv.launch_options(config.kernel == "greedy" or config.compact)
    log = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(log):  # ptxas -v (TRITON_DUMP_PTXAS_LOG, set by the worker)
        compiled = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const),
                                  target=GPUTarget("cuda", arch, 32), options=options)
    seconds = time.perf_counter() - t0
    ptxas = parse_ptxas_log(log.getvalue())
    cubin = compiled.asm["cubin"]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{config.name}.cubin"
        path.write_bytes(cubin)
        tool = cuobjdump_path()
        if tool is None:
            raise RuntimeError("no cuobjdump (triton wheel or PATH): cannot read the resource usage")
        res = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                             check=True)
    usage = parse_resource_usage(res.stdout)
    spill_bytes = ptxas["spill_stores"] + ptxas["spill_loads"]
    return {"config": config.name, "arch": arch, **usage, **ptxas, "spills": spill_bytes > 0 or usage["local"] > 0,
            "triton_shared": int(getattr(compiled.metadata, "shared", 0)), "cubin_bytes": len(cubin),
            "compile_s": round(seconds, 2), "num_warps": options["num_warps"],
            "fp_fusion": options["enable_fp_fusion"]}


def _worker(jobs: list[tuple[str, int]], timeout: float) -> list[dict]:
    """Compile ``jobs`` ((config name, arch)) in one fresh process without TRITON_INTERPRET and
    with an empty triton cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    args = [sys.executable, "-m", "ddtree_lab.kernels.resources"]
    for name, arch in jobs:
        args += ["--job", f"{name}@{arch}"]
    with tempfile.TemporaryDirectory(prefix="ddtree-triton-cache-") as cache:
        env["TRITON_CACHE_DIR"] = cache  # a cold cache: real compile times, no stale cubins
        env["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas -v: spill stores / loads
        res = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    done = {(r["config"], r["arch"]) for r in rows}
    for name, arch in jobs:
        if (name, arch) not in done:
            rows.append({"config": name, "arch": arch, "error": (res.stderr or res.stdout)[-2000:] or
                         f"worker exited with {res.returncode}"})
    return rows


def measure(configs=CONFIGS, archs=None, workers: int = 2, timeout: float = 900.0) -> list[dict]:
    """Compile every ``configs`` x ``archs`` pair (default: :func:`supported_archs`) in
    ``workers`` parallel processes; one dict per pair, in input order.

    Each dict: ``config``, ``arch``, ``registers``, ``stack``, ``shared`` (static bytes per block,
    from the cubin), ``local`` (bytes per thread), ``spill_stores`` / ``spill_loads`` /
    ``stack_frame`` (bytes, ptxas), ``spills`` (bool), ``triton_shared`` (the
    dynamic shared memory triton allocates, bytes), ``cubin_bytes``, ``compile_s`` (wall seconds
    of ``triton.compile``); or ``config``, ``arch``, ``error`` (the compile failed: its message).
    """
    archs = list(supported_archs() if archs is None else archs)
    jobs = [(c.name, a) for a in archs for c in configs]
    workers = max(1, min(int(workers), len(jobs)))
    chunks = [jobs[i::workers] for i in range(workers)]
    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(lambda ch: _worker(ch, timeout), chunks))
    by_key = {(r["config"], r["arch"]): r for part in parts for r in part}
    return [by_key[j] for j in jobs]


def main(argv=None) -> int:
    by_name = {c.name: c for c in CONFIGS}
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)  # None under python -OO
    p.add_argument("--job", action="append", default=[], help="CONFIG@ARCH, e.g. sampled-bf16-gather@90 "
                   f"(configs: {', '.join(by_name)})")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        p.error("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled")
    for job in args.job:
        name, _, arch = job.partition("@")
        if name not in by_name or not arch.isdigit():
            p.error(f"--job {job!r}: want CONFIG@ARCH with CONFIG one of {', '.join(by_name)}")
        try:
            row = _compile_here(by_name[name], int(arch))
        except Exception as exc:  # reported per configuration; the caller fails on it
            row = {"config": name, "arch": int(arch), "error": f"{type(exc).__name__}: {exc}"[-2000:]}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
