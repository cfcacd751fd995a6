"""Compile one of our Triton kernels for sm90 on this machine, no GPU needed, and count the SASS
instructions of its hottest loop: a proxy for instruction-bound kernels (the MXFP4 MoE, the FP8
linear) between device sessions. It says nothing about stalls, occupancy or numerics.

    pip install triton==3.6.0      # anywhere: its ptxas and cuobjdump come with the wheel
    python scripts/offline_sass.py moe_gate_up                      # the decode tile
    python scripts/offline_sass.py moe_gate_up BM=64 --warps 4 --dump /tmp/k.sass
    python scripts/offline_sass.py moe_gate_up_blocks BN=128        # the weight rows as the MMA's M side
    python scripts/offline_sass.py moe_gate_up S=4 --stages 2       # K split in 4 (moe_fp4._split_k; launched at <= 2 stages)
    python scripts/offline_sass.py fp8_linear BM=64 BN=64 BK=128

Pointer arguments and the model-width sizes get Triton's divisibility-by-16 hint, as a launch
with aligned torch tensors and sizes that are multiples of 16 does; without it the loads would not
vectorize and the count would mislead. The loop is the innermost one with the most MMA
instructions (the K loop); prints its length and opcode histogram. Codes per loop iteration: BN x BK per weight tile, times the
tiles a kernel decodes per iteration (2 for gate+up); BS x D for the attention's row blocks.

    python scripts/offline_sass.py sparse_attn --stages 1         # window loop, then the FP4 loop
    python scripts/offline_sass.py sparse_attn PTX=0 --stages 1   # the generic FP8 and FP4 decodes
    python scripts/offline_sass.py sparse_attn_tile --warps 8 --stages 1
    python scripts/offline_sass.py fp8_linear_skinny BN=128      # the skinny FP8 decode kernel
    python scripts/offline_sass.py fp8_linear_blocks BN=128      # per-32-block partials of the codes
    python scripts/offline_sass.py moe_gate_partials             # the MoE gate's dot products

Kernels without a tensor-core loop (the gate's selection, mHC's, the SwiGLU) print their
registers, stack and spill only: whether they compile for sm90 and fit, without a GPU.

    python scripts/offline_sass.py mhc_finish --warps 8          # 160 K slices in one tile, then the Sinkhorn
    python scripts/offline_sass.py sparse_attn_combine --warps 4 # the attention's split combine (B = 64 tiling)
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the sparse attention kernels' runtime arguments (both kernels take the same)
_ATTN_SIGNATURE = {"q_ptr": "*i32", "ring_ptr": "*i16", "rsc_ptr": "*u8", "fresh_ptr": "*i32",
                   "wrows_ptr": "*i64", "gc_ptr": "*u8", "gs_ptr": "*u8", "grows_ptr": "*i64",
                   "sink_ptr": "*fp32", "out_ptr": "*i32", "ws_acc_ptr": "*fp32", "ws_ml_ptr": "*fp32",
                   "H": "i32", "W": "i32", "KG": "i32", "n_ring": "i32", "sm_scale": "fp32",
                   "blocks_per_split": "i32", "n_split": "i32"}
_MOE_GATE_UP_SIGNATURE = {"xq_ptr": "*bf16", "tok_ptr": "*i32", "pw_ptr": "*fp32", "offs_ptr": "*i32", "w_ptr": "*u8",
                          "s_ptr": "*u8", "h_ptr": "*bf16", "ws_ptr": "*fp32", "count_ptr": "*i32", "P": "i32",
                          "E": "i32", "D": "i32", "I": "i32", "K_SPLIT": "i32", "limit": "fp32"}
# launch options of the kernels whose wrappers set them: the sizes hinted as multiples of 16
# (a token count N is not at decode) and FMA contraction (off where the reference's rounding of
# each product is kept)
_TOKEN_KERNEL = {"aligned": ()}
_NO_FUSION = {"aligned": (), "enable_fp_fusion": False}
# name -> (module under custom_ops/triton, kernel, signature, default constexprs,
#          weight codes per loop iteration as a function of the constexprs (None: no tensor-core
#          loop), [launch options])
KERNELS = {
    "moe_gate_up": ("moe_fp4", "_gate_up_kernel", _MOE_GATE_UP_SIGNATURE,
                    {"S": 1, "HAS_LIMIT": True, "BM": 16, "BN": 64, "BK": 128, "BE": 64, "X_DTYPE": "bfloat16"},
                    lambda c: 2 * c["BN"] * c["BK"]),
    "moe_down": ("moe_fp4", "_down_kernel",
                 {"h_ptr": "*bf16", "dest_ptr": "*i32", "offs_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*u8",
                  "out_ptr": "*bf16", "E": "i32", "D": "i32", "I": "i32"},
                 {"BM": 16, "BN": 64, "BK": 128, "BE": 64}, lambda c: c["BN"] * c["BK"]),
    "moe_gate_up_blocks": ("moe_fp4", "_gate_up_blocks_kernel",
                           {"xc_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "tok_ptr": "*i32", "pw_ptr": "*fp32",
                            "offs_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*u8", "hc_ptr": "*fp8e4nv",
                            "hs_ptr": "*fp32", "E": "i32", "D": "i32", "I": "i32", "limit": "fp32"},
                           {"HAS_LIMIT": True, "BT": 16, "BN": 64, "BK": 128, "BE": 64, "X_DTYPE": "bfloat16",
                            "SCALE_WORDS": True}, lambda c: 2 * c["BN"] * c["BK"]),
    "moe_down_blocks": ("moe_fp4", "_down_blocks_kernel",
                        {"hc_ptr": "*fp8e4nv", "hs_ptr": "*fp32", "dest_ptr": "*i32", "offs_ptr": "*i32",
                         "w_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*bf16", "E": "i32", "D": "i32", "I": "i32"},
                        {"BT": 16, "BN": 64, "BK": 128, "BE": 64, "SCALE_WORDS": True}, lambda c: c["BN"] * c["BK"]),
    "fp8_linear": ("quant_gemm", "_fp8_linear_kernel",
                   {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*bf16", "ws_ptr": "*fp32",
                    "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "K_PER_SPLIT": "i32", "n_split": "i32"},
                   {"BM": 16, "BN": 64, "BK": 128, "QUANTIZED": True, "SPLIT": True}, lambda c: c["BN"] * c["BK"]),
    "fp8_linear_skinny": ("quant_gemm", "_fp8_linear_skinny_kernel",
                          {"x_ptr": "*i32", "w_src": "*i16", "s_ptr": "*u8", "out_ptr": "*bf16",
                           "ws_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
                           "K_PER_SPLIT": "i32", "n_split": "i32"},
                          {"BT": 16, "BN": 64, "BK": 128, "QUANTIZED": True, "SPLIT": True, "TMA": False},
                          lambda c: c["BN"] * c["BK"]),
    "fp8_linear_blocks": ("quant_gemm", "_fp8_linear_blocks_kernel",
                          {"xc_ptr": "*fp16", "xs_ptr": "*fp32", "w_src": "*u8", "s_ptr": "*u8",
                           "out_ptr": "*bf16", "ws_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32",
                           "K": "i32", "K_PER_SPLIT": "i32", "n_split": "i32"},
                          {"BT": 8, "BN": 128, "BK": 128, "SPLIT": True, "TMA": False}, lambda c: c["BN"] * c["BK"]),
    # decode attention, a block of BS rows x D per iteration: the window-ring loop is the one
    # counted (the longest of the loops with the most MMAs), the FP4 row loop is listed after
    # it; the launch uses --stages 1
    "sparse_attn": ("attention", "_sparse_attn_kernel", _ATTN_SIGNATURE,
                    {"D": 512, "D2": 256, "NB16": 32, "NB32": 16, "BH": 16, "BS": 32, "DTYPE": "bfloat16",
                     "IS16": True, "GLOBAL_FP4": True, "IEEE": False, "DIRECT": False, "PREFETCH": True,
                     "PTX": True}, lambda c: c["BS"] * c["D"]),
    # the all-heads tile kernel (64 heads, 8 warps: --warps 8 --stages 1)
    "sparse_attn_tile": ("attention", "_sparse_attn_tile_kernel", _ATTN_SIGNATURE,
                         {"D": 512, "D2": 256, "NB16": 32, "NB32": 16, "BH": 64, "BS": 32, "GLOBAL_FP4": True,
                          "DIRECT": False, "STAGES": 1}, lambda c: c["BS"] * c["D"]),
    # the split combine (no tensor-core loop), B = 64's tiling: whole rows, 2 splits at once
    "sparse_attn_combine": ("attention", "_sparse_attn_combine_kernel",
                            {"ws_acc_ptr": "*fp32", "ws_ml_ptr": "*fp32", "sink_ptr": "*fp32", "out_ptr": "*i32",
                             "H": "i32", "n_split": "i32"},
                            {"D": 512, "D2": 256, "BD": 256, "NS": 2, "DTYPE": "bfloat16", "IS16": True},
                            None, _TOKEN_KERNEL),
    # the MoE gate's partial dot products (16-bit inputs on the tensor cores)
    "moe_gate_partials": ("moe_gate", "_gate_partials_kernel",
                          {"x_ptr": "*bf16", "w_ptr": "*bf16", "part_ptr": "*fp32", "N": "i32", "E": "i32"},
                          {"D": 5120, "K_SLICE": 1280, "BM": 16, "BE": 32, "BK": 128, "DOT": True},
                          lambda c: c["BE"] * c["BK"], _TOKEN_KERNEL),
    # no tensor-core loop: resources only (bench_rank's shapes: 48 experts, top-6, d = 5120)
    "moe_gate_select": ("moe_gate", "_gate_select_kernel",
                        {"part_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64",
                         "N": "i32", "E": "i32", "route_scale": "fp32"},
                        {"S": 8, "TOPK": 6, "BE": 64, "BT": 8, "THRESHOLD": 20.0}, None, _TOKEN_KERNEL),
    "mhc_partials": ("mhc", "_mhc_partials_kernel",
                     {"x_ptr": "*bf16", "pre_ptr": "*fp32", "fn_ptr": "*fp32", "part_ptr": "*fp32",
                      "out_ptr": "*bf16", "N": "i32"},
                     {"D": 5120, "HC": 4, "MIX": 24, "COLS": 32, "BM": 16, "BK": 32, "BMIX": 32, "COLLAPSE": 1}, None,
                     _NO_FUSION),
    "mhc_finish": ("mhc", "_mhc_finish_sinkhorn_kernel",
                   {"part_ptr": "*fp32", "mix_ptr": "*fp32", "scale_ptr": "*fp32", "base_ptr": "*fp32",
                    "pre_ptr": "*fp32", "post_ptr": "*fp32", "comb_ptr": "*fp32", "N": "i32", "iters": "i32",
                    "norm_eps": "fp32", "hc_eps": "fp32"},
                   {"S": 160, "MIX": 24, "INV_K": 1.0 / 20480, "HC": 4, "BR": 1, "CH": 256, "BMIX": 32}, None,
                   _NO_FUSION),
    "mhc_expand": ("mhc", "_mhc_expand_kernel",
                   {"out_ptr": "*bf16", "x_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32",
                    "y_ptr": "*bf16", "D": "i32"}, {"BD": 512}, None, _NO_FUSION),
    "mhc_sinkhorn": ("mhc", "_mhc_sinkhorn_kernel",
                     {"mix_ptr": "*fp32", "scale_ptr": "*fp32", "base_ptr": "*fp32", "pre_ptr": "*fp32",
                      "post_ptr": "*fp32", "comb_ptr": "*fp32", "n_rows": "i32", "iters": "i32", "eps": "fp32"},
                     {"HC": 4, "BR": 32}, None, _NO_FUSION),
    "swiglu": ("swiglu", "_swiglu_kernel",
               {"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*bf16", "numel": "i32", "limit": "fp32"},
               {"CLAMP": True, "BLOCK": 1024}, None, _NO_FUSION),
}
# the sizes that are multiples of 16 at every launch (M, the token count, is not at decode)
ALIGNED_SIZES = ("D", "I", "N", "K", "K_PER_SPLIT", "K_SPLIT", "H")
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH = re.compile(r"BRA (0x[0-9a-f]+)")


def compile_kernel(name: str, overrides: dict, warps: int, stages: int, maxnreg: int | None = None):
    import importlib
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    module, kernel, signature, constexprs, codes_per_iteration, *launch = KERNELS[name]
    launch = dict(launch[0]) if launch else {}
    aligned_sizes = launch.pop("aligned", ALIGNED_SIZES)
    fn = getattr(importlib.import_module(f"v41graph.custom_ops.triton.{module}"), kernel)
    constexprs = {**constexprs, **overrides}
    constexprs = {k: getattr(tl, v) if isinstance(v, str) else v for k, v in constexprs.items()}
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
               for a, t in signature.items() if t.startswith("*") or a in aligned_sizes}
    target = GPUTarget("cuda", 90, 32)
    # the kernels' target checks (tl.target_info, e.g. _wait_for_inputs's sm90 test) ask the
    # active driver, which this machine lacks: they see the compile target, as on the GPU
    def compile_target():
        return target
    compile_target.__triton_builtin__ = True    # what Triton's own current_target carries
    with mock.patch("triton.language.target_info.current_target", compile_target):
        compiled = triton.compile(ASTSource(fn, signature, constexprs, aligned), target=target,
                                  options={"num_warps": warps, "num_stages": stages, **launch,
                                           **({"maxnreg": maxnreg} if maxnreg else {})})
    return compiled, (codes_per_iteration(constexprs) if codes_per_iteration else None)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """`cuobjdump <flag>` (the one that comes with Triton's wheel) over a compiled kernel."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = Path("/tmp/offline_sass.cubin")
    path.write_bytes(cubin)
    return subprocess.run([str(tool), flag, str(path)], capture_output=True, text=True, check=True).stdout


def resources_of(cubin: bytes) -> str:
    """Registers per thread, stack and local (spill) bytes, shared memory."""
    return " ".join(re.findall(r"(?:REG|STACK|SHARED|LOCAL):\d+", _cuobjdump(cubin, "-res-usage")))


def sass_of(cubin: bytes) -> str:
    return _cuobjdump(cubin, "-sass")


def mma_loops(sass: str) -> list[list[str]]:
    """The bodies of the innermost loops (a backward branch with no other inside it) that hold
    tensor-core instructions, most MMAs first, then longest first."""
    listing = [(int(m.group(1), 16), m.group(2).strip()) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
    loops = [(int(b.group(1), 16), addr) for addr, text in listing
             if (b := _BRANCH.search(text)) and int(b.group(1), 16) < addr]
    innermost = [(lo, hi) for lo, hi in loops if not any(lo < s_hi < hi for _, s_hi in loops)]
    bodies = [[text for addr, text in listing if lo <= addr <= hi] for lo, hi in innermost]
    bodies = [b for b in bodies if any("MMA" in t for t in b)]
    return sorted(bodies, key=lambda b: (-sum("MMA" in t for t in b), -len(b)))


def hottest_loop(sass: str) -> list[str]:
    """The innermost loop with the most tensor-core instructions (the longest of those): the K
    loop of a GEMM kernel, the window-ring loop of the attention kernel."""
    loops = mma_loops(sass)
    return loops[0] if loops else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=sorted(KERNELS))
    ap.add_argument("constexprs", nargs="*", help="NAME=int overrides, e.g. BM=64")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--maxnreg", type=int, help="cap the registers per thread (Triton's maxnreg)")
    ap.add_argument("--dump", help="write the whole SASS listing here")
    args = ap.parse_args()
    overrides = {k: int(v) for k, v in (a.split("=", 1) for a in args.constexprs)}
    compiled, codes = compile_kernel(args.kernel, overrides, args.warps, args.stages, args.maxnreg)
    sass = sass_of(compiled.asm["cubin"])
    if args.dump:
        Path(args.dump).write_text(sass)
    if codes is None:
        print(f"{args.kernel} {overrides or ''} warps={args.warps} stages={args.stages}: "
              f"{resources_of(compiled.asm['cubin'])}")
        return 0
    loop = hottest_loop(sass)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in loop)
    threads = 32 * args.warps
    print(f"{args.kernel} {overrides or ''} warps={args.warps} stages={args.stages}: loop {len(loop)} "
          f"instructions per thread per iteration, {len(loop) * threads / codes:.2f} thread instructions "
          f"per weight code ({codes} codes per iteration); {resources_of(compiled.asm['cubin'])}")
    for op, count in ops.most_common(20):
        print(f"  {count:5d} {op}")
    others = [len(b) for b in mma_loops(sass)[1:]]
    if others:
        print(f"other loops with MMAs: {others} instructions per iteration")
    return 0


if __name__ == "__main__":
    sys.exit(main())
