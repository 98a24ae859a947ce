"""Parquet export of a run: one per-step and one per-node table, for DuckDB, Spark, Trino or any Parquet reader.

:func:`export_parquet` writes ``DIR/steps.parquet`` and ``DIR/nodes.parquet`` with pyarrow,
one row group per batch of records, reading the run one segment (append-only files) or one
step (any other source) at a time, so memory stays bounded by a batch whatever the run's size.

``steps.parquet``, one row per recorded (request, step): ``request``, ``request_id``,
``step``, ``num_nodes``, ``accept_length``, ``tau`` (accept length + 1, or + 0 when the
support was exhausted), ``bonus_token``, ``support_exhausted``, ``prefix_len``,
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``level``, ``backend``, ``lossy``,
``did_not_return``, and one ``t_{stage}`` column per stage timing (seconds; NULL when not
recorded).

``nodes.parquet``, one row per tree node: ``request``, ``step``, ``node``, ``parent``,
``depth``, ``rank`` (sibling rank from the build; -1 when the source has none), ``first_child``
(the node its parent's ``retrieve_next_token`` points to), ``token``, ``target_p`` (the
target probability of the token in its parent's row, ``child_probs``; NULL where the verifier
never read that row), ``drafter_q`` (``exp(node_logw - parent_logw)``, the drafter's
probability of the token given the path; NULL when not recorded), ``accepted`` (on the
accepted path), ``parent_accepted``, ``accept_length`` and ``temperature`` of the step.
The root (node 0) has ``parent`` -1 and NULL ``target_p`` / ``drafter_q``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..step import STAGES, Run, Step

__all__ = ["export_parquet", "STEP_COLUMNS", "NODE_COLUMNS"]

STEP_COLUMNS = ("request", "request_id", "step", "num_nodes", "accept_length", "tau", "bonus_token",
                "support_exhausted", "prefix_len", "temperature", "top_k", "top_p", "min_p", "level", "backend",
                "lossy", "did_not_return", *(f"t_{s}" for s in STAGES))
NODE_COLUMNS = ("request", "step", "node", "parent", "depth", "rank", "first_child", "token", "target_p",
                "drafter_q", "accepted", "parent_accepted", "accept_length", "temperature")


def _need_pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError("the Parquet export needs pyarrow: pip install 'ddtree-lab[scale]' "
                          "(or scripts/setup.sh)") from exc
    return pa, pq


def _node_rows(s: Step, cols: dict[str, list]) -> None:
    if s.tree is None:
        return
    n = s.num_nodes
    parents, depths, ranks, tokens = s.parents, s.depths, s.ranks, s.node_token_ids
    assert parents is not None and depths is not None and ranks is not None and tokens is not None  # s.tree is set
    par = parents.numpy()
    out = s.output
    accepted = np.zeros(n, dtype=bool)
    if out is not None:
        path = [i for i in out.accept_index[0].tolist() if i >= 0]
        accepted[path] = True
    first = np.zeros(n, dtype=bool)
    next_token = s.retrieve_next_token
    if next_token is not None:  # the step has buffers
        nxt = next_token.numpy()
        first[nxt[nxt >= 0]] = True
    p = s.child_probs.numpy().astype(np.float64) if s.child_probs is not None else np.full(n, np.nan)
    lw = s.node_logws.numpy().astype(np.float64) if s.node_logws is not None else np.full(n, np.nan)
    q = np.full(n, np.nan)
    q[1:] = np.exp(lw[1:] - lw[par[1:]])
    p = p.copy()
    p[0] = np.nan
    parent_acc = np.zeros(n, dtype=bool)
    parent_acc[1:] = accepted[par[1:]]
    al = s.accept_length if out is not None or s.stored_accept_length is not None else -1
    temp = float(s.params.temperature) if s.params is not None else np.nan
    cols["request"].append(np.full(n, s.request, dtype=np.int32))
    cols["step"].append(np.full(n, s.step, dtype=np.int32))
    cols["node"].append(np.arange(n, dtype=np.int32))
    cols["parent"].append(par.astype(np.int32))
    cols["depth"].append(depths.numpy().astype(np.int16))
    cols["rank"].append(ranks.numpy().astype(np.int16))
    cols["first_child"].append(first)
    cols["token"].append(tokens.numpy().astype(np.int32))
    cols["target_p"].append(p)
    cols["drafter_q"].append(q)
    cols["accepted"].append(accepted)
    cols["parent_accepted"].append(parent_acc)
    cols["accept_length"].append(np.full(n, al, dtype=np.int16))
    cols["temperature"].append(np.full(n, temp, dtype=np.float32))


def _num(params, name: str, kind):
    v = None if params is None else getattr(params, name, None)
    return None if v is None else kind(v)


def _step_row(s: Step, cols: dict[str, list]) -> None:
    out = s.output
    params = s.params
    al = s.accept_length if out is not None or s.stored_accept_length is not None else None
    exhausted = bool(out.support_exhausted[0]) if out is not None else None
    row = {"request": s.request, "request_id": s.request_id, "step": s.step,
           "num_nodes": s.num_nodes if (s.tree is not None or s.stored_num_nodes is not None) else None,
           "accept_length": al, "tau": None if al is None else al + (0 if exhausted else 1),
           "bonus_token": s.bonus_token if out is not None else None, "support_exhausted": exhausted,
           "prefix_len": s.prefix_len, "temperature": _num(params, "temperature", float),
           "top_k": _num(params, "top_k", int), "top_p": _num(params, "top_p", float),
           "min_p": _num(params, "min_p", float), "level": s.level, "backend": s.backend,
           "lossy": s.lossy, "did_not_return": bool(s.extra.get("did_not_return", False))}
    for stage in STAGES:
        row[f"t_{stage}"] = s.timings.get(stage)
    for k in STEP_COLUMNS:
        cols[k].append(row[k])


def _iter_batches(run: Run, batch: int):
    """Lists of steps, about ``batch`` records each, one segment at a time where the run has them."""
    segment_steps = getattr(run, "segment_steps", None)
    if segment_steps is not None:
        records = getattr(run, "records")  # an AppendRun's index (it is the run with segment_steps)
        todo, i = [], 0
        while i < len(records):
            seg = records[i][0]
            steps = segment_steps(seg)
            while i < len(records) and records[i][0] == seg:
                todo.append(steps[records[i][1]])
                i += 1
            if len(todo) >= batch:
                yield todo
                todo = []
        if todo:
            yield todo
        return
    for k in range(0, len(run.steps), batch):
        yield run.steps[k : k + batch]


def export_parquet(run: Run, out_dir: str | Path, batch: int = 256) -> dict[str, int]:
    """Write ``out_dir/steps.parquet`` and ``out_dir/nodes.parquet`` (module docstring).

    Args:
        run: any :class:`~ddtree_lab.step.Run` (:func:`ddtree_lab.io.load`); an append-only
            run is read one segment at a time.
        out_dir: a directory (created if missing; the two files in it are replaced, both at the end:
            an error or Ctrl-C on the way leaves neither half written).
        batch: records per row group.

    Returns:
        ``{"steps": rows, "nodes": rows}`` written.

    Raises:
        ImportError: pyarrow is not installed (the message says how to install it).
        NotADirectoryError: ``out_dir`` is a file.
    """
    pa, pq = _need_pyarrow()
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir}: is a file, not a directory for the Parquet tables")
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    step_schema = pa.schema([("request", pa.int32()), ("request_id", pa.string()), ("step", pa.int32()),
                             ("num_nodes", pa.int32()), ("accept_length", pa.int32()), ("tau", pa.int32()),
                             ("bonus_token", pa.int32()), ("support_exhausted", pa.bool_()), ("prefix_len", pa.int32()),
                             ("temperature", pa.float32()), ("top_k", pa.int32()), ("top_p", pa.float32()),
                             ("min_p", pa.float32()), ("level", pa.string()), ("backend", pa.string()),
                             ("lossy", pa.bool_()), ("did_not_return", pa.bool_()),
                             *((f"t_{s}", pa.float64()) for s in STAGES)])
    node_schema = pa.schema([("request", pa.int32()), ("step", pa.int32()), ("node", pa.int32()), ("parent", pa.int32()),
                             ("depth", pa.int16()), ("rank", pa.int16()), ("first_child", pa.bool_()),
                             ("token", pa.int32()), ("target_p", pa.float64()), ("drafter_q", pa.float64()),
                             ("accepted", pa.bool_()), ("parent_accepted", pa.bool_()), ("accept_length", pa.int16()),
                             ("temperature", pa.float32())])
    # each table to a temporary name, both renamed at the end: an error or Ctrl-C leaves no half-written table
    tmp = {k: out_dir / f".{k}.parquet.{os.getpid()}.partial" for k in ("steps", "nodes")}
    try:
        counts = {"steps": 0, "nodes": 0}
        with pq.ParquetWriter(str(tmp["steps"]), step_schema) as sw, \
                pq.ParquetWriter(str(tmp["nodes"]), node_schema) as nw:
            for steps in _iter_batches(run, batch):
                sc = {k: [] for k in STEP_COLUMNS}
                nc = {k: [] for k in NODE_COLUMNS}
                for s in steps:
                    _step_row(s, sc)
                    _node_rows(s, nc)
                sw.write_table(pa.table(sc, schema=step_schema))
                counts["steps"] += len(steps)
                if nc["node"]:
                    arrays = {k: np.concatenate(v) for k, v in nc.items()}
                    table = pa.table({k: pa.array(v, type=node_schema.field(k).type,
                                                  from_pandas=k in ("target_p", "drafter_q")) for k, v in arrays.items()},
                                     schema=node_schema)
                    nw.write_table(table)
                    counts["nodes"] += len(arrays["node"])
        for k, t in tmp.items():
            os.replace(t, out_dir / f"{k}.parquet")
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)
        if created and not any(out_dir.iterdir()):  # made here and nothing written in it: gone again
            out_dir.rmdir()
    return counts
