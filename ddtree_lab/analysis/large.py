"""Statistics of runs too large for a notebook: DuckDB queries over the Parquet tables of :mod:`ddtree_lab.io.parquet`.

The tables are queried in place (DuckDB reads the Parquet files; nothing is loaded whole).
:func:`acceptance_by_depth_sql` gives the numbers of :func:`ddtree_lab.analysis.acceptance_by_depth`
(same definitions) over every node of a run; :func:`query` runs any SQL with the views
``steps`` and ``nodes`` defined on the files.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["connect", "query", "acceptance_by_depth_sql", "ACCEPTANCE_BY_DEPTH"]

#: offered[d]: steps whose accepted node at depth d-1 has a child (its first child is counted
#: once per step); accepted[d]: steps that accepted a node at depth d.
ACCEPTANCE_BY_DEPTH = """
SELECT depth,
       sum(CASE WHEN parent_accepted AND first_child THEN 1 ELSE 0 END) AS offered,
       sum(CASE WHEN accepted THEN 1 ELSE 0 END) AS accepted
FROM nodes WHERE depth >= 1 GROUP BY depth ORDER BY depth
"""


def connect(parquet_dir: str | Path):
    """A DuckDB connection with views ``steps`` and ``nodes`` on ``parquet_dir``'s tables.

    Raises:
        ImportError: duckdb is not installed (the message says how).
        FileNotFoundError: ``steps.parquet`` or ``nodes.parquet`` is missing.
    """
    try:
        import duckdb
    except ImportError as exc:
        raise ImportError("the queries need duckdb: pip install 'ddtree-lab[scale]' (or scripts/setup.sh)") from exc
    d = Path(parquet_dir)
    for name in ("steps", "nodes"):
        if not (d / f"{name}.parquet").is_file():
            raise FileNotFoundError(f"{d / (name + '.parquet')}: no such file (write it with "
                                    "`ddtree-lab export RUN --parquet DIR`)")
    con = duckdb.connect()
    for name in ("steps", "nodes"):
        path = str(d / f"{name}.parquet").replace("'", "''")
        con.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{path}')")
    return con


def query(parquet_dir: str | Path, sql: str) -> list[tuple]:
    """The rows of ``sql`` over the views ``steps`` and ``nodes`` (:func:`connect`)."""
    con = connect(parquet_dir)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def acceptance_by_depth_sql(parquet_dir: str | Path) -> dict[str, list]:
    """Acceptance at each depth over every node of the run, as
    :func:`ddtree_lab.analysis.acceptance_by_depth` returns it (``depth``, ``offered``,
    ``accepted``, ``rate``, ``fraction``), computed by DuckDB (:data:`ACCEPTANCE_BY_DEPTH`).
    Steps that did not return have no accepted path and count in no depth (nor in ``fraction``'s
    denominator)."""
    con = connect(parquet_dir)
    try:
        rows = con.execute(ACCEPTANCE_BY_DEPTH).fetchall()
        counted = con.execute("SELECT count(*) FROM steps WHERE NOT did_not_return").fetchone()
        assert counted is not None  # count(*) always returns one row
        (steps,) = counted
    finally:
        con.close()
    depth = [int(r[0]) for r in rows]
    offered = [int(r[1]) for r in rows]
    accepted = [int(r[2]) for r in rows]
    return {"depth": depth, "offered": offered, "accepted": accepted,
            "rate": [a / o if o else None for a, o in zip(accepted, offered)],
            "fraction": [a / steps if steps else None for a in accepted]}
