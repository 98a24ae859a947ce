"""Start-up hook of ddtree-lab's SGLang recorder (``ddtree-lab sglang hook-dir``).

On ``PYTHONPATH`` it runs in every Python process: when ``DDTREE_LAB_SGLANG_RECORD`` is set it
calls :func:`ddtree_lab.sglang.environment.install_from_env`; then it runs the ``sitecustomize``
module it shadows, if there is one. It never stops the process: failures are printed.
"""

import os
import sys


def _install() -> None:
    if not os.environ.get("DDTREE_LAB_SGLANG_RECORD"):
        return
    try:
        from ddtree_lab.sglang.environment import install_from_env

        install_from_env()
    except Exception as err:
        print(f"[ddtree-lab] SGLang recorder not installed: {type(err).__name__}: {err}", file=sys.stderr)


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None and os.path.abspath(spec.origin or "") != os.path.abspath(__file__):
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_install()
try:
    _chain()
except Exception as err:
    print(f"[ddtree-lab] the shadowed sitecustomize failed: {type(err).__name__}: {err}", file=sys.stderr)
