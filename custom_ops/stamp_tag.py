"""`torch.ops.v41graph.stamp_tag(x, tag)`: names a value in a graph traced for layer stamping.

The compiler traces one layer per role and stamps copies of it into the other layers
(compiler/stamp.py). To copy a layer it must know which of the values the layer reads from
outside itself are which: the streams entering and leaving it, a top-k or candidate list of
its index source, an index tensor that the first layer needing it built for all. A graph has
no Python names, so the model wraps those values in this op, only while tracing for stamping
(StepContext.stamp); the stamper reads the tags and removes every one of them before our
passes run. As an op it is a copy (functionalization must see a new tensor, not an alias).
"""
from __future__ import annotations

import torch
from torch.library import custom_op


@custom_op("v41graph::stamp_tag", mutates_args=())
def stamp_tag(x: torch.Tensor, tag: str) -> torch.Tensor:
    return x.clone()


@stamp_tag.register_fake
def _(x, tag):
    return torch.empty_like(x)
