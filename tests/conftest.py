"""Shared fixtures and the test session's numerical setting.

MKL_CBWR=COMPATIBLE is set before torch is imported (so before the process's first BLAS call):
oneMKL otherwise picks CPU-specific fp32 SGEMM kernels (AVX-512 / AMX paths on newer Xeons)
whose sums differ in the last bits, and the model's FP8/FP4 quantization points amplify that to
~0.3 on a logit. DeepSeek's golden vectors were made under this setting with 2 torch threads;
the golden modules run on 2 threads (`reference_threads`), everything else on one.

ATEN_CPU_CAPABILITY=avx2 (and ONEDNN_MAX_CPU_ISA=AVX2) does the same for torch's own vectorized
kernels (exp, softmax, reductions), which otherwise follow the CPU's widest ISA: the model's
quantization points turn their last-bit differences into logit differences above the
consistency tests' 1e-4 (chunked vs whole prefill, speculative vs plain greedy: one CI CPU
failed both while this machine passed; here, ATEN_CPU_CAPABILITY=default gave 6.4e-4 on the
prefix-prefill test). Pinned to AVX2, every x86-64 CPU of the last decade runs the same kernels;
the golden vectors replay under it too.
"""
from __future__ import annotations

import os
import platform

os.environ["MKL_CBWR"] = "COMPATIBLE"
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"

import pytest  # noqa: E402
import torch  # noqa: E402

import v41graph  # noqa: E402
from v41graph.model.model import V41Model, init_random_  # noqa: E402

# The thread count the golden vectors were made with (shared/golden README).
REFERENCE_THREADS = 2


def pytest_addoption(parser):
    parser.addoption("--reverse-order", action="store_true",
                     help="run the collected tests last to first (a check that no test depends "
                          "on what an earlier one left behind)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse-order"):
        items.reverse()


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


@pytest.fixture(scope="module")
def reference_threads():
    """The golden vectors' thread count for one module (a module uses it with
    `pytestmark = pytest.mark.usefixtures("reference_threads")`): the fp32 reductions of the
    reference run depend on how MKL splits them over threads."""
    n = torch.get_num_threads()
    torch.set_num_threads(REFERENCE_THREADS)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    """Each test module starts with Dynamo's caches empty: every module compiles the same
    V41Model.forward again, and Dynamo's per-code-object recompile limit (8) counts the compiled
    entries of all earlier modules too, so the order of modules would decide what fails."""
    torch._dynamo.reset()
    yield


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random tiny checkpoint folder with its small real tokenizer (random_tokenizer.py):
    what `v41graph serve` and the text tests load."""
    from v41graph.weights.random_checkpoint import write_random_checkpoint

    out = tmp_path_factory.mktemp("tiny_checkpoint")
    write_random_checkpoint(v41graph.V41Config.tiny(), out, seed=0, progress=False)
    return out
