"""MoE (MODEL.md §6): sqrt-softplus gate with a selection-only bias, normalised top-k x scale,
clamped SwiGLU experts, one shared expert.

Two ways to run the routed experts, both with static shapes and no host sync:

* The loop (the specification; every device, dtype and weight format): all experts run on all
  tokens with a zero routing weight for tokens that did not pick them. Bit-identical to
  gathering each expert's tokens (a zero weight zeroes h before w2, and adding 0.0 changes
  nothing), but a decode step reads every expert's weights and launches ~10 kernels per expert.

* The grouped path: the N*topk (token, expert) pairs are sorted by expert, each expert's rows
  form one group, and two grouped GEMMs (`torch._grouped_mm`) over stacked weights do all
  experts at once; each pair's output goes back to its (token, slot) row (index_copy_ with the
  sort permutation) and the topk slots are summed in fp32 in ascending expert order: the loop's
  order, so the two differ only by GEMM rounding, and deterministic (index_add_ on CUDA adds
  with atomics in no fixed order). Group offsets come from a searchsorted over the sorted
  expert ids (a fixed [E] int32 tensor, no bincount, no nonzero, no .item()), so the step is
  capturable; CUTLASS schedules no tiles for a group without tokens, so a decode step reads
  only the chosen experts' weights (measured on an H200 at the bench config's widths, captured:
  1 token 350 us vs the loop's 878 us; 8 tokens 614 vs 921; 64 tokens 638 vs 982).

`MoE.grouped_impl` picks one ("auto" by default; set it per instance, on the class, or for a
whole model with `set_moe_impl`):
  "auto"     the grouped path with torch's CUTLASS kernel where that is supported (CUDA, sm90+,
             bf16 activations, dense weights, no autograd through the experts), else the loop;
  "loop"     always the loop;
  "torch"    `torch._grouped_mm` wherever it runs (also eager CPU fp32/bf16 through torch's
             per-group fallback; on CUDA below sm90 or in fp32 that fallback copies the offsets
             to the host, so it is neither fast nor capturable there; under torch.compile the
             op's meta function accepts bf16 only);
  "emulate"  `grouped_mm_emulated`, a pure-torch, static-shape, traceable stand-in with the
             same call contract (any dtype and device; E full-size GEMMs, for tests).
  "mxfp4"    (chosen automatically, not settable) MXFP4 experts in numerics="released": the
             `mxfp4_moe` op over the stacked checkpoint bytes (reference.mxfp4_moe, the loop's
             arithmetic; on CUDA two Triton grouped GEMMs that dequantize the FP4 tiles in
             registers: custom_ops/triton/moe_fp4.py).
The loop stays the specification: FP8/FP4 weights in "reference" or "fast" numerics use it.

Stacked weights (packing): `MoE.pack_experts_()` allocates w13 [E, 2*inter, d] (w1 rows then
w3 rows) and w2 [E, d, inter] (MXFP4 experts: their packed bytes [E, 2*inter, d/2] and
[E, d, inter/2], and the E8M0 scales stacked the same way), copies the experts' weights in and
re-points every expert Linear's parameter `.data` at its slice. Memory is not doubled; `state_dict()` (names, shapes,
values), `load_state_dict` and the loader's in-place loading keep working and write through
to the stacks, and the loop reads the same numbers. Packing happens
  * in `v41graph.compile` (`pack_moe_experts_(model)`, for every MoE whose selected impl is a
    grouped one: on CUDA sm90+ bf16 dense models with "auto"), before tracing, and
  * lazily, on the first eager forward that selects a grouped impl, and again eagerly whenever
    the experts' parameters no longer view the stacks (e.g. the loader's `place_model` swapped
    the Parameter objects).
`.to()` / `.cuda()` / `.half()` re-pack a packed MoE on the new device/dtype (`_apply`). Under
torch.compile the views are not re-checked (no data_ptr in a traced graph): replace expert
Parameter objects of a compiled model only through `pack_experts_()` again.
"""
from __future__ import annotations

import torch
from torch import nn

from v41graph.custom_ops.reference import dense_routing_weights, pairs_by_expert, swiglu
from v41graph.custom_ops.reference import moe_gate as moe_gate_reference

from .config import V41Config
from .layers import Linear, weight_fmt

GROUPED_IMPLS = ("auto", "loop", "torch", "emulate")


