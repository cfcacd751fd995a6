"""Per-rank decode cost model of v41graph's parallel layouts: a PREDICTION of what N devices
will do, planned from one H200's measurements and public interconnect figures (issue 19).
Nothing here runs a model or a collective.

    python scripts/parallel_cost_model.py                    # the tables of docs/BENCHMARKS.md
    python scripts/parallel_cost_model.py --config bench --batches 1,64 --json $OUT/cost.json

For one rank of a layout (tp x dp attention ranks, experts over ep ranks) at a system batch B
(sequences in flight, one token each) and context C, per decode step:

(1) HBM bytes read. Weights: every tensor of the official checkpoint (`official_tensor_specs`:
    FP8 E4M3 dense projections with E8M0 scales per 32x32 block, FP4 E2M1 routed experts with
    E8M0 scales per 32, F32 head / hc / sinks, BF16 the rest), cut to the rank's part by
    `ShardSpec.partition`, the rule `load_parallel_model` loads by. Routed experts count with
    the expected share of the rank's experts that the step's tokens pick (each token picks k of
    E uniformly: E_local * (1 - (1 - k/E)^T), as scripts/bench.py's floor); the embedding and
    the Engram tables count only the rows read. Caches: per sequence the rank attends over, as
    scripts/bench.py's floor: per layer the W window rows, the top-k global rows of a
    compressed layer, every index key a Full layer scores and a Reindex layer's candidate pool.
    At world size 1 this is bench.py's `floor_bytes` (tested on tiny; on bench() it is 0.003 %
    below the calibration run's floor: the built model keeps RMSNorm weights in fp32, the
    checkpoint in BF16). Engram rows are counted apart (host memory, PCIe), not in HBM time.
(2) Collective payloads by type, with the wire bytes one rank sends: ring all-reduce of S
    bytes over n ranks 2(n-1)/n * S, all-gather of an S-byte result (n-1)/n * S, all-to-all of
    an S-byte send buffer (n-1)/n * S. Where each one sits: see `collectives()`.
(3) Time. HBM time = bytes / the measured H200 copy bandwidth (the rate bench.py's floor
    uses). Collective time = wire bytes / effective link bandwidth + a latency per call. Three
    predictions of the rank's step:
      roofline    HBM time + collective time: what a fully fused, bandwidth-bound step reaches
      scaled      HBM time / eta(T) + collective time, eta = the fraction of its floor the
                  measured bench() decode step reaches at the same tokens per rank (27.5-35.2 %
                  on one H200, docs/bench_run4_c.json): "as efficient as today's one-GPU step"
      overhead    HBM time + O(T) + collective time, O(T) = measured step - floor of the same
                  run (20.9 ms at 1 token ... 36.5 ms at 64): today's executor, whose ~7.6K
                  kernels per step cost the same however few bytes a rank reads
    Collectives are added, not overlapped: each sits between a layer's compute and the next.
(4) System decode tokens/s = B / step time (every rank runs the same step; under data-parallel
    attention each rank runs ceil(B / dp) sequences, padding where B < dp).

Layouts that `v41graph.parallel.ParallelConfig` builds are checked against the model with
`ParallelConfig.check`; the seed's Ascend A3 layout (DP4 x TP8 attention, experts over all 32
dies) is one ParallelConfig refuses (no tp x dp mesh yet): it is modelled with the same
arithmetic, composed as written in `collectives()`.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from v41graph.model.config import V41Config
from v41graph.model.kv_cache import COMPRESSOR_RING
from v41graph.model.layer_plan import build_layer_plan
from v41graph.parallel.config import ParallelConfig
from v41graph.weights.checkpoint import nbytes_of
from v41graph.weights.names import EXPERT_WEIGHT, official_tensor_specs, split_name
from v41graph.weights.sharding import ShardSpec

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION_RUN = ROOT / "docs" / "bench_run4_c.json"    # bench() decode, B = 1/8/32/64, ctx 4096
GB = 1e9


# ============================================================================ hardware
@dataclass(frozen=True)
class Hardware:
    """One rank's device. Bandwidths in bytes/s per rank; link = one direction, effective."""
    name: str
    hbm_bytes_per_s: float          # what bytes read are divided by (measured copy rate)
    hbm_capacity: float             # bytes per rank
    link_bytes_per_s: float         # collective bandwidth inside a node, one direction
    internode_bytes_per_s: float    # the same between nodes
    latency_s: float                # per collective call (small-message latency)
    ranks_per_node: int
    sources: str = ""


