"""The report verb: one verify step as a Markdown bug report (tree picture, decision table, diagnosis, environment, replay command)."""

from __future__ import annotations

import importlib.metadata
import io
import os
import platform
import shlex
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from .common import CLIError, check_new_output, check_out_file, check_suffix, count, find_step, inputs_of, load_run

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".zip")

#: packages whose versions the environment section lists when they are installed here
PACKAGES = ("torch", "transformers", "triton", "safetensors", "graphviz", "sglang", "vllm")


def _archive_kind(path: str) -> str:
    name = path.lower()
    for suffix in ARCHIVE_SUFFIXES:
        if name.endswith(suffix):
            return "zip" if suffix == ".zip" else "tar.gz"
    raise CLIError(f"--archive {path}: name it .tar.gz, .tgz or .zip")


def _picture_names(md: Path) -> tuple[Path, Path]:
    """The tree pictures written beside ``md``: ``NAME-tree.svg`` and ``NAME-tree.png``."""
    stem = md.name[: -len(md.suffix)] if md.suffix else md.name
    return md.with_name(f"{stem}-tree.svg"), md.with_name(f"{stem}-tree.png")


def environment_rows(run) -> list[tuple[str, str, str]]:
    """(what, here, recorded with) for the lab, Python, the platform and the packages that
    matter (the engines' where installed); "recorded with" from the run's metadata."""
    from ..version import __version__

    recorded = run.metadata.get("versions") if isinstance(run.metadata.get("versions"), dict) else {}
    rows = [("ddtree-lab", __version__, str(recorded.get("ddtree_lab", "-"))),
            ("python", platform.python_version(), str(recorded.get("python", "-"))),
            ("platform", platform.platform(), "-")]
    for name in PACKAGES:
        try:
            here = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            here = ""
        if here or name in recorded:
            rows.append((name, here or "not installed", str(recorded.get(name, "-"))))
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def _table(head: list[str], rows: list[list]) -> list[str]:
    """A Markdown table (cells' ``|`` escaped)."""
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(_cell(str(c)) for c in r) + " |" for r in rows])


def source_name(path: str) -> str:
    """The name a report gives the reader for the source at ``path``: its file (or bundle
    directory) name without the reporter's folders (``/home/me/runs/run.ddtrace`` -> ``run.ddtrace``)."""
    return Path(path.rstrip("/\\")).name or path


