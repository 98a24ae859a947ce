"""The installed SGLang's own code where its module cannot be imported on this machine.

Some of SGLang's draft-side and accept code lives in modules whose imports reach the whole
server (``sglang.srt.models.dflash`` imports torchvision through the model configs,
``sglang.kernels.ops.speculative.dspark.dspark_accept`` imports the scheduler, ``dflash_utils``
needs ``tvm_ffi``), none of which the lab installs. :func:`load_module_source` runs the installed
file's own text statement by statement in a fresh namespace: an import that fails is skipped
and named (:attr:`SourceModule.skipped`), every other top-level statement runs as written, so
the functions and classes it defines are the engine's, line for line (tracebacks point at the
installed file). Two changes, both named in :attr:`SourceModule.changes`: ``@torch.compile``
decorators are dropped (they change speed, not results; compiling needs a C compiler here),
and names the file imports from a module that failed can be supplied from another
:class:`SourceModule` (``provide``).

Nothing here is copied from SGLang: the text is read from the installed package at run time.
"""

from __future__ import annotations

import __future__
import ast
import hashlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SourceModule", "load_module_source", "installed_file"]


@dataclass
class SourceModule:
    """The namespace of one installed file run statement by statement.

    Attributes:
        module: the dotted module name (``sglang.srt.models.dflash``).
        path: the installed file.
        sha256: the file's SHA-256 (what was run).
        namespace: the names it defined.
        skipped: ``(line, statement's first line, error)`` of each statement that failed.
        changes: what was changed on the way (decorators dropped, names supplied).
    """

    module: str
    path: Path
    sha256: str
    namespace: dict
    skipped: list = field(default_factory=list)
    changes: list = field(default_factory=list)

    def __getitem__(self, name: str):
        """The object ``name`` the file defines.

        Raises:
            KeyError: the file defines no such name here (the statements that failed are named).
        """
        if name not in self.namespace:
            failed = "; ".join(f"line {ln}: {err}" for ln, _, err in self.skipped[:6])
            raise KeyError(f"{self.module} ({self.path}) defines no {name!r} here; statements that failed: {failed}")
        return self.namespace[name]


def installed_file(module: str) -> Path:
    """The installed source file of ``module`` (found without importing it).

    Raises:
        ImportError: no such module installed.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ImportError(f"{module} is not installed here (no source file)")
    return Path(spec.origin)


def _is_torch_compile(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return ast.unparse(target) in ("torch.compile", "compile")


def load_module_source(module: str, provide: dict | None = None) -> SourceModule:
    """Run the installed ``module``'s file statement by statement (module docstring).

    Args:
        module: dotted name of an installed module.
        provide: names to put in the namespace before the file runs (for names the file
            imports from a module that cannot be imported here); each is listed in ``changes``.

    Returns:
        :class:`SourceModule`.

    Raises:
        ImportError: the module is not installed.
    """
    path = installed_file(module)
    text = path.read_text()
    tree = ast.parse(text, str(path))
    flags = 0
    ns: dict = {"__name__": f"ddtree_lab_source.{module}", "__file__": str(path), "__builtins__": __builtins__}
    out = SourceModule(module, path, hashlib.sha256(text.encode()).hexdigest(), ns)
    for name, value in (provide or {}).items():
        ns[name] = value
        out.changes.append(f"{name} supplied by the lab from {getattr(value, '__module__', '?')}")
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
            for alias in stmt.names:
                flags |= getattr(__future__, alias.name).compiler_flag
            continue
        if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
            kept = [d for d in stmt.decorator_list if not _is_torch_compile(d)]
            if len(kept) != len(stmt.decorator_list):
                out.changes.append(f"@torch.compile dropped from {stmt.name} (line {stmt.lineno})")
                stmt.decorator_list = kept
        if isinstance(stmt, (ast.Import, ast.ImportFrom)) and provide:
            names = [a.asname or a.name for a in stmt.names]
            if names and all(n in provide for n in names):
                continue  # supplied above
        code = compile(ast.Module(body=[stmt], type_ignores=[]), str(path), "exec", flags=flags, dont_inherit=True)
        try:
            exec(code, ns)
        except Exception as err:  # an import this machine lacks, or a name from one
            first = ast.get_source_segment(text, stmt) or ""
            out.skipped.append((stmt.lineno, first.splitlines()[0] if first else "", f"{type(err).__name__}: {err}"))
    return out