def h200(copy_bytes_per_s: float, latency_s: float = 10e-6) -> Hardware:
    """H200 SXM, 8 per NVSwitch node. NVLink 4: 900 GB/s bidirectional = 450 GB/s per
    direction line rate; NCCL's effective NVLink bandwidth after protocol overhead ~370 GB/s
    (NCCL maintainer, NVIDIA/nccl-tests#212; an 8 x H200 all_reduce_perf peaks at busbw 475 GB/s
    with NVLink SHARP, NVIDIA/nccl-tests#272, but decode messages are far too small for that)."""
    return Hardware("H200", copy_bytes_per_s, 139 * 2 ** 30, 370e9, 370e9, latency_s, 8,
                    "HBM: measured copy bandwidth (nominal 4.8 TB/s); 139 GiB as the device tool "
                    "reports; link: NCCL effective 370 GB/s (NVIDIA/nccl-tests#212)")


def a3_die(h200_copy_efficiency: float, latency_s: float = 20e-6,
           internode_bytes_per_s: float | None = None) -> Hardware:
    """One die (= one rank, HCCL doc) of an Atlas 800 A3 node: 8 Ascend 910C cards x 2 dies.
    910C: 3.2 TB/s HBM (eight HBM2E stacks, TechPowerUp) and 128 GB per card -> 1.6 TB/s and
    64 GB per die (SGLang's Ascend page: 64 GB/die); HCCS/UB 784 GB/s per 910C bidirectional ->
    196 GB/s per die per direction (the CloudMatrix384 write-up lists 196 GB/s per NPU).
    Assumed, not sourced: the copy efficiency and the link efficiency of the H200 (measured copy
    / nominal, NCCL's 370/450), a 20 us HCCL call latency, and the two nodes joined at the same
    UB rate (one SuperPoD); --a3-internode-gbps models a slower scale-out link."""
    link = 196e9 * 370 / 450
    return Hardware("A3 die (910C)", 1.6e12 * h200_copy_efficiency, 64e9, link,
                    link if internode_bytes_per_s is None else internode_bytes_per_s, latency_s, 16,
                    "HBM 1.6 TB/s/die x H200 copy efficiency; 64 GB/die; HCCS 196 GB/s/die/direction "
                    "x NCCL's 370/450")


# ============================================================================ formats
@dataclass(frozen=True)
class CacheFormat:
    """Bytes of one cached row (per layer)."""
    name: str
    window_row: int      # one window-ring slot
    global_row: int      # one compressed global KV row
    index_row: int       # one index key