def report_markdown(run, step, path: str, picture: str | None, picture_note: str, diagnosis, problems,
                    replay: list[str]) -> str:
    """The report's Markdown (module docstring): ``path`` the source as the reader knows it
    (:func:`source_name`), ``picture`` the image file the Markdown refers
    to (None: none was made, ``picture_note`` says why), ``diagnosis`` the
    :class:`~ddtree_lab.diagnosis.Diagnosis` of the step, ``problems`` its ``check(step)``
    :class:`~ddtree_lab.problems.Problem` list, ``replay`` the commands that reproduce it."""
    from ..views import decisions_markdown, step_view
    from ..views.model import lossy_mark

    meta = run.metadata
    target = meta.get("target") or {}
    drafter = meta.get("drafter") or {}
    tname = target.get("name", "unknown") if isinstance(target, dict) else str(target)
    dname = drafter.get("name", "unknown") if isinstance(drafter, dict) else str(drafter)
    p = step.params
    params = "not recorded" if p is None else p.label()
    bonus = step.bonus_token if step.output is not None else None
    bonus_text = ("" if bonus is None else "; bonus token not recorded" if bonus < 0 and step.rows is None
                  else "; no bonus token (support exhausted)" if bonus < 0 else f"; bonus token {bonus}")
    rid = "" if str(step.request_id) == str(step.request) else f" (`{step.request_id}`)"  # an id that adds nothing
    lines = [f"# DDTree verify step {step.step}, request {step.request}{rid}", "",
             f"From `{path}` ({run.source}). Target: {tname}; drafter: {dname}; sampling: {params}; "
             f"backend that ran: `{step.backend}`; {step.num_nodes} tree nodes; accepted "
             f"{step.accept_length} draft token(s)" + bonus_text
             + (f"; {lossy_mark(step.thresholds)}" if step.lossy else "")
             + ".", "", "## Tree (unvisited children collapsed)", ""]
    if picture is not None:
        lines += [f"![step {step.step}, request {step.request}: the draft tree, accepted path in green, rejected "
                  f"siblings in red, the bonus in blue]({picture})", "",
                  f"*Attach `{picture}` to the issue (drag it into the text box): GitHub replaces this link with the "
                  f"uploaded picture.* {picture_note}".rstrip()]
    else:
        lines.append(f"No picture: {picture_note}")
    lines += ["", "## Decisions", ""]
    try:
        lines.append(decisions_markdown(step_view(step, run, False)).rstrip())
    except (ValueError, KeyError) as exc:
        lines.append(f"No decision table: {exc}")
    lines += ["", "## Diagnosis", "", f"`check` on the step: {count(len(problems), 'problem')}."]
    if problems:
        lines += [""] + _table(["kind", "node", "field", "value", "limit", "message"],
                               [[x.kind, "-" if x.node is None else x.node, x.field or "-",
                                 "-" if x.value is None else f"{x.value:.6g}", "-" if x.limit is None else f"{x.limit:.6g}",
                                 x.message] for x in problems])
    if diagnosis is not None:
        from ..replaying import BY_DESIGN

        design = len(diagnosis.by_design)
        also = f" ({design} {BY_DESIGN}, not a finding)" if design else ""
        lines += ["", f"`diagnose` on the step (recorded data only): {count(len(diagnosis.findings), 'finding')}{also}; "
                      f"{sum(r.ran for r in diagnosis.results)} of {len(diagnosis.results)} checks ran.", ""]
        lines += _table(["check", "ran", "items", "result"],
                        [[r.check, "yes" if r.ran else "no", r.checked if r.ran else "-",
                          (r.why if not r.ran else f"{count(len(r.findings), 'finding')}"
                           + (f"; not run: {r.not_run}" if r.not_run else "") + r.note_text())]
                         for r in diagnosis.results])
        if diagnosis.findings:
            lines += ["", "Findings:", ""] + [f"- {f.line()}" for f in diagnosis.findings]
        if design:
            lines += ["", "By design (documented behaviour of the engine, docs/SGLANG.md):", ""] + [
                f"- BY DESIGN {r.check}: {line}" for r in diagnosis.results for line in r.by_design]
    lines += ["", "## Environment", ""]
    lines += _table(["", "here", "recorded with"], [list(r) for r in environment_rows(run)])
    lines += ["", "## Replay", "", "```bash"] + replay + ["```", ""]
    return "\n".join(lines)


def _tree_pictures(step, run) -> tuple[str | None, bytes | None, str]:
    """(SVG text, PNG bytes, note) of the collapsed tree; a picture that could not be made is
    None and the note says why."""
    from ..views import render_svg, step_view, to_dot

    try:
        dot = to_dot(step_view(step, run, True))
    except (ValueError, KeyError) as exc:
        return None, None, f"the step cannot be drawn ({exc})"
    try:
        svg = render_svg(dot)
    except RuntimeError as exc:
        return None, None, str(exc)
    import graphviz

    try:
        png = graphviz.Source(dot).pipe(format="png")
    except (graphviz.ExecutableNotFound, graphviz.CalledProcessError) as exc:
        return svg, None, f"(no PNG: {exc})"
    return svg, png, ""


