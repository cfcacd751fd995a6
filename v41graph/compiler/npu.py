"""NPU lowering: our stream/event ops -> torchair's multi-stream ops (Ascend only).

torchair (inside torch_npu) expresses multi-stream graphs as
`torch.ops.air.scope_enter(["_user_stream_label"], [tag])` / `air.scope_exit()` and
`air.tagged_event_record(tag)` / `air.tagged_event_wait(tag)` (DESIGN.md). In aclgraph mode it
adds its own fork/join closure and keeps fusions inside one stream label. Nothing here imports
without the Ascend CANN runtime, so everything is imported lazily with a clear error.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from v41graph.passes.base import is_call

ops = torch.ops.v41graph


def require_torch_npu():
    """Import torch_npu + torchair or raise an error naming what is missing."""
    missing = []
    try:
        import torch_npu  # noqa: F401
    except Exception as exc:  # ImportError, or CANN libraries missing at load time
        missing.append(f"torch_npu ({exc.__class__.__name__}: {exc})")
    try:
        import torchair  # noqa: F401
    except Exception as exc:
        missing.append(f"torchair ({exc.__class__.__name__}: {exc})")
    if missing:
        raise RuntimeError("the npu backend needs the Ascend stack (CANN runtime, torch_npu with "
                           "torchair; `pip install -e .[npu]` for torch-npu and triton-ascend); "
                           "missing: " + "; ".join(missing))


def lower_stream_ops_to_air(gm: fx.GraphModule) -> int:
    require_torch_npu()
    air = torch.ops.air
    count = 0
    for node in list(gm.graph.nodes):
        if is_call(node, ops.stream_enter.default):
            new_target, args = air.scope_enter.default, (["_user_stream_label"], [node.args[0]])
        elif is_call(node, ops.stream_exit.default):
            new_target, args = air.scope_exit.default, ()
        elif is_call(node, ops.event_record.default):
            new_target, args = air.tagged_event_record.default, (node.args[0],)
        elif is_call(node, ops.event_wait.default):
            new_target, args = air.tagged_event_wait.default, (node.args[0],)
        else:
            continue
        node.target, node.args = new_target, args
        count += 1
    gm.recompile()
    return count


def torchair_backend(manager, aclgraph: bool = True):
    """torch.compile backend for Ascend: torchair's npu backend with our pass manager plugged in
    as its post-grad pass (then our stream ops lowered to air ops). With aclgraph=True torchair
    runs in "reduce-overhead" mode and captures ACL graphs itself (npugraph_ex); torchair adds
    the fork/join closure of the air stream scopes and keeps its fusions inside one label."""
    require_torch_npu()
    import torchair

    config = torchair.CompilerConfig()
    if aclgraph:
        config.mode = "reduce-overhead"

    def post_grad_pass(gm, example_inputs, compiler_config):
        manager(gm)
        lower_stream_ops_to_air(gm)

    config.post_grad_custom_post_pass = post_grad_pass
    return torchair.get_npu_backend(compiler_config=config)