def released_cache_format(config: V41Config) -> CacheFormat:
    """MODEL.md §5 / v41graph.weights.accounting: window FP8 + UE8M0/32; global FP4 + E4M3/16;
    index keys FP4 + UE8M0/32 (full(): 528, 288, 68 B)."""
    d, di = config.head_dim, config.index_head_dim
    return CacheFormat("released (FP8 window, FP4 global + index)", d + d // 32, d // 2 + d // 16,
                       di // 2 + di // 32)


def a3_cache_format(config: V41Config) -> CacheFormat:
    """What the seed says vllm-ascend runs: SparseFlashMla compiles BF16 only (P2), so the window
    and global rows are BF16; the quantized lightning indexer scores INT8 keys (one fp32 scale
    per row assumed)."""
    d, di = config.head_dim, config.index_head_dim
    return CacheFormat("A3 (BF16 window + global, INT8 index)", 2 * d, 2 * d, di + 4)


WEIGHT_FORMATS = ("released", "w8a8")


def weight_tensors(config: V41Config, weights: str = "released", include_mtp: bool = False):
    """[(name, group, bytes)] of every checkpoint tensor (scales included). weights="released":
    as `official_tensor_specs` stores them; "w8a8" (the seed's ModelSlim W8A8 on the A3): every
    FP8 / FP4 projection INT8 with one fp32 scale per output row, the rest as released."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    specs = official_tensor_specs(config, include_mtp=include_mtp)
    out = []
    for name, spec in specs.items():
        wname = spec.weight if spec.kind == "scale" else name
        nbytes = nbytes_of(spec.dtype, spec.shape)
        wspec = specs[wname]
        if weights == "w8a8" and wspec.kind in ("fp8", "fp4"):
            nbytes = 4 * wspec.shape[0] if spec.kind == "scale" else math.prod(spec.shape)
        out.append((name, weight_group(wname), nbytes))
    return specs, out


def weight_group(name: str) -> str:
    prefix, _, rest = split_name(name)
    if prefix == "mtp":
        return "dspark"
    if EXPERT_WEIGHT.match(rest):
        return "routed_experts"
    if rest.startswith("ffn.shared_experts."):
        return "shared_expert"
    if rest == "engram.embed.weight":
        return "engram_table"
    if name in ("embed.weight", "head.weight"):
        return name.split(".")[0]
    return "dense"


# ============================================================================ layouts
@dataclass(frozen=True)
class Layout:
    """tp x dp attention ranks, routed experts over ep ranks (1 or all of them)."""
    tp: int = 1
    dp: int = 1
    ep: int = 1
    name: str = ""

    def __post_init__(self):
        for f in ("tp", "dp", "ep"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Layout.{f} must be a positive integer, got {v!r}")
        if self.ep not in (1, self.world_size):
            raise ValueError(f"Layout.ep must be 1 or world_size = {self.world_size}, got {self.ep}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def parallel_config(self) -> ParallelConfig | None:
        """The v41graph ParallelConfig of this layout, None where it builds none (tp x dp)."""
        try:
            return ParallelConfig(tp=self.tp, dp=self.dp, ep=self.ep)
        except ValueError:
            return None

    def check(self, config: V41Config) -> None:
        pc = self.parallel_config()
        if pc is not None:
            pc.check(config)
            return
        # tp x dp: the tensor-parallel rules at tp, the experts over every rank
        ParallelConfig(tp=self.tp, ep=self.tp if self.ep > 1 else 1).check(config)
        if config.n_routed_experts % self.ep:
            raise ValueError(f"n_routed_experts = {config.n_routed_experts} is not divisible by ep = {self.ep}")

    def describe(self) -> str:
        attn = (f"DP{self.dp} x TP{self.tp}" if self.tp > 1 and self.dp > 1 else
                f"TP{self.tp}" if self.tp > 1 else f"DP{self.dp}" if self.dp > 1 else "single")
        moe = f"EP{self.ep}" if self.ep > 1 else (f"TP{self.tp}" if self.tp > 1 else "replicated")
        return self.name or f"{attn} + {moe}"


def rank_fraction(name, specs, config, layout: Layout, rank: int = 0) -> float:
    """The share of tensor `name` that `rank` holds (ranks hold equal sizes: the model uses
    rank 0; tp x dp: rank = dp_index * tp + tp_index)."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} outside 0..{layout.world_size - 1} of {layout.describe()}")
    if layout.world_size == 1:
        return 1.0
    pc = layout.parallel_config()
    if pc is not None:
        shard = ShardSpec(rank, layout.world_size, layout.ep > 1, "dp" if pc.attention == "dp" else "tp")
    else:
        wname = specs[name].weight if specs[name].kind == "scale" else name
        prefix, _, rest = split_name(wname)
        m = EXPERT_WEIGHT.match(rest)
        if m and layout.ep > 1:      # experts by index over every rank, as ShardSpec does
            per = (config.dspark_n_routed_experts if prefix == "mtp" else config.n_routed_experts) // layout.ep
            return 1.0 if rank * per <= int(m.group(1)) < (rank + 1) * per else 0.0
        shard = ShardSpec(rank % layout.tp, layout.tp, False, "tp")   # the rest: split like TP attention
    part = shard.partition(name, specs, config)
    if part is None:
        return 0.0
    if part.dim is None:
        return 1.0
    return sum(b - a for a, b in part.ranges) / specs[name].shape[part.dim]


def resident_weight_bytes(config: V41Config, layout: Layout, weights: str = "released",
                          include_mtp: bool = False, rank: int = 0) -> dict[str, float]:
    """Bytes of a rank's weights by group (routed_experts, shared_expert, embed, head, dense,
    engram_table, dspark)."""
    specs, tensors = weight_tensors(config, weights, include_mtp)
    out: dict[str, float] = {}
    for name, group, nbytes in tensors:
        out[group] = out.get(group, 0.0) + nbytes * rank_fraction(name, specs, config, layout, rank)
    return out


# ============================================================================ per-step reads
def expected_expert_share(config: V41Config, tokens: int) -> float:
    """Expected share of the routed experts (of one layer, on any rank) that `tokens` tokens pick,
    each picking num_experts_per_tok of n_routed_experts uniformly."""
    e, k = config.n_routed_experts, config.num_experts_per_tok
    return 1 - (1 - k / e) ** tokens


def cache_read_bytes_per_sequence(config: V41Config, context: int, fmt: CacheFormat) -> int:
    """What one decode token reads from its sequence's caches (bench.py's floor): window rows of
    every layer, top-k global rows of a compressed layer, the index keys a layer scores."""
    pool = config.candidate_topk_blocks * config.candidate_block_size
    total = 0
    for role in build_layer_plan(config):
        total += config.sliding_window * fmt.window_row
        if role.ratio:
            total += config.index_topk * fmt.global_row
        if role.scores:
            positions = context // role.ratio
            if role.mode == "reindex":
                positions = min(positions, pool)
            total += positions * fmt.index_row
    return total