def cmd_report(args) -> int:
    """Write one Markdown file ready to paste into a GitHub issue about one verify step: the
    collapsed tree as a picture (PNG and SVG beside the Markdown, referenced from it), the
    decision table as a Markdown table, the step's diagnosis (``check`` and ``diagnose`` on the
    recorded data: structured problems and findings), the environment (lab, Python, platform,
    torch and the engines where installed, beside the versions the run was recorded with) and
    the exact replay commands. With --archive, everything (the Markdown, the pictures and a
    bundle of the step, `ddtree-lab bundle`) goes into one .tar.gz or .zip. Without -o and
    --archive the Markdown prints on standard output (no picture is written)."""
    from ..diagnosis import check, diagnose

    if args.out:
        check_out_file(args.out)
        check_suffix(args.out, "markdown", (".md",))
        for p in (Path(args.out), *_picture_names(Path(args.out))):
            check_new_output(p, args.force, inputs=inputs_of(args))
    if args.archive:
        _archive_kind(args.archive)
        check_out_file(args.archive)
        check_new_output(args.archive, args.force, "--archive", inputs=inputs_of(args))
    run = load_run(args.trace)
    step = find_step(run, args.step, args.request, args.trace)
    svg, png, note = _tree_pictures(step, run)
    try:
        diagnosis = diagnose(run, step=step.step, request=step.request)
    except (KeyError, ValueError) as exc:
        raise CLIError(f"{args.trace}: {exc.args[0] if exc.args else exc}") from exc
    problems = check(step)
    where = ["--step", str(step.step), "--request", str(step.request)]
    name = source_name(args.trace)  # the reader has the file under its name, not at the reporter's path
    replay = [f"# in the folder holding {name} (the reporter's {run.source}: attach it, or make the report "
              "with --archive, which carries a bundle of this step)",
              shlex.join(["ddtree-lab", "replay", name, *where]),
              shlex.join(["ddtree-lab", "render", name, *where, "--format", "decisions"])]
    md_name = Path(args.out).name if args.out else "report.md"
    pictures = _picture_names(Path(md_name))
    picture = (pictures[1].name if png is not None else pictures[0].name) if svg is not None else None
    if args.out is None and args.archive is None:
        picture, note = None, "pass -o FILE.md (or --archive) to write the tree's picture beside the report"
    files: dict[str, bytes] = {}
    bundle_note = ""
    if args.archive:
        from ..io import bundle

        try:
            with tempfile.TemporaryDirectory() as tmp:
                made = bundle.save_bundle(bundle.make_bundle(run, step), Path(tmp) / "bundle")
                for f in sorted(made.iterdir()):
                    files[f"bundle/{f.name}"] = f.read_bytes()
            replay = ["ddtree-lab replay bundle/   # in the unpacked archive's folder: the step from its bundle, "
                      "no trace needed", f"# or, in the folder holding {name} (the reporter's {run.source}):"] + replay[1:]
        except (ValueError, OSError, AssertionError) as exc:
            bundle_note = f"no bundle in the archive: {exc}"
    text = report_markdown(run, step, name, picture, note, diagnosis, problems, replay)
    if bundle_note:
        text += f"\n{bundle_note}\n"
    if svg is not None:
        files[pictures[0].name] = svg.encode("utf-8")
    if png is not None:
        files[pictures[1].name] = png
    files[md_name] = text.encode("utf-8")
    if args.out:
        from .common import write_outputs

        out = Path(args.out)  # the Markdown and its pictures: all or none
        write_outputs({out.with_name(name): data for name, data in files.items() if not name.startswith("bundle/")})
        print(f"step {step.step}, request {step.request} -> {out}"
              + "".join(f", {out.with_name(n)}" for n in files if n != md_name and not n.startswith("bundle/")))
    if args.archive:
        _write_archive(Path(args.archive), f"report-step{step.step}-request{step.request}", files)
        print(f"step {step.step}, request {step.request} -> {args.archive} ({count(len(files), 'file')})")
    if not args.out and not args.archive:
        sys.stdout.write(text)
    return 0


def _write_archive(path: Path, folder: str, files: dict[str, bytes]) -> None:
    """``files`` under ``folder/`` in a .tar.gz or .zip at ``path``, written to a temporary file
    beside it first (a replaced archive is never left half written)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        if _archive_kind(str(path)) == "zip":
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
                for name, data in files.items():
                    z.writestr(f"{folder}/{name}", data)
        else:
            with tarfile.open(tmp, "w:gz") as t:
                for name, data in files.items():
                    info = tarfile.TarInfo(f"{folder}/{name}")
                    info.size, info.mode = len(data), 0o644
                    t.addfile(info, io.BytesIO(data))
        os.replace(tmp, path)
    except OSError as exc:
        raise CLIError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:  # renamed away on success; removed after an error or Ctrl-C
        tmp.unlink(missing_ok=True)
    from .common import wrote

    wrote(path)
