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


@pytest.fixture(scope="session", autouse=True)
def single_thread():
    """Run a module's model tests on one intra-op thread (restored afterwards): the tiny model's
    GEMMs are far too small to gain from a second thread, and with other processes on the
    machine OpenMP's spin-waiting made these modules ~10x slower (2 cores, 2 threads)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    """Each test module starts with Dynamo's caches empty: every module compiles the same
    V41Model.forward again, and Dynamo's per-code-object recompile limit (8) counts the compiled
    entries of all earlier modules too, so the order of modules would decide what fails."""
    torch._dynamo.reset()
    yield
