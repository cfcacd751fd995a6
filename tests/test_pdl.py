"""Programmatic dependent launch (custom_ops/triton/common.py: pdl, _wait_for_inputs).

A kernel launched with PDL may start while the kernel before it still runs, so every one of our
kernels must wait before its first memory access, in every program. The CPU tests check that
rule over the source (each launched kernel's first statement, each launch's launch_pdl) and the
switch; the CUDA test runs a chain of dependent kernels captured with PDL against the same chain
launched without it, bit for bit.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

KERNEL_DIR = Path(__file__).resolve().parents[1] / "custom_ops" / "triton"


def _launches():
    """(file, kernel name, ast.Call) of every `kernel[grid](...)` launch in custom_ops/triton."""
    for path in sorted(KERNEL_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id.endswith("_kernel")):
                yield path.name, node.func.value.id, node


def _kernel_defs():
    """kernel name -> its ast.FunctionDef, over custom_ops/triton."""
    defs = {}
    for path in sorted(KERNEL_DIR.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                defs[node.name] = node
    return defs


def test_every_launched_kernel_waits_first_and_every_launch_passes_launch_pdl():
    defs = _kernel_defs()
    launches = list(_launches())
    assert len({name for _, name, _ in launches}) >= 30       # the count of our kernels today
    for file, name, call in launches:
        assert any(k.arg == "launch_pdl" or k.arg is None for k in call.keywords), \
            f"{file}: the launch of {name} passes no launch_pdl"
        body = [s for s in defs[name].body
                if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]   # past the docstring
        first = body[0]
        assert (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                and getattr(first.value.func, "id", None) == "_wait_for_inputs"), \
            f"{file}: {name} does not call _wait_for_inputs() as its first statement"


def test_pdl_switch(monkeypatch):
    pytest.importorskip("triton")
    from v41graph.custom_ops.triton.common import pdl
    monkeypatch.delenv("V41GRAPH_PDL", raising=False)
    assert pdl("cpu") is False
    monkeypatch.setenv("V41GRAPH_PDL", "1")
    assert pdl("cpu") is False                              # a CUDA launch attribute only
    monkeypatch.setenv("V41GRAPH_PDL", "yes")
    with pytest.raises(ValueError, match="V41GRAPH_PDL must be '0' or '1', got 'yes'"):
        pdl("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_captured_chain_with_pdl_equals_the_chain_without(monkeypatch):
    """fp8_linear -> rms_norm -> fp8_linear -> swiglu, each reading the one before: captured with
    PDL (where the GPU has it) and replayed 20 times, against eager launches without PDL. A
    kernel reading before its producer finished would show as different bits."""
    pytest.importorskip("triton")
    from cuda_graphs import capture
    from v41graph.custom_ops.triton import norms, quant_gemm, swiglu
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 2048, device="cuda", generator=g).bfloat16()
    w1 = torch.randint(0, 256, (4096, 2048), device="cuda", dtype=torch.uint8, generator=g) & 0xB7
    s1 = torch.randint(118, 126, (128, 64), device="cuda", dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (2048, 4096), device="cuda", dtype=torch.uint8, generator=g) & 0xB7
    s2 = torch.randint(118, 126, (64, 128), device="cuda", dtype=torch.uint8, generator=g)
    nw = torch.rand(4096, device="cuda", generator=g).bfloat16()

    def chain():
        h = norms.rms_norm(quant_gemm.fp8_linear(x, w1, s1, torch.bfloat16), nw, 1e-6)
        y = quant_gemm.fp8_linear(h, w2, s2, torch.bfloat16)
        return swiglu.swiglu(y[:, :1024], y[:, 1024:], 7.0)

    monkeypatch.setenv("V41GRAPH_PDL", "0")
    want = chain()
    monkeypatch.setenv("V41GRAPH_PDL", "1")
    graph, got = capture(chain)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
