"""Shared fixtures: one tiny random model per test session (fp32, dense weights)."""
from __future__ import annotations

import pytest
import torch

import v41graph
from v41graph.model import V41Model, init_random_


@pytest.fixture(scope="session")
def tiny_model():
    torch.manual_seed(0)
    model = init_random_(V41Model(v41graph.V41Config.tiny()), seed=0).eval()
    yield model
    model.debug = None
