"""The export verb: a run's per-step and per-node tables as Parquet (for DuckDB and any Parquet reader)."""

from __future__ import annotations

import time
from pathlib import Path

from .common import CLIError, check_new_output, count, inputs_of, load_run, wrote


def cmd_export(args) -> int:
    """Write RUN's per-step and per-node tables to DIR/steps.parquet and DIR/nodes.parquet
    (ddtree_lab.io.parquet); an append-only recording is read one segment at a time. Query them
    in place, e.g. duckdb -c "SELECT depth, avg(accepted::INT) FROM 'DIR/nodes.parquet' GROUP BY 1"."""
    from ..io.parquet import export_parquet

    out = Path(args.parquet)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--parquet {args.parquet}: is a file (give a directory)")
    check_new_output(out, args.force, "--parquet", files=("steps.parquet", "nodes.parquet"), inputs=inputs_of(args))
    run = load_run(args.trace)
    start = time.perf_counter()
    try:
        n = export_parquet(run, out)
    except ImportError as exc:
        raise CLIError(str(exc)) from exc
    wrote(out / "steps.parquet")
    wrote(out / "nodes.parquet")
    print(f"{count(n['steps'], 'step record')}, {count(n['nodes'], 'node')} -> {out}/steps.parquet, "
          f"{out}/nodes.parquet ({time.perf_counter() - start:.1f} s)")
    return 0