def cache_bytes_per_sequence(config: V41Config, context: int, fmt: CacheFormat) -> dict[str, int]:
    """Cache memory of one sequence at `context` tokens: the bounded state (window rings of every
    layer, fp32 compressor rings of the ratio>1 kv sources, Engram history) and the global KV +
    index keys, which grow with the context (full(), released formats: 890 B per token)."""
    plan = build_layer_plan(config)
    d = config.head_dim
    fixed = len(plan) * config.sliding_window * fmt.window_row
    fixed += sum(COMPRESSOR_RING * 2 * d * 4 for r in plan if r.mode == "full" and r.ratio > 1)
    fixed += 8 * max(config.engram_max_ngram_size - 1, 1)
    per_token = sum((fmt.global_row + fmt.index_row) / config.compress_ratios[i]
                    for i in config.kv_source_layer_ids)
    return {"fixed": fixed, "per_token": per_token, "total": fixed + per_token * context}


@dataclass
class Step:
    """One rank's decode step."""
    layout: str
    batch: int                      # sequences in the whole system
    seqs_per_rank: int              # sequences whose attention (and caches) this rank runs
    hbm_read: dict                  # bytes by group
    collectives: list               # [{"where", "type", "calls", "payload", "wire", "group"}]
    times_ms: dict = field(default_factory=dict)
    tokens_per_s: dict = field(default_factory=dict)
    eta: float | None = None        # the calibration's floor fraction at seqs_per_rank

    @property
    def hbm_bytes(self) -> float:
        return sum(v for k, v in self.hbm_read.items() if not k.startswith("host"))

    def wire_bytes(self, kind: str | None = None) -> float:
        return sum(c["wire"] for c in self.collectives if kind is None or c["type"] == kind)


