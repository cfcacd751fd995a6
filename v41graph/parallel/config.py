"""How V4.1 is laid out over ranks: `ParallelConfig(tp=, dp=, ep=)`, checked against a model
config before anything is built or any collective runs.

world_size = tp * dp ranks, one of two attention layouts:

  tp > 1  tensor-parallel attention: each rank computes num_attention_heads / tp query heads
          (wq_b, attn_sink, wo_a split by heads / output groups; wo_b row-parallel, its partial
          sums all-reduced in fp32) and index_n_heads / tp indexer heads (every tp-th head; the
          per-rank partial scores are all-gathered and summed in the single-device order, so
          the top-k selection is the single-device one); the window / compressed caches and
          their projections are replicated. Tokens are the same on every rank. Embedding and
          head are vocab-parallel (the logits are all-gathered, every rank has all of them).
  dp > 1  data-parallel attention: every rank holds the attention weights and its own
          sequences (caches, metadata); every step all ranks run the same number of tokens.

and one of two MoE layouts:

  ep == world_size > 1   expert parallel: rank r holds routed experts [r*E/ws, (r+1)*E/ws).
          Under tp the tokens are already everywhere: each rank runs its experts on them and the
          partial outputs are all-reduced with the attention's. Under dp the tokens travel:
          all-to-all dispatch to every expert rank (a fixed N rows per rank pair: static shapes,
          capturable, lossless), all-to-all combine back, summed in rank order.
  ep == 1  tp > 1: every expert (and the shared expert) split along its intermediate size;
          dp > 1: every rank holds every expert.

The shared expert is tensor-parallel under tp and replicated under dp. Engram tables are
replicated: the gather is a few rows per token, and sharding tables by row would add an
all-to-all per Engram layer for memory the bench and rank-shard configs do not need (the released
196B tables belong in pinned host memory per node, which is independent of this layout).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ParallelConfig"]


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1     # tensor-parallel attention (and experts when ep == 1)
    dp: int = 1     # data-parallel attention
    ep: int = 1     # expert parallel: 1 or world_size

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{f.name} must be a positive integer, got {value!r}")
        if self.tp > 1 and self.dp > 1:
            raise ValueError(f"ParallelConfig(tp={self.tp}, dp={self.dp}): attention is either tensor "
                             "parallel (tp) or data parallel (dp), not both (a tp x dp mesh is not built yet)")
        if self.ep not in (1, self.world_size):
            raise ValueError(f"ParallelConfig.ep must be 1 or world_size = tp * dp = {self.world_size} "
                             f"(experts spread over every rank), got {self.ep}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def attention(self) -> str:
        """"tp", "dp" or "single" (world size 1)."""
        return "tp" if self.tp > 1 else "dp" if self.dp > 1 else "single"

    def describe(self) -> str:
        moe = f"EP{self.ep}" if self.ep > 1 else (f"TP{self.tp}" if self.tp > 1 else "replicated")
        attn = {"tp": f"TP{self.tp}", "dp": f"DP{self.dp}", "single": "single"}[self.attention]
        return f"attention {attn}, experts {moe}, {self.world_size} rank(s)"

    def check(self, config) -> None:
        """Raise ValueError naming the config field and the rule if this layout does not divide
        the model. Run on every rank before a process group is used."""
        problems = []

        def need(name, value, by, why=""):
            if value % by:
                problems.append(f"{name} = {value} is not divisible by {by}{why}")

        if self.tp > 1:
            why = f" (tp = {self.tp})"
            need("num_attention_heads", config.num_attention_heads, self.tp, why)
            need("index_n_heads", config.index_n_heads, self.tp, why)
            need("o_groups", config.o_groups, self.tp, why)
            need("vocab_size", config.vocab_size, self.tp, why)
            # the shared expert is split under tp (and the routed ones too when ep == 1)
            need("moe_intermediate_size", config.moe_intermediate_size, self.tp, why)
            if config.weight_format == "checkpoint":     # FP8/FP4 splits fall on scale blocks
                split_k = [("o_groups * o_lora_rank (wo_b's input)", config.o_groups * config.o_lora_rank),
                           ("moe_intermediate_size (the experts' w2 input)", config.moe_intermediate_size)]
                for name, value in split_k:
                    if value // self.tp % 32:
                        problems.append(f"{name} / tp = {value // self.tp} is not a multiple of the "
                                        "32-wide scale block of weight_format='checkpoint'")
        if self.ep > 1:
            need("n_routed_experts", config.n_routed_experts, self.ep, f" (ep = {self.ep})")
        if problems:
            raise ValueError(f"ParallelConfig({self.describe()}) does not divide the model: "
                             + "; ".join(problems))
