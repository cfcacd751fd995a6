"""`torch.ops.v41graph.layer_done(token, ready, layer_id)`: a point between two layers of a
graph where host code runs (v41graph.disagg's prefill worker packs and sends a layer's
hand-over part there while the next layer computes).

A graph has no Python between its ops, so the point is an op of its own. It declares that it
writes `token` (a one-byte buffer of the model's) only so that functionalization keeps it and
orders it like the cache writes (the defunctionalize pass makes it an in-place call again);
`ready` are the tensors the host code will read (the layer's caches): taking them as inputs
puts the op after their writes. The op itself writes nothing; it calls the function set with
`layer_hook(fn)` around the call (nothing outside one: a plain forward pays one Python call).
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.library import custom_op

_HOOK = contextvars.ContextVar("v41graph_layer_hook", default=None)


@custom_op("v41graph::layer_done", mutates_args=("token",))
def layer_done(token: torch.Tensor, ready: list[torch.Tensor], layer_id: int) -> None:
    hook = _HOOK.get()
    if hook is not None:
        hook(layer_id)


@layer_done.register_fake
def _(token, ready, layer_id):
    return None


@contextlib.contextmanager
def layer_hook(fn):
    """Call fn(layer_id) at every layer_done the graphs or modules run inside this block."""
    previous = _HOOK.set(fn)
    try:
        yield
    finally:
        _HOOK.reset(previous)
