"""Stream and event ops the passes insert into graphs: `torch.ops.v41graph.stream_enter(tag)`,
`stream_exit()`, `event_record(tag)`, `event_wait(tag)`.

They are our own side-effecting custom ops (DESIGN.md: Dynamo's built-in stream support does
not overlap anything on torch 2.11). Tags are plain strings; the tag -> stream / event map is
resolved at run time from the current device, never baked in at trace time, so one graph runs
on CPU (every op is a no-op), on CUDA (torch.cuda streams and events; inside a CUDA-graph
capture they become the graph's fork/join edges), and is lowered to torchair's
`air.scope_enter` / `air.tagged_event_*` ops on Ascend (v41graph/compiler/npu.py).

A fork/join in a graph reads:
    event_record("fork:T")      on main: everything the side work needs is ready
    stream_enter("aux:T")       switch to the auxiliary stream of tag T
    event_wait("fork:T")
    ... side work ...
    event_record("join:T")
    stream_exit()               back to the stream that was current before
    ... main work ...
    event_wait("join:T")        before the first main-stream consumer of the side work
"""
from __future__ import annotations

import torch
from torch.library import custom_op


class StreamRuntime:
    """Per-process map of tags to CUDA streams and events (created on first use)."""

    def __init__(self):
        self.streams: dict = {}
        self.events: dict = {}
        self.stack: list = []

    @staticmethod
    def active() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def stream(self, tag: str):
        device = torch.cuda.current_device()
        key = (device, tag)
        if key not in self.streams:
            self.streams[key] = torch.cuda.Stream(device=device)
        return self.streams[key]

    def event(self, tag: str):
        key = (torch.cuda.current_device(), tag)
        if key not in self.events:
            self.events[key] = torch.cuda.Event()
        return self.events[key]


RUNTIME = StreamRuntime()


@custom_op("v41graph::stream_enter", mutates_args=())
def stream_enter(tag: str) -> None:
    if RUNTIME.active():
        RUNTIME.stack.append(torch.cuda.current_stream())
        torch.cuda.set_stream(RUNTIME.stream(tag))


@custom_op("v41graph::stream_exit", mutates_args=())
def stream_exit() -> None:
    if RUNTIME.active() and RUNTIME.stack:
        torch.cuda.set_stream(RUNTIME.stack.pop())


@custom_op("v41graph::event_record", mutates_args=())
def event_record(tag: str) -> None:
    if RUNTIME.active():
        RUNTIME.event(tag).record(torch.cuda.current_stream())


@custom_op("v41graph::event_wait", mutates_args=())
def event_wait(tag: str) -> None:
    if RUNTIME.active():
        torch.cuda.current_stream().wait_event(RUNTIME.event(tag))


@custom_op("v41graph::mark_stream_use", mutates_args=())
def mark_stream_use(tensors: list[torch.Tensor]) -> None:
    """Tell the caching allocator these tensors are used on the current stream too, so their
    memory is not handed out again before this stream is done with them (tensors crossing a
    fork or a join). Needed inside a CUDA-graph capture as well: there the allocator defers
    reusing such blocks until the capture ends, else a later kernel on the producing stream
    could overwrite a block the other stream still reads when the graph replays."""
    if RUNTIME.active():
        stream = torch.cuda.current_stream()
        for t in tensors:
            if t.is_cuda:
                t.record_stream(stream)


STREAM_OPS = (
    torch.ops.v41graph.stream_enter.default,
    torch.ops.v41graph.stream_exit.default,
    torch.ops.v41graph.event_record.default,
    torch.ops.v41graph.event_wait.default,
    torch.ops.v41graph.mark_stream_use.default,
)
for _op in STREAM_OPS:   # keep them through dead-code elimination
    torch.fx.node.has_side_effect(_op)
