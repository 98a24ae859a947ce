import os

import torch

# The Triton kernels (the lab's and SGLang's) run under the interpreter on a machine without
# CUDA. Triton reads this when a kernel is defined, so it is set once here, before any test
# module imports a kernel: results never depend on collection order. On a GPU the same tests
# run natively.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Keep a shared CI machine responsive: the lab picks torch's thread count from the cores it may
# use and their load (ddtree_lab.threads; DDTREE_LAB_THREADS=N overrides).
from ddtree_lab.threads import configure_threads

configure_threads()

from model_fixtures import drafter, target  # noqa: E402,F401  (real-model fixtures)

import pytest  # noqa: E402

# -- the fast loop (`make test-fast` = `pytest -m "not slow"`) --------------------------------
# Every test whose cost comes from one of these causes is marked slow here, at collection, so a
# new test cannot forget the mark. `make test` (no -m) still runs and asserts everything.

#: Fixtures that load the real model (SmolLM2 + a drafter). `item.fixturenames` is the whole
#: fixture closure, so any fixture built on them (e.g. test_audit's `real`) counts too.
REAL_MODEL_FIXTURES = {"target", "drafter"}

#: Whole modules: notebooks (a Jupyter kernel each), the browser (playwright), the vLLM venv,
#: the real-model session tests, the Triton kernels (the lab's and SGLang's: interpreted on a
#: CPU, seconds a launch), the README's examples (the CLI in fresh processes) and the rule-family
#: fits (many planted runs each; measured 2026-12-04: 97 + 33 + 54 + 65 s of a 391 s loop).
SLOW_MODULES = {"test_notebooks.py", "test_browser.py", "test_engine_vllm.py", "test_vllm_engine.py", "test_models.py",
                "test_session.py", "test_session_backends.py", "test_session_batched.py",
                "test_verify_triton.py", "test_sglang_kernels.py", "test_readme.py",
                "test_rule_inference.py", "test_law_families.py"}

#: Code that makes a test slow wherever it appears (checked in the test function's source).
SLOW_SOURCE = {"nbclient": "runs a notebook in a Jupyter kernel", "playwright": "drives a browser",
               "resources.measure(": "compiles every Triton kernel for real GPU targets (sm_80/90/100)"}

#: Tests measured slow (seconds on the 2-core CI-like machine, 2026-12-03) for other reasons.
SLOW_TESTS = {
    # load the real model without the fixtures (CLI `--model default`, `record`, lab.load_default)
    "test_cli.py::test_audit_with_the_model_audits_the_transforms": "real model via the CLI",
    "test_cli.py::test_doctor_with_the_model": "real model via the CLI",
    "test_cli.py::test_record_inline_and_jsonl": "real model via `record`",
    "test_cli.py::test_a_lossy_recording_is_marked_by_info_replay_and_render": "real model via `record`",
    "test_recording_scale.py::test_record_on_ctrl_c_keeps_what_it_has": "real model via `record`",
    "test_dflash.py::test_lab_loads_either_drafter": "real model via lab.load_default",
    # many fresh Python processes (each imports torch)
    "test_cli.py::test_a_corrupted_step_is_named_and_the_others_stay_readable": "18 s, CLI in fresh processes",
    "test_cli.py::test_errors_are_one_line_without_traceback": "10 s, CLI in fresh processes",
    "test_gpu_check.py": "30 s, gpu_check.sh --dry-run in a fresh process",
    "test_sglang_recorder.py::test_environment_hook_records_in_a_fresh_process": "9 s, fresh process",
    "test_recording_scale.py::test_scale_benchmark_at_its_smallest_size": "12 s, the scale benchmark",
    # long randomized / statistical tests, kernels under the interpreter on large shapes
    "test_recording_faults.py::test_every_finished_step_survives_sigkill_at_random_points": "26 s, random kills",
    "test_verify.py::test_lossy_threshold_fails_the_same_test": "14 s, statistical",
    "test_verify.py::test_sampled_verify_emits_the_target_law": "23 s over 10 trees, statistical",
    "test_failure_kinds.py::test_a_banned_token_is_never_emitted_as_draft_or_bonus": "13 s, interpreter",
    "test_audit.py::test_filtering_order_mismatch_is_caught_and_visible_against_the_sampler": "7 s, statistical",
    "test_recording_faults.py::test_a_kernel_that_never_returns_leaves_its_inputs_on_disk": "9 s, waits out a hung kernel",
    "test_policies.py::test_exact_expected_tau_equals_mean_of_sampled_verifies": "9 s, statistical",
    "test_failure_kinds.py::test_a_greedy_request_in_a_permuted_mixed_batch_emits_its_argmax_path": "9 s, interpreter",
    "test_verify.py::test_acceptance_probabilities_are_the_target_p_and_differ_under_thresholds": "5 s, statistical",
}


def slow_reason(item) -> str | None:
    """Why ``item`` belongs outside the fast loop, or None."""
    if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
        return "loads the real model (fixture)"
    module = item.path.name
    if module in SLOW_MODULES:
        return f"module {module}"
    base = item.nodeid.split("[")[0].split("/")[-1]
    for key in (base, module):
        if key in SLOW_TESTS:
            return SLOW_TESTS[key]
    fn = getattr(item, "function", None)
    if fn is not None:
        import inspect

        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):
            src = ""
        for needle, why in SLOW_SOURCE.items():
            if needle in src:
                return why
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") is None and slow_reason(item) is not None:
            item.add_marker(pytest.mark.slow)


NOT_SLOW_LOADS_MODEL = ("this test loads the real model but is not marked slow: add it to tests/conftest.py "
                        "(SLOW_TESTS, with the reason) or take the `target` / `drafter` fixture")


@pytest.fixture(autouse=True)
def _fast_tests_do_not_load_the_real_model(request, monkeypatch):
    """The guard: in a test not marked slow, the real-model loader raises, so the fast loop fails
    loudly instead of silently slowing down."""
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(NOT_SLOW_LOADS_MODEL)

    import ddtree_lab.models as models
    import ddtree_lab.models.target as target_mod

    monkeypatch.setattr(target_mod, "load_default_target", refuse)
    monkeypatch.setattr(models, "load_default_target", refuse)
