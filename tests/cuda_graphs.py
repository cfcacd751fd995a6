"""Capturing a function into a CUDA graph for the GPU tests: warm up on a side stream (Triton's
JIT and library setup must not happen inside a capture), then capture one call."""
from __future__ import annotations

import torch


def capture(fn, warmups: int = 1):
    """(graph, what fn returned inside the capture): replaying the graph refills those tensors."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
