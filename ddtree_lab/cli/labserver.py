"""Open the lab: working copies of labs/*.ipynb in .lab/, JupyterLab on a free 127.0.0.1 port.

The one implementation behind ``ddtree-lab lab`` and ``make lab`` (``scripts/lab.sh`` calls
the CLI). The tracked notebooks in ``labs/`` are never served: Jupyter runs on copies in
``.lab/`` (ignored by git), so running and saving them leaves ``git status`` clean. A tracked
notebook newer than its copy replaces it; the old copy is kept as ``NAME.ipynb.bak``.

The port is picked before Jupyter starts (the first free one from the asked port on) and
Jupyter is told not to move off it (``--ServerApp.port_retries=0``), so the printed link is
the address the server binds.

The token reaches Jupyter in its environment (``JUPYTER_TOKEN``, :func:`jupyter_env`), never on
its command line: any local user reads a process's arguments (``ps``, ``/proc/PID/cmdline``),
while its environment is readable by its own user only.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

__all__ = ["working_copies", "trust_shipped", "free_port", "jupyter_command", "jupyter_env", "lab_url"]


def working_copies(labs: Path, work: Path) -> list[str]:
    """Copy each ``labs/*.ipynb`` to ``work/`` unless its copy there is as new; returns one
    line per replaced copy (naming the ``.bak`` it kept).

    Raises:
        FileNotFoundError: ``labs`` is not a directory or holds no notebook.
    """
    labs, work = Path(labs), Path(work)
    notebooks = sorted(labs.glob("*.ipynb")) if labs.is_dir() else []
    if not notebooks:
        raise FileNotFoundError(f"{labs}: no notebooks (run from a ddtree-lab checkout)")
    work.mkdir(parents=True, exist_ok=True)
    notes = []
    for nb in notebooks:
        copy = work / nb.name
        if copy.exists() and nb.stat().st_mtime <= copy.stat().st_mtime:
            continue
        if copy.exists():
            shutil.copy2(copy, copy.with_name(copy.name + ".bak"))
            notes.append(f"{nb.name}: the tracked notebook is newer; your old copy is {copy.name}.bak")
        shutil.copy2(nb, copy)
        os.utime(copy)  # the copy is now newer than the tracked file
    return notes


def trust_shipped(labs: Path, work: Path, notary=None) -> list[str]:
    """Sign (Jupyter's notebook trust, ``nbformat.sign``) each working copy in ``work/`` whose
    content is still the tracked ``labs/`` notebook's, so its saved outputs render in JupyterLab:
    an untrusted notebook shows a tree's SVG and the HTML tables as their text fallback. A copy
    the user changed is not signed here (Jupyter signs what the user runs and saves). Returns one
    line per copy that could not be read as a notebook (left unsigned).

    ``notary``: an ``nbformat.sign.NotebookNotary`` (default: the user's, the one Jupyter checks)."""
    import nbformat
    from nbformat.sign import NotebookNotary

    notary = NotebookNotary() if notary is None else notary
    notes = []
    for nb in sorted(Path(labs).glob("*.ipynb")):
        copy = Path(work) / nb.name
        if not copy.is_file() or copy.read_bytes() != nb.read_bytes():
            continue
        try:
            doc = nbformat.reads(copy.read_text(), as_version=4)
        except Exception as e:  # any unreadable file: say so, serve it untrusted
            notes.append(f"{copy.name}: not read as a notebook ({type(e).__name__}); its saved outputs show as text")
            continue
        if not notary.check_signature(doc):
            notary.sign(doc)
    return notes


def free_port(start: int, tries: int = 50, host: str = "127.0.0.1") -> int:
    """The first port from ``start`` on (at most ``tries``) that ``host`` can bind now.

    Raises:
        ValueError: ``start`` outside 1..65535.
        OSError: none of the ports is free (naming the range).
    """
    if not 1 <= start <= 65535:
        raise ValueError(f"port {start}: must be in 1..65535")
    for port in range(start, min(start + tries, 65536)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on {host} in {start}..{min(start + tries, 65536) - 1}")


def jupyter_command(jupyter: str, port: int, root_dir: Path, as_root: bool = False) -> list[str]:
    """The JupyterLab command line: 127.0.0.1 only, exactly ``port``. It holds no token: token
    auth comes from the environment :func:`jupyter_env` makes (``ps`` shows arguments to every user)."""
    cmd = [jupyter, "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
           f"--ServerApp.root_dir={root_dir}"]
    return cmd + (["--allow-root"] if as_root else [])


def jupyter_env(token: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment to start Jupyter in: ``base`` (default ``os.environ``) with
    ``JUPYTER_TOKEN`` set to ``token`` (Jupyter Server's IdentityProvider reads it) and any
    ``JUPYTER_TOKEN_FILE`` left out, so that the token is this one.

    Raises:
        ValueError: an empty token (Jupyter would serve without authentication).
    """
    if not token:
        raise ValueError("token: empty (Jupyter would serve without authentication)")
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "JUPYTER_TOKEN_FILE"}
    env["JUPYTER_TOKEN"] = token
    return env


def lab_url(port: int, token: str, notebook: str = "01_live_step.ipynb") -> str:
    return f"http://127.0.0.1:{port}/lab/tree/{notebook}?token={token}"