def hbm_read_bytes(config: V41Config, layout: Layout, batch: int, context: int,
                   resident: dict[str, float], cache_fmt: CacheFormat, engram_on_host: bool = True) -> dict:
    """Bytes rank 0 reads in one decode step, by group (host_engram: the Engram rows, read over
    PCIe when the tables live in host memory)."""
    seqs = math.ceil(batch / layout.dp)               # this rank's attention group's sequences
    # EP: every row of the system (padding rows of a batch smaller than dp included: they route
    # like any token) reaches every rank's experts
    expert_tokens = seqs * layout.dp if layout.ep > 1 else seqs
    d, dt = config.hidden_size, 2 if config.torch_dtype != "float32" else 4
    vocab_split = layout.tp if layout.tp > 1 else 1
    rows = (config.engram_max_ngram_size - 1) * config.engram_n_heads
    engram_rows = seqs * rows * (config.engram_head_dim + config.engram_head_dim // 32) \
        * len(config.engram_layer_ids)
    out = {
        "dense": resident.get("dense", 0.0),
        "head": resident.get("head", 0.0),
        "embed": seqs * d * dt / vocab_split,
        "shared_expert": resident.get("shared_expert", 0.0),
        "routed_experts": resident.get("routed_experts", 0.0) * expected_expert_share(config, expert_tokens),
        "caches": seqs * cache_read_bytes_per_sequence(config, context, cache_fmt),
    }
    out["host_engram" if engram_on_host else "engram_rows"] = engram_rows
    return out


# ============================================================================ collectives
def _wire(kind: str, payload: float, n: int) -> float:
    """Bytes one rank sends for a collective over n ranks (payload: all-reduce = the tensor,
    all-gather = the gathered result, all-to-all = the rank's send buffer)."""
    if n == 1:
        return 0.0
    return payload * (2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n)


def compressed_capacity(context: int, ratio: int, block: int = 128) -> int:
    """Positions a Full layer's indexer scores: the block table's width / ratio (bench.py gives
    each context a table as wide as it needs)."""
    return math.ceil(max(context, 1) / block) * block // ratio


def collectives(config: V41Config, layout: Layout, batch: int, context: int) -> list[dict]:
    """Every collective rank 0 calls in one decode step (v41graph/model/{model,attention,moe}.py):

      tp > 1 (over the tp ranks of an attention group, N = its sequences):
        embed        all-reduce [N, d] compute dtype (vocab-parallel rows, others add zeros)
        wo_b         all-reduce [N, d] fp32 per layer (row-parallel partial sums)
        indexer      all-gather [N, tp, C] fp32 per Full/Reindex layer (per-rank head sums;
                     C = the Full layer's compressed capacity, a Reindex layer's candidate pool)
        head         all-gather [N, V] fp32 (vocab-parallel logits)
        moe          all-reduce [N, d] fp32 per layer (routed partials + shared-expert slice;
                     dp = 1, or tp x dp without expert parallelism)
      dp > 1, ep = world (over all ranks, N = the rank's sequences): per layer
        dispatch     all-to-all [ws * N, d] compute dtype (every row to every rank)
        routing      all-to-all [ws * N, 2k] fp32 (weights + ids)
        combine      all-to-all [ws * N, d] fp32
      tp x dp, ep = world (not built by ParallelConfig; the seed's A3 layout), our composition:
        the tp collectives above inside each group; per layer each rank dispatches its 1/tp of
        the group's rows with the three all-to-alls over all ranks, then an all-gather
        [N, d] compute dtype inside the group puts the MoE output back on every tp rank.
    """
    d, v, k = config.hidden_size, config.vocab_size, config.num_experts_per_tok
    cdt = 2 if config.torch_dtype != "float32" else 4
    n_layers = config.num_hidden_layers
    n_seq = math.ceil(batch / layout.dp)
    tp, ws = layout.tp, layout.world_size
    out = []

    def add(where, kind, calls, payload, n):
        if n > 1 and calls:
            out.append({"where": where, "type": kind, "calls": calls, "payload": payload * calls,
                        "wire": _wire(kind, payload, n) * calls, "group": n})

    if tp > 1:
        add("embed", "all_reduce", 1, n_seq * d * cdt, tp)
        add("wo_b", "all_reduce", n_layers, n_seq * d * 4, tp)
        pool = config.candidate_topk_blocks * config.candidate_block_size
        for role in build_layer_plan(config):
            if role.scores:
                c = compressed_capacity(context, role.ratio)
                if role.mode == "reindex":
                    c = min(c, pool)
                add(f"indexer.{role.mode}", "all_gather", 1, n_seq * tp * c * 4, tp)
        add("head", "all_gather", 1, n_seq * v * 4, tp)
        if layout.dp == 1 or layout.ep == 1:     # experts (or expert slices) of the group's tokens
            add("moe", "all_reduce", n_layers, n_seq * d * 4, tp)
    if layout.dp > 1 and layout.ep > 1:
        rows = n_seq if tp == 1 else math.ceil(n_seq / tp)
        add("moe.dispatch", "all_to_all", n_layers, ws * rows * d * cdt, ws)
        add("moe.routing", "all_to_all", n_layers, ws * rows * 2 * k * 4, ws)
        add("moe.combine", "all_to_all", n_layers, ws * rows * d * 4, ws)
        if tp > 1:
            add("moe.gather", "all_gather", n_layers, n_seq * d * cdt, tp)
    return out


def sparse_dispatch_share(config: V41Config, world_size: int) -> float:
    """Expected share of the other ranks one row would travel to if the dispatch sent it only
    where its experts live (E/ws per rank, k picked uniformly without repeats): 1 - C(E - E/ws, k)
    / C(E, k). v41graph's dispatch sends every row to every rank (share 1: fixed shapes)."""
    if world_size == 1:
        return 0.0          # no other rank
    e, k = config.n_routed_experts, config.num_experts_per_tok
    return 1 - math.comb(e - e // world_size, k) / math.comb(e, k)


def collective_time_s(coll: list[dict], hw: Hardware) -> float:
    """Wire bytes / link bandwidth + latency per call. A collective over more ranks than a node
    holds sends the share of its peers in other nodes at the inter-node rate (the two parts
    concurrently: the slower one counts)."""
    total = 0.0
    for c in coll:
        n = c["group"]
        remote = max(0, n - hw.ranks_per_node) / (n - 1)
        t = max(c["wire"] * (1 - remote) / hw.link_bytes_per_s, c["wire"] * remote / hw.internode_bytes_per_s)
        total += t + c["calls"] * hw.latency_s
    return total


# ============================================================================ calibration
@dataclass(frozen=True)
class Calibration:
    """The measured one-GPU bench() decode step: tokens -> (step s, floor s)."""
    tokens: tuple
    step_s: tuple
    floor_s: tuple
    copy_bytes_per_s: float
    source: str

    @classmethod
    def load(cls, path: Path = CALIBRATION_RUN) -> "Calibration":
        if not path.is_file():
            raise FileNotFoundError(f"calibration run {path} not found (a scripts/bench.py JSON)")
        run = json.loads(path.read_text())
        rows = sorted((r for r in run["rows"] if r["kind"] == "decode" and r["variant"] == "v41graph"),
                      key=lambda r: r["batch"])
        if len(rows) < 2:
            raise ValueError(f"{path}: needs v41graph decode rows at >= 2 batch sizes")
        return cls(tuple(r["batch"] for r in rows), tuple(r["step_ms"] / 1e3 for r in rows),
                   tuple(r["floor_ms"] / 1e3 for r in rows), float(run["copy_bytes_per_s"]), path.name)

    def _interp(self, ys, t: float, extrapolate: bool) -> float:
        xs = self.tokens
        if t <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if t <= x1:
                return y0 + (y1 - y0) * (t - x0) / (x1 - x0)
        if not extrapolate:
            return ys[-1]
        (x0, y0), (x1, y1) = (xs[-2], ys[-2]), (xs[-1], ys[-1])
        return y1 + (y1 - y0) * (t - x1) / (x1 - x0)

    def efficiency(self, tokens: float) -> float:
        """floor / step at `tokens` per rank (held at the last measured value beyond it)."""
        return self._interp([f / s for f, s in zip(self.floor_s, self.step_s)], tokens, False)

    def overhead_s(self, tokens: float) -> float:
        """step - floor at `tokens` (linear beyond the last measured batch: an extrapolation)."""
        return self._interp([s - f for f, s in zip(self.floor_s, self.step_s)], tokens, True)


# ============================================================================ the model
def predict_step(config: V41Config, layout: Layout, batch: int, context: int, hw: Hardware,
                 calibration: Calibration | None, weights: str = "released",
                 cache_fmt: CacheFormat | None = None, resident: dict | None = None,
                 with_overhead: bool = True) -> Step:
    """Rank 0's decode step (see the module docstring); calibration None: roofline only,
    with_overhead False: no `overhead` prediction (the A3: another machine's executor)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an integer >= 0, got {context!r}")
    layout.check(config)
    cache_fmt = cache_fmt or released_cache_format(config)
    resident = resident if resident is not None else resident_weight_bytes(config, layout, weights)
    reads = hbm_read_bytes(config, layout, batch, context, resident, cache_fmt)
    coll = collectives(config, layout, batch, context)
    step = Step(layout.describe(), batch, math.ceil(batch / layout.dp), reads, coll)
    t_hbm = step.hbm_bytes / hw.hbm_bytes_per_s
    t_coll = collective_time_s(coll, hw)
    times = {"hbm": t_hbm, "collectives": t_coll, "roofline": t_hbm + t_coll}
    if calibration is not None:
        t = step.seqs_per_rank
        times["scaled"] = t_hbm / calibration.efficiency(t) + t_coll
        if with_overhead:
            times["overhead"] = t_hbm + calibration.overhead_s(t) + t_coll
        step.eta = calibration.efficiency(t)
    step.times_ms = {k: v * 1e3 for k, v in times.items()}
    step.tokens_per_s = {k: batch / times[k] for k in ("roofline", "scaled", "overhead") if k in times}
    return step


def memory_per_rank(config: V41Config, layout: Layout, hw: Hardware, resident: dict, contexts,
                    cache_fmt: CacheFormat, dspark_bytes: float = 0.0) -> dict:
    """Weights resident on rank 0 (Engram tables apart: they belong in host memory) and how many
    sequences of each context the rest of the device holds (a tp group's caches are replicated
    on its ranks; activations, graph pools and NCCL buffers are not counted)."""
    weights = sum(v for k, v in resident.items() if k not in ("engram_table", "dspark"))
    tables = resident.get("engram_table", 0.0)
    free = hw.hbm_capacity - weights - dspark_bytes
    out = {"weights_gb": weights / GB, "engram_tables_gb": tables / GB, "dspark_gb": dspark_bytes / GB,
           "capacity_gb": hw.hbm_capacity / GB, "free_gb": free / GB, "fits": free > 0,
           "fits_with_engram_on_device": free - tables > 0, "contexts": {}}
    for c in contexts:
        seq = cache_bytes_per_sequence(config, c, cache_fmt)["total"]
        per_rank = max(0, int(free // seq))
        out["contexts"][c] = {"seq_bytes": seq, "max_seqs_per_rank": per_rank,
                              "max_seqs_system": per_rank * layout.dp}
    return out


def check_against_calibration(calibration: Calibration, path: Path = CALIBRATION_RUN) -> list[dict]:
    """World size 1, bench() as the calibration run built it (dense bf16 weights): this model's
    HBM bytes next to the floor bytes bench.py counted from the built model's parameters."""
    run = json.loads(path.read_text())
    config = V41Config.bench(weight_format="dense", torch_dtype="bfloat16")
    layout = Layout()
    resident = resident_weight_bytes(config, layout)
    out = []
    for r in run["rows"]:
        if r["kind"] != "decode" or r["variant"] != "v41graph":
            continue
        ours = sum(hbm_read_bytes(config, layout, r["batch"], r["context"], resident,
                                  released_cache_format(config), engram_on_host=False).values())
        out.append({"batch": r["batch"], "context": r["context"], "bench_floor_bytes": r["floor_bytes"],
                    "model_bytes": ours, "difference": ours - r["floor_bytes"]})
    return out


# ============================================================================ report
def default_layouts() -> list[tuple[Layout, str]]:
    return [(Layout(dp=8, ep=8), "h200"), (Layout(tp=8, ep=8), "h200"),
            (Layout(tp=8, dp=4, ep=32, name="A3: DP4 x TP8 + EP32 (2 nodes x 16 dies)"), "a3")]


def _fmt_bytes(x: float) -> str:
    return f"{x / GB:.2f} GB" if x >= 1e8 else f"{x / 1e6:.2f} MB" if x >= 1e5 else f"{x / 1e3:.1f} KB"


def run(config: V41Config, batches, context: int, calibration: Calibration, layouts=None,
        h200_latency_s: float = 10e-6, a3_internode: float | None = None,
        memory_contexts=(4096, 1048576)) -> dict:
    """Every layout at every batch: a JSON-able report (what main prints)."""
    eff = calibration.copy_bytes_per_s / 4.8e12           # measured copy / nominal HBM, H200
    hws = {"h200": h200(calibration.copy_bytes_per_s, h200_latency_s),
           "a3": a3_die(eff, internode_bytes_per_s=a3_internode)}
    out = {"config": {k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers", "n_routed_experts",
                                                      "num_experts_per_tok", "vocab_size", "weight_format")},
           "context": context, "calibration": asdict(calibration),
           "hardware": {k: asdict(v) for k, v in hws.items()}, "layouts": []}
    for layout, hw_name in (layouts or default_layouts()):
        hw, a3 = hws[hw_name], hw_name == "a3"
        try:
            layout.check(config)
        except ValueError as exc:       # e.g. bench()'s 16 experts over the A3's 32 dies
            out["skipped"] = out.get("skipped", []) + [f"{layout.describe()}: {exc}"]
            continue
        weights = "w8a8" if a3 and config.weight_format == "checkpoint" else "released"
        cache_fmt = a3_cache_format(config) if a3 else released_cache_format(config)
        resident = resident_weight_bytes(config, layout, weights, include_mtp=True)
        dspark = resident.pop("dspark", 0.0)
        entry = {"layout": layout.describe(), "hardware": hw.name, "weights": weights,
                 "cache_format": cache_fmt.name, "in_parallel_config": layout.parallel_config() is not None,
                 "resident_gb": {k: v / GB for k, v in resident.items()},
                 "memory": memory_per_rank(config, layout, hw, resident, memory_contexts, cache_fmt, dspark),
                 "sparse_dispatch_share": (sparse_dispatch_share(config, layout.world_size)
                                           if layout.dp > 1 and layout.ep > 1 else None),
                 "steps": []}
        for b in batches:
            s = predict_step(config, layout, b, context, hw, calibration, weights, cache_fmt, resident,
                             with_overhead=not a3)
            entry["steps"].append(asdict(s) | {"hbm_bytes": s.hbm_bytes, "wire_by_type": {
                t: s.wire_bytes(t) for t in ("all_reduce", "all_gather", "all_to_all")}})
        out["layouts"].append(entry)
    return out


def print_report(report: dict) -> None:
    print(f"context {report['context']} tokens; calibration {report['calibration']['source']} "
          f"(copy {report['calibration']['copy_bytes_per_s'] / 1e9:.0f} GB/s)\n")
    for c in report.get("check", []):
        print(f"check, world size 1, bench() dense bf16, B={c['batch']} ctx {c['context']}: "
              f"{c['model_bytes']:.0f} B vs bench.py floor {c['bench_floor_bytes']} B "
              f"({c['difference'] / c['bench_floor_bytes']:+.4%})")
    for e in report["layouts"]:
        if e.get("sparse_dispatch_share") is not None:
            print(f"{e['layout']}: a sparse dispatch would send a row to {e['sparse_dispatch_share']:.1%} "
                  "of the other ranks (v41graph's dense one: all of them)")
    for msg in report.get("skipped", []):
        print(f"skipped (does not divide the model): {msg}")
    print()
    print("| layout | B (per rank) | HBM read / rank | all-reduce | all-gather | all-to-all (wire / rank) "
          "| calls | HBM ms | coll. ms | roofline ms | scaled ms (eta) | overhead ms | tok/s roofline / scaled / overhead |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for e in report["layouts"]:
        for s in e["steps"]:
            t, w = s["times_ms"], s["wire_by_type"]
            calls = sum(c["calls"] for c in s["collectives"])
            over = f"{t['overhead']:.2f}" if "overhead" in t else "–"
            tps = s["tokens_per_s"]
            tps_s = " / ".join(f"{tps[k]:.0f}" if k in tps else "–" for k in ("roofline", "scaled", "overhead"))
            print(f"| {e['layout']} | {s['batch']} ({s['seqs_per_rank']}) | {_fmt_bytes(s['hbm_bytes'])} | "
                  f"{_fmt_bytes(w['all_reduce'])} | {_fmt_bytes(w['all_gather'])} | {_fmt_bytes(w['all_to_all'])} | "
                  f"{calls} | {t['hbm']:.2f} | {t['collectives']:.2f} | {t['roofline']:.2f} | "
                  f"{t['scaled']:.2f} ({s['eta']:.1%}) | {over} | {tps_s} |")
    print("\n| layout | B | dense + head + embed | routed experts | shared expert | caches | Engram rows (host, PCIe) "
          "| wire: where (MB) |")
    print("|---|---|---|---|---|---|---|---|")
    for e in report["layouts"]:
        for s in e["steps"]:
            r = s["hbm_read"]
            where = {}
            for c in s["collectives"]:
                key = c["where"].split(".")[0] if c["where"].startswith("indexer") else c["where"]
                where[key] = where.get(key, 0) + c["wire"]
            wtxt = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in where.items()) or "–"
            print(f"| {e['layout']} | {s['batch']} | {_fmt_bytes(r['dense'] + r['head'] + r['embed'])} | "
                  f"{_fmt_bytes(r['routed_experts'])} | {_fmt_bytes(r['shared_expert'])} | {_fmt_bytes(r['caches'])} | "
                  f"{_fmt_bytes(r.get('host_engram', 0))} | {wtxt} |")
    ctxs = list(report["layouts"][0]["memory"]["contexts"]) if report["layouts"] else []
    print("\n| layout (weights) | weights / rank, no Engram | of which routed experts | DSpark | capacity "
          "| free | Engram tables if on device | " + " | ".join(f"sequences of {c} tokens (system)" for c in ctxs) + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(ctxs))
    for e in report["layouts"]:
        m = e["memory"]
        seqs = " | ".join(f"{m['contexts'][c]['max_seqs_system']}" for c in ctxs)
        print(f"| {e['layout']} ({e['weights']}) | {m['weights_gb']:.1f} GB | "
              f"{e['resident_gb'].get('routed_experts', 0):.1f} GB | {m['dspark_gb']:.1f} GB | "
              f"{m['capacity_gb']:.0f} GB | {m['free_gb']:.1f} GB | {m['engram_tables_gb']:.1f} GB "
              f"({'fits' if m['fits_with_engram_on_device'] else 'does not fit'}) | {seqs} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=("full", "bench"), default="full",
                   help="full = the released V41Config() (FP8/FP4 checkpoint formats); bench = V41Config.bench()")
    p.add_argument("--batches", default="1,8,64,256", help="system batch sizes (sequences in flight)")
    p.add_argument("--context", type=int, default=4096, help="tokens already in each sequence")
    p.add_argument("--h200-latency-us", type=float, default=10.0, help="NCCL latency per collective call")
    p.add_argument("--a3-internode-gbps", type=float, default=None,
                   help="A3: inter-node bandwidth per die, one direction, GB/s (default: the UB rate)")
    p.add_argument("--calibration", type=Path, default=CALIBRATION_RUN, help="a scripts/bench.py JSON")
    p.add_argument("--json", type=Path, default=None, help="write the whole report here")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if min(batches) < 1:
        p.error(f"--batches must all be >= 1, got {args.batches!r}")
    if args.context < 0:
        p.error(f"--context must be >= 0, got {args.context}")
    if args.h200_latency_us < 0 or (args.a3_internode_gbps is not None and args.a3_internode_gbps <= 0):
        p.error("--h200-latency-us must be >= 0 and --a3-internode-gbps > 0")
    config = V41Config.full() if args.config == "full" else V41Config.bench()
    calibration = Calibration.load(args.calibration)
    report = run(config, batches, args.context, calibration,
                 h200_latency_s=args.h200_latency_us * 1e-6,
                 a3_internode=None if args.a3_internode_gbps is None else args.a3_internode_gbps * 1e9)
    report["check"] = check_against_calibration(calibration, args.calibration)
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
