"""The fast loop's auto-marking (tests/conftest.py): real-model tests are slow, and the guard bites."""

import pytest


def test_real_model_tests_are_marked_slow_by_conftest(request):
    items = request.session.items
    by_id = {i.nodeid.split("::", 1)[-1]: i for i in items}
    uses_model = [i for i in items if {"target", "drafter"} & set(i.fixturenames)]
    assert all(i.get_closest_marker("slow") for i in uses_model)
    for name in ("test_doctor_with_the_model", "test_every_kernel_configuration_compiles_for_sm80_sm90_sm100_without_spills"):
        if name in by_id:
            assert by_id[name].get_closest_marker("slow"), name
    assert request.node.get_closest_marker("slow") is None


def test_the_guard_refuses_the_real_model_in_a_fast_test():
    from ddtree_lab.models import load_default_target

    with pytest.raises(RuntimeError, match="loads the real model but is not marked slow"):
        load_default_target()
    from ddtree_lab.notebook import load_default

    with pytest.raises(RuntimeError, match="not marked slow"):
        load_default()
