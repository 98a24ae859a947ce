"""Session-scoped real-model fixtures (the embedded default target and its drafter)."""

import pytest
import torch


@pytest.fixture(scope="session")
def target():
    from ddtree_lab.models import load_default_target

    return load_default_target(dtype=torch.float32)


@pytest.fixture(scope="session")
def drafter(target):
    from ddtree_lab.models import RidgeDrafter

    return RidgeDrafter.load(target)
