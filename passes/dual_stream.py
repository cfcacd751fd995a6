"""P6: the indexer and the window-KV / index-K cache writes on a side stream.

Per attention layer, two side-stream regions:
  select   the lightning indexer (its own query projection, FP4 quantization, head weights,
           scoring and top-k: `indexer_topk` in Full layers, `indexer_topk_candidates` in
           Reindex layers, and every producer used only by it) together with the index-key
           write, forked as soon as their inputs are ready, so the main stream's query
           projection runs at the same time; joined before the attention gathers rows.
  window   the window-KV write, forked after the window is read, overlapping the attention and
           output projection; joined before the graph ends (the next step reads it).
The seed's reference: the Ascend port already overlaps the Q projection with the KV writes;
this extends it to indexer selection and the window scatter.
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch
import torch.fx as fx

from .base import GraphPass, is_call, module_path
from .side_stream import exclusive_ancestors, move_to_side_stream

ops = torch.ops.v41graph
_LAYER = re.compile(r"layers\.(\d+)\.")


def _layer_of(node: fx.Node) -> str:
    m = _LAYER.search(module_path(node) + ".")
    return m.group(1) if m else "?"


class DualStream(GraphPass):
    name = "dual_stream"

    def run(self, gm: fx.GraphModule) -> int:
        select, window = defaultdict(list), defaultdict(list)
        for n in gm.graph.nodes:
            if is_call(n, ops.indexer_topk.default, ops.indexer_topk_candidates.default,
                       ops.index_k_write.default):
                select[_layer_of(n)].append(n)
            elif is_call(n, ops.window_kv_write.default):
                window[_layer_of(n)].append(n)
        count = 0
        for layer, targets in select.items():
            move_to_side_stream(gm, exclusive_ancestors(targets), "select", f"select.{layer}")
            count += len(targets)
        for layer, targets in window.items():
            move_to_side_stream(gm, exclusive_ancestors(targets), "window", f"window.{layer}")
            count += len(targets)
        return count