def grouped_mm_emulated(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(a, b, offs=offs)` for a [T, K] and b [E, K, N] in plain torch:
    rows offs[e-1]:offs[e] of a (offs int32, cumulative, offs[-1] <= T) times b[e]. Static
    shapes (each group is a full [T, K] x [K, N] GEMM with the other rows masked out), no host
    sync, traceable; rows at or past offs[-1] come out 0 (torch leaves them undefined)."""
    t = a.shape[0]
    rows = torch.arange(t, device=a.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, rows, right=True)          # the group each row belongs to
    out = a.new_zeros(t, b.shape[-1])
    for e in range(b.shape[0]):
        out = torch.where((group == e).unsqueeze(-1), a @ b[e], out)
    return out


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, impl: str) -> torch.Tensor:
    if impl == "emulate":
        return grouped_mm_emulated(a, b, offs)
    return torch._grouped_mm(a, b, offs=offs)


_SM90: dict = {}


def native_grouped_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs its fused, sync-free kernel here: CUDA sm90+ and bf16."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM90:
        _SM90[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _SM90[index]


class Gate(nn.Module):
    def __init__(self, config: V41Config, n_experts: int, topk: int):
        super().__init__()
        self.topk, self.route_scale = topk, config.routed_scaling_factor
        if config.scoring_func != "sqrtsoftplus":
            raise ValueError(f"scoring_func {config.scoring_func!r}: only 'sqrtsoftplus' is V4.1's")
        self.weight = nn.Parameter(torch.zeros(n_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor):
        """-> (routing weights [N, topk] fp32, chosen expert ids [N, topk], best first):
        reference.moe_gate, through the moe_gate op (one node; two Triton launches on CUDA)
        unless autograd is to reach the gate's parameters (the op has no backward)."""
        if torch.is_grad_enabled() and (self.weight.requires_grad or self.bias.requires_grad):
            return moe_gate_reference(x, self.weight, self.bias, self.topk, self.route_scale)
        return torch.ops.v41graph.moe_gate(x, self.weight, self.bias, self.topk, self.route_scale)


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float, fmt: str):  # fmt: fp8 / fp4 / dense
        super().__init__()
        self.w1, self.w3 = Linear(dim, inter, fmt=fmt), Linear(dim, inter, fmt=fmt)
        self.w2 = Linear(inter, dim, fmt=fmt)
        self.limit = limit

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """out_dtype=torch.float32: w2's fp32 partial sums (a tensor-parallel slice of the expert).
        Without a routing weight (the shared expert) the activation is the swiglu op (one node;
        one launch on CUDA), unless autograd is to reach the projections (it has no backward)."""
        gate, up = self.w1(x), self.w3(x)
        if weight is None and not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
            h = torch.ops.v41graph.swiglu(gate, up, self.limit)
        else:
            h = swiglu(gate.float(), up.float(), self.limit, weight)
        return self.w2(h.to(x.dtype), out_dtype=out_dtype)


class MoE(nn.Module):
    grouped_impl: str = "auto"     # see the module docstring; an instance attribute overrides

    def __init__(self, config: V41Config, n_experts: int | None = None, topk: int | None = None,
                 parallel=None):
        super().__init__()
        n_experts = n_experts or config.n_routed_experts
        self.n_experts = n_experts                 # all routed experts: the gate's width
        self.gate = Gate(config, n_experts, topk or config.num_experts_per_tok)
        d, inter, lim = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        # v41graph.parallel: which experts this rank holds (an id range under expert parallelism)
        # and how much of each (the intermediate size split under tensor parallelism). Data-
        # parallel attention with every expert on every rank is the single-device MoE.
        if parallel is not None and (parallel.expert_parallel or parallel.attention == "tp"):
            self.parallel = parallel
        else:
            self.parallel = None
        self.expert_ids = parallel.expert_range(n_experts) if self.parallel is not None else range(n_experts)
        tp = parallel.tp if self.parallel is not None and parallel.attention == "tp" else 1
        self.split_experts = tp > 1 and not self.parallel.expert_parallel
        self.inter, self.limit = (inter // tp if self.split_experts else inter), lim
        self.experts = nn.ModuleList(Expert(d, self.inter, lim, weight_fmt(config, "fp4")) for _ in self.expert_ids)
        if config.n_shared_experts != 1:
            raise ValueError(f"n_shared_experts={config.n_shared_experts}: V4.1 has exactly one")
        self.shared_experts = Expert(d, inter // tp, lim, weight_fmt(config, "fp8"))
        # The stacks (plain attributes, not parameters or buffers: state_dict keeps the per-expert
        # names, and the expert parameters are views into these). None until packed.
        self._w13: torch.Tensor | None = None      # [E, 2*inter, d]: w1 rows, then w3 rows
        self._w2: torch.Tensor | None = None       # [E, d, inter]
        self._s13: torch.Tensor | None = None      # MXFP4: E8M0 scales [E, 2*inter, d/32]
        self._s2: torch.Tensor | None = None       # MXFP4: [E, d, inter/32]
        self._native = False                       # stacks where torch's fused kernel runs

    # ------------------------------------------------------------------ packing
    def _expert_params(self, attr: str = "weight"):
        """(w1, w3, w2) `attr` ("weight" or "scale") Parameters of every routed expert, read
        from the modules now."""
        return [(e.w1._parameters[attr], e.w3._parameters[attr], e.w2._parameters[attr])
                for e in self.experts]

    def _stacked_format(self) -> str | None:
        """"dense" or "fp4" when every routed expert Linear has that format, else None."""
        fmts = {lin.fmt for e in self.experts for lin in (e.w1, e.w3, e.w2)}
        return fmts.pop() if len(fmts) == 1 and fmts <= {"dense", "fp4"} else None

    def can_pack(self) -> bool:
        """Dense or MXFP4 expert weights (one format), of one dtype and device, allocated."""
        fmt = self._stacked_format()
        if fmt is None:
            return False
        ws = [w for ws in self._expert_params() for w in ws]
        if fmt == "fp4":
            ws += [s for ss in self._expert_params("scale") for s in ss]
        return (not ws[0].is_meta and all(w.dtype == ws[0].dtype and w.device == ws[0].device for w in ws))

    @staticmethod
    def _stack(params) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy (w1, w3, w2)-like Parameters into a [E, 2*rows13, ...] and a [E, ...] stack and
        re-point each Parameter's .data at its slice."""
        p1, _, p2 = params[0]
        i = p1.shape[0]
        s13 = torch.empty(len(params), 2 * i, *p1.shape[1:], dtype=p1.dtype, device=p1.device)
        s2 = torch.empty(len(params), *p2.shape, dtype=p2.dtype, device=p2.device)
        for k, (q1, q3, q2) in enumerate(params):
            s13[k, :i].copy_(q1)
            s13[k, i:].copy_(q3)
            s2[k].copy_(q2)
        for k, (q1, q3, q2) in enumerate(params):
            q1.data, q3.data, q2.data = s13[k, :i], s13[k, i:], s2[k]
        return s13, s2

    def pack_experts_(self) -> "MoE":
        """Stack the routed experts' weights (w13 [E, 2*inter, d], w2 [E, d, inter]; MXFP4: the
        packed bytes and the scales) and make each expert Linear's parameters views into the
        stacks (values unchanged, no extra memory once the old storages are released)."""
        if not self.can_pack():
            raise ValueError("MoE.pack_experts_: needs dense or MXFP4 expert weights of one format, dtype "
                             "and device")
        with torch.no_grad():
            self._w13, self._w2 = self._stack(self._expert_params())
            if self._stacked_format() == "fp4":
                self._s13, self._s2 = self._stack(self._expert_params("scale"))
        self._native = native_grouped_supported(self._w13.device, self._w13.dtype)
        return self

    def is_packed(self) -> bool:
        """Stacks exist and every expert weight (and MXFP4 scale) is still its slice of them."""
        if self._w13 is None:
            return False
        stacks = [(self._w13, self._w2, self._expert_params())]
        if self._s13 is not None:
            stacks.append((self._s13, self._s2, self._expert_params("scale")))
        for s13, s2, params in stacks:
            i, size = s13.shape[1] // 2, s13.element_size()
            for k, (p1, p3, p2) in enumerate(params):
                if (p1.device != s13.device or p1.dtype != s13.dtype
                        or p1.data_ptr() != s13.data_ptr() + k * s13.stride(0) * size
                        or p3.data_ptr() != s13.data_ptr() + (k * s13.stride(0) + i * s13.stride(1)) * size
                        or p2.data_ptr() != s2.data_ptr() + k * s2.stride(0) * size):
                    return False
        return True

    def unpack_experts_(self) -> "MoE":
        """Forget the stacks (the expert parameters keep viewing them until replaced)."""
        self._w13 = self._w2 = self._s13 = self._s2 = None
        self._native = False
        return self

    def _apply(self, fn, recurse=True):
        packed = self._w13 is not None
        result = super()._apply(fn, recurse)
        if packed and not self.is_packed():        # moved / converted: stack again where they are
            self.unpack_experts_()
            if self.can_pack():
                self.pack_experts_()
        return result

    # ------------------------------------------------------------------ impl selection
    def _released_mxfp4(self) -> bool:
        """MXFP4 experts in numerics="released": the mxfp4_moe op runs them."""
        w1 = self.experts[0].w1
        return w1.fmt == "fp4" and w1.numerics == "released"

    def _no_autograd(self) -> bool:
        return not (torch.is_grad_enabled() and self.experts[0].w1.weight.requires_grad)

    def wants_grouped(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> bool:
        """Whether forward on activations of (device, dtype) (default: the expert weights') would
        take a grouped impl, given `grouped_impl` and the weights' format."""
        impl = self.grouped_impl
        if impl not in GROUPED_IMPLS:
            raise ValueError(f"MoE.grouped_impl must be one of {GROUPED_IMPLS}, got {impl!r}")
        if impl == "loop":
            return False
        if self._released_mxfp4():
            return self.can_pack()
        if self._stacked_format() != "dense":      # the grouped GEMMs below take dense weights
            return False
        if impl == "auto":                         # cheap checks first: this runs on every eager call
            w = self.experts[0].w1.weight
            device, dtype = device or w.device, dtype or w.dtype
            if not (w.device == device and w.dtype == dtype == torch.bfloat16
                    and native_grouped_supported(device, dtype)):
                return False
        return self.can_pack()

    def _select_impl(self, x: torch.Tensor) -> str:
        """"loop", "torch" or "emulate" for this call. Eager: packs (again) first where a grouped
        impl is wanted and the stacks are missing or stale. Traced (torch.compile): decided by
        what was packed before tracing; Dynamo guards the attributes read here."""
        impl = self.grouped_impl
        if impl not in GROUPED_IMPLS:
            raise ValueError(f"MoE.grouped_impl must be one of {GROUPED_IMPLS}, got {impl!r}")
        if impl == "loop" or not self._no_autograd():
            return "loop"
        if self._released_mxfp4():
            if not torch.compiler.is_compiling() and not self.is_packed() and self.can_pack():
                self.unpack_experts_().pack_experts_()
            return "mxfp4" if self._s13 is not None else "loop"
        if not torch.compiler.is_compiling() and not self.is_packed():
            if not self.wants_grouped(x.device, x.dtype):
                if impl != "auto":
                    raise ValueError(f"MoE.grouped_impl={impl!r} needs dense expert weights of one dtype "
                                     "and device (fp8/fp4 weight formats run the loop: use 'auto' or 'loop')")
                return "loop"
            self.unpack_experts_().pack_experts_()
        if self._w13 is None:                      # traced without packing first
            if impl != "auto":
                raise RuntimeError(f"MoE.grouped_impl={impl!r} under torch.compile needs the stacks: call "
                                   "MoE.pack_experts_() (v41graph.compile does) before compiling")
            return "loop"
        if impl == "auto":
            native = self._native and x.dtype == torch.bfloat16 and x.device == self._w13.device
            return "torch" if native else "loop"
        return impl

    # ------------------------------------------------------------------ forward
    def routed_grouped(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                       impl: str) -> torch.Tensor:
        """Sum over each token's chosen experts of weight * expert(x), [N, d] fp32, via grouped
        GEMMs over the stacks. Static shapes throughout (T = N * topk rows). chosen holds
        indices into self.experts; under expert parallelism len(self.experts) marks an expert
        another rank holds (sorted past the last group, its rows computed by nobody, dropped)."""
        n, k = chosen.shape
        e, i = len(self.experts), self.inter
        ids, pair_w, perm, offs = pairs_by_expert(weights, chosen, e)
        w13, w2 = self._w13, self._w2
        if w13.dtype != x.dtype:                                          # as Linear does (explicit impls)
            w13, w2 = w13.to(x.dtype), w2.to(x.dtype)
        xs = x[perm // k]                                                 # [T, d]
        gu = _grouped_mm(xs, w13.transpose(1, 2), offs, impl)             # [T, 2*inter]
        h = swiglu(gu[:, :i].float(), gu[:, i:].float(), self.limit, pair_w[perm].unsqueeze(-1))
        out = _grouped_mm(h.to(x.dtype), w2.transpose(1, 2), offs, impl)  # [T, d]
        pairs = torch.empty_like(out).index_copy_(0, perm, out).view(n, k, -1)   # back to (token, j)
        if self.parallel is not None:     # rows past the last group are undefined: zero them
            pairs = torch.where((ids < e).unsqueeze(-1), pairs, 0)
        y = torch.zeros((n, out.shape[-1]), dtype=torch.float32, device=x.device)
        for j in range(k):                                                # fp32, ascending expert id
            y = y + pairs[:, j]
        return y

    def routed(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """[N, d] fp32: the sum over each token's chosen experts that this rank holds (all of
        them on one device) of weight * expert(x). chosen: global expert ids [N, topk]."""
        n_local = len(self.experts)
        if self.parallel is not None:     # to indices into self.experts; n_local = held elsewhere
            local = chosen - self.expert_ids.start
            chosen = torch.where((local >= 0) & (local < n_local), local, n_local)
        impl = self._select_impl(x)
        if impl == "mxfp4" and out_dtype is None:
            return torch.ops.v41graph.mxfp4_moe(x, weights, chosen, self._w13, self._s13, self._w2,
                                                self._s2, self.limit)
        if impl not in ("loop", "mxfp4"):
            return self.routed_grouped(x, weights, chosen, impl)
        dense_w = dense_routing_weights(weights, chosen, n_local)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):   # expert-index order, fp32 sum
            y = y + expert(x, dense_w[:, e:e + 1], out_dtype)
        return y

    def forward(self, x: torch.Tensor):
        """-> (output [N, d], chosen expert ids [N, topk])."""
        weights, chosen = self.gate(x)
        par = self.parallel
        if par is None:
            y = self.routed(x, weights, chosen) + self.shared_experts(x)
        elif par.attention == "tp":
            # Every rank has every token: its experts' (or expert slices') fp32 partials, and its
            # slice of the shared expert, summed over ranks in one all-reduce.
            partial = torch.float32 if self.split_experts else None
            y = par.all_reduce(self.routed(x, weights, chosen, partial)
                               + self.shared_experts(x, out_dtype=torch.float32))
        else:
            y = self._dispatch_combine(x, weights, chosen) + self.shared_experts(x)
        return y.to(x.dtype), chosen

    def _dispatch_combine(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Data-parallel attention + expert parallelism: every rank's N tokens go to every expert
        rank with their routing (all-to-all, N rows per rank pair: a fixed shape, so the step
        captures, and no token is dropped), each rank runs its experts on what it received, and
        the fp32 results come back (all-to-all) and are summed in rank order (= ascending
        expert id ranges)."""
        par, ws, (n, k), d = self.parallel, self.parallel.world_size, chosen.shape, x.shape[-1]
        # One collective for tokens and routing: the ids as fp32 next to the weights (exact below
        # 2^24), their bytes viewed in the tokens' dtype and appended to each row.
        routing = torch.cat([weights, chosen.to(torch.float32)], -1)               # [N, 2k] fp32
        sent = par.all_to_all(torch.cat([x, routing.view(x.dtype)], -1).repeat(ws, 1))
        tokens, routing = sent[:, :d], sent[:, d:].contiguous().view(torch.float32)   # [ws*N, ...]
        out = self.routed(tokens, routing[:, :k], routing[:, k:].to(torch.int64))  # [ws*N, d]
        back = par.all_to_all(out).view(ws, n, -1)                                 # block j: rank j's experts
        y = back[0]
        for j in range(1, ws):
            y = y + back[j]
        return y


def moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_moe_impl(model: nn.Module, impl: str) -> nn.Module:
    """Set `grouped_impl` on every MoE of `model` ("auto", "loop", "torch", "emulate")."""
    if impl not in GROUPED_IMPLS:
        raise ValueError(f"grouped_impl must be one of {GROUPED_IMPLS}, got {impl!r}")
    for m in moe_modules(model):
        m.grouped_impl = impl
    return model


def pack_moe_experts_(model: nn.Module) -> int:
    """Pack (or re-pack) every MoE of `model` whose forward would take a grouped impl on its own
    weights' device and dtype; returns how many are packed. v41graph.compile calls this."""
    count = 0
    for m in moe_modules(model):
        if m.wants_grouped():
            if not m.is_packed():
                m.unpack_experts_().pack_experts_()
            count += 1
    return count
