"""One name per thing: no public function or class of the package shares its name with a module."""

import importlib
import inspect
import pkgutil

import ddtree_lab


def test_no_public_function_shadows_a_module():
    modules = {}
    for info in pkgutil.walk_packages(ddtree_lab.__path__, "ddtree_lab."):
        parent, _, leaf = info.name.rpartition(".")
        modules.setdefault(parent, set()).add(leaf)
    shadowed = []
    for parent, leaves in modules.items():
        if parent.startswith("ddtree_lab._sglang_hook"):
            continue
        pkg = importlib.import_module(parent)
        for leaf in sorted(leaves):
            obj = pkg.__dict__.get(leaf)
            if obj is not None and (inspect.isfunction(obj) or inspect.isclass(obj)):
                shadowed.append(f"{parent}.{leaf}")
    assert not shadowed, f"functions or classes named like a module: {shadowed}"


def test_the_three_views_of_the_diagnosis_package():
    import ddtree_lab.diagnosis as diagnosis

    assert inspect.ismodule(diagnosis) and hasattr(diagnosis, "__path__")
    for name in ("check", "doctor", "diagnose", "replay", "load"):
        assert inspect.isfunction(getattr(ddtree_lab, name)), name
