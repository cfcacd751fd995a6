#!/usr/bin/env python
"""Benchmark v41graph's fast custom ops against their unfused torch equivalents (issue 4).

    python scripts/bench_ops.py [--out DIR] [--quick]

Needs a CUDA GPU and Triton. Everything is measured side by side in one process:
  - ceilings: device-to-device copy bandwidth (bytes read + written) and pinned host->device
    copy bandwidth;
  - fused_wkv_rmsnorm vs F.linear + RMSNorm (the model's code), decode M = 1, 8, 64 and prefill
    T = 4096; eager (triton.testing.do_bench, L2 flushed before every rep) and CUDA-graph replay
    over 16 weight copies (84 MB > L2, like consecutive layers);
  - cache writes (window FP8, global FP4, index FP4) vs the torch references;
  - sparse attention on the FP4 global cache vs the same kernel on a bf16 cache and vs the torch
    composite (gather + dequant + blockwise online softmax), B = 1, 8, 64 at contexts 8K and 64K
    (each sequence owns `ctx` cache rows; 512 random rows per token; window rows read in place
    from each sequence's FP8 ring plus this call's fresh rows) and prefill T = 4096;
  - Engram gather from a device table and from a pinned host table (UVA) vs the copy ceilings;
  - released formats (--only fp8,mxfp4, or quant for both): fp8_linear vs the bf16 cuBLAS linear per model shape
    (decode M = 1/8/64, prefill 4096, a sweep of the tile table) and the MXFP4 MoE of one EP8
    rank (48 experts, top-6) vs the model's bf16 torch._grouped_mm path;
  - lightning indexer, decode: a Reindex layer (the P = 16384 listed candidates) vs a Full layer
    (all C positions) at contexts 64K..512K; the Reindex time must not grow with C.
  - the MoE gate (--only gate): the two-launch router kernels vs the torch form, 384 experts;
  - mHC's input side (--only mhc): mhc_pre over its column-slice table vs the torch ops, and P9's
    mhc_collapse / mhc_predict alone;
  - indexer top-k (--only topk): the one-launch top-512 select vs torch's sorts, N = 1..64,
    C = 2048..16384.
Each fast result is checked against its baseline before it is timed. Prints a short table last;
writes bench.log, bench.json and bench_ops.md (the docs section) to --out (default $OUT).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from unittest import mock

import torch

ROWS: list[dict] = []
LOG = None


def say(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    if LOG is not None:
        LOG.write(s + "\n")
        LOG.flush()


def _ints(csv: str) -> tuple[int, ...]:
    return tuple(int(v) for v in csv.split(",") if v)


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def tbench(fn, rep=40):
    """Median device time in microseconds; L2 flushed before each rep (do_bench)."""
    from triton.testing import do_bench
    return 1000.0 * do_bench(fn, warmup=10, rep=rep, return_mode="median")


def gbench(fns, iters=30):
    """Median time per call (us) of the callables `fns` captured back to back in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return 1000.0 * ts[len(ts) // 2] / len(fns)


_FLUSH = None
FLUSH = "write"     # --flush


def _flush_l2():
    """Evict L2 by streaming 256 MB through it. "write" (a memset) leaves L2 full of dirty lines
    that the timed call then writes back to HBM while it reads its own bytes; "read" (a max over
    the buffer) leaves clean lines, nearer a decode step, where little that was written since
    is still waiting in L2."""
    if FLUSH == "read":
        return _FLUSH.max()
    return _FLUSH.zero_()


def cbench(fn, reps=8):
    """Device time (us) of one call with a cold L2, without host launch overhead: a CUDA graph of
    `reps` x (L2 flush, fn) minus a graph of `reps` x (flush)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.zeros(256 << 20 >> 2, dtype=torch.int32, device="cuda")
    both = gbench([lambda: (_flush_l2(), fn())] * reps, iters=15)
    flush = gbench([_flush_l2] * reps, iters=15)
    return max(both - flush, 0.01)


def row(op, shape, variant, us, nbytes=None, base_us=None, err=None, bw=None, note=""):
    r = dict(op=op, shape=shape, variant=variant, us=round(us, 2))
    if nbytes:
        r["bytes"] = int(nbytes)
        r["GBps"] = round(nbytes / us / 1e3, 1)
        if bw:
            r["pct_copy_bw"] = round(100.0 * nbytes / us / 1e3 / bw, 1)
    if base_us:
        r["speedup"] = round(base_us / us, 2)
    if err is not None:
        r["rel_err"] = float(f"{err:.3g}")
    if note:
        r["note"] = note
    ROWS.append(r)
    say("  " + json.dumps(r))
    return r


# =============================================================================== ceilings
def ceilings():
    n = 1 << 30
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t_d2d = tbench(lambda: b.copy_(a), rep=60)
    d2d = 2 * n / t_d2d / 1e3                                 # GB/s, read + write
    del a, b
    h = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    t_h2d = tbench(lambda: d.copy_(h, non_blocking=True), rep=100)
    h2d = (256 << 20) / t_h2d / 1e3
    row("ceiling", "1 GiB", "d2d copy (bytes read+written)", t_d2d, 2 * n)
    row("ceiling", "256 MiB", "pinned H2D copy", t_h2d, 256 << 20)
    say(f"ceilings: d2d copy {d2d:.0f} GB/s (read+write), pinned H2D {h2d:.1f} GB/s")
    return d2d, h2d


# =============================================================================== fused_wkv_rmsnorm
def bench_wkv(tk, bw, quick):
    import torch.nn.functional as F
    k, n, eps = 5120, 512, 1e-20
    reps = 16
    ws = [(torch.randn(n, k, device="cuda") * k ** -0.5).bfloat16() for _ in range(reps)]
    nw = torch.rand(n, device="cuda") + 0.5

    def unfused(x, w):
        y = F.linear(x, w)
        yf = y.float()
        yf = yf * torch.rsqrt(yf.square().mean(-1, keepdim=True) + eps)
        return (nw.float() * yf).to(y.dtype)

    for m in ([1, 8, 64] if quick else [1, 8, 64, 4096]):
        x = torch.randn(m, k, device="cuda").bfloat16()
        shape = f"M={m} K={k} N={n} bf16"
        nbytes = n * k * 2 + m * k * 2 + m * n * 2
        base = unfused(x, ws[0])
        t_lin = tbench(lambda: F.linear(x, ws[0]))
        t_unf = tbench(lambda: unfused(x, ws[0]))
        row("fused_wkv_rmsnorm", shape, "torch F.linear only (cuBLAS)", t_lin, nbytes, bw=bw)
        row("fused_wkv_rmsnorm", shape, "torch linear+RMSNorm (eager)", t_unf, nbytes, bw=bw)
        best = None
        variants = [(None, None)]
        if m <= tk.WKV_FUSED_MAX_M:
            variants += [(None, 512), (1, 1024), (10, None), (20, None), (40, None), (80, None)]
        for sp, bn in variants:
            out = tk.fused_wkv_rmsnorm(x, ws[0], nw, eps, split=sp, block_n=bn)
            err = rel(out, base)
            if m <= tk.WKV_FUSED_MAX_M:
                cfg = tk.wkv_config(m, k, n, x.dtype, x.device, sp, bn)
                name = f"triton fused BN={cfg[1]} split={cfg[4]} ({cfg[5] * cfg[4] * ((m + 15) // 16)} programs)"
            else:
                name = "cuBLAS linear + triton RMSNorm (1 kernel)"
            t = tbench(lambda: tk.fused_wkv_rmsnorm(x, ws[0], nw, eps, split=sp, block_n=bn))
            r = row("fused_wkv_rmsnorm", shape, name + (" (default)" if sp is None and bn is None else ""),
                    t, nbytes, base_us=t_unf, err=err, bw=bw)
            if best is None or t < best[0]:
                best = (t, sp, bn, name)
        # CUDA graph over 16 weight copies (cold-ish L2, no launch gaps)
        g_unf = gbench([lambda w=w: unfused(x, w) for w in ws])
        g_lin = gbench([lambda w=w: F.linear(x, w) for w in ws])
        g_def = gbench([lambda w=w: tk.fused_wkv_rmsnorm(x, w, nw, eps) for w in ws])
        g_best = gbench([lambda w=w: tk.fused_wkv_rmsnorm(x, w, nw, eps, split=best[1], block_n=best[2])
                         for w in ws])
        row("fused_wkv_rmsnorm", shape, "graph: torch F.linear only", g_lin, nbytes, bw=bw)
        row("fused_wkv_rmsnorm", shape, "graph: torch linear+RMSNorm", g_unf, nbytes, bw=bw)
        row("fused_wkv_rmsnorm", shape, "graph: triton fused (default)", g_def, nbytes, base_us=g_unf, bw=bw)
        row("fused_wkv_rmsnorm", shape, f"graph: {best[3]} (best eager)", g_best, nbytes,
            base_us=g_unf, bw=bw)
        del x


# =============================================================================== cache writes
def bench_writes(tk, bw, quick):
    from v41graph.custom_ops import reference as ref
    cap = 1 << 16
    kinds = [("window_kv_write", tk.window_kv_write, ref.window_kv_write, 512, 512, 16),
             ("global_kv_write", tk.global_kv_write, ref.global_kv_write, 512, 256, 32),
             ("index_k_write", tk.index_k_write, ref.index_k_write, 128, 64, 4)]
    for name, fast, slow, d, cbytes, sbytes in kinds:
        for n in [1, 64, 4096]:
            x = torch.randn(n, d, device="cuda").bfloat16()
            slots = torch.randperm(cap, device="cuda")[:n]
            slots[::7] = -1
            c0 = torch.randint(0, 256, (cap, cbytes), dtype=torch.uint8, device="cuda")
            s0 = torch.randint(0, 256, (cap, sbytes), dtype=torch.uint8, device="cuda")
            c1, s1, c2, s2 = c0.clone(), s0.clone(), c0.clone(), s0.clone()
            fast(c1, s1, x, slots)
            slow(c2, s2, x, slots)
            same = torch.equal(c1, c2) and torch.equal(s1, s2)
            nbytes = n * d * 2 + n * 8 + n * (cbytes + sbytes)
            t_ref = tbench(lambda: slow(c2, s2, x, slots))   # eager: the refs build tables per call
            t_fast = cbench(lambda: fast(c1, s1, x, slots))
            shape = f"N={n} D={d} bf16"
            row(name, shape, "torch reference (eager, not capturable)", t_ref, nbytes, bw=bw)
            row(name, shape, "triton", t_fast, nbytes, base_us=t_ref, bw=bw,
                note="bit-identical" if same else "MISMATCH vs reference")


# =============================================================================== sparse attention
def bench_attention(tk, bw, quick, tile_rows=(16, 32, 64), tile_stages=(1, 2, 3), batches=()):
    import triton.language as tl
    from v41graph import custom_ops  # noqa: F401
    from v41graph.custom_ops import codecs
    from v41graph.custom_ops import reference as ref
    h, d, w, kg = 64, 512, 128, 512
    scale = d ** -0.5
    sink = torch.randn(h, device="cuda")
    cases = [(b, 65536) for b in (1, 8, 32, 64)]   # the row count per token does not depend on ctx
    if quick:
        cases = [(1, 65536), (64, 65536)]
    cases.append(("prefill", 4096))
    if batches:     # --attn-batches: decode batch sizes, "prefill" for the prefill case
        cases = [(int(b), 65536) if b != "prefill" else ("prefill", 4096) for b in batches]
    for b, ctx in cases:
        prefill = b == "prefill"
        nseq = 1 if prefill else b
        ntok = 4096 if prefill else b
        rows_total = nseq * ctx
        gc = torch.randint(0, 256, (rows_total, d // 2), dtype=torch.uint8, device="cuda")
        e, mnt = torch.randint(4, 9, (rows_total, d // 16), device="cuda"), \
            torch.randint(0, 8, (rows_total, d // 16), device="cuda")
        gs = ((e << 3) | mnt).to(torch.uint8)                   # E4M3 scales in [2^-3, 2^1]
        gbf = torch.randn(rows_total, d, device="cuda").bfloat16()
        # window: each sequence's FP8 ring [nseq, W, D] (+ UE8M0 / 32) read in place, and this
        # call's fresh rows [ntok, D]; decode lists the W-1 previous ring rows + its own fresh
        # row, prefill the causal window over the fresh rows
        ring = torch.zeros(nseq, w, d, dtype=torch.uint8, device="cuda")
        ring_sc = torch.zeros(nseq, w, d // 32, dtype=torch.uint8, device="cuda")
        ref.window_kv_write(ring, ring_sc, torch.randn(nseq * w, d, device="cuda").bfloat16(),
                            torch.arange(nseq * w, device="cuda"))
        fresh = codecs.qdq_fp8_ue8m0(torch.randn(ntok, d, device="cuda"), 32).bfloat16()
        q = torch.randn(ntok, h, d, device="cuda").bfloat16()
        seq = torch.zeros(ntok, dtype=torch.int64, device="cuda") if prefill else \
            torch.arange(ntok, device="cuda")
        tok = torch.arange(ntok, device="cuda")
        if prefill:
            fpos = tok[:, None] - w + 1 + torch.arange(w, device="cuda")
            wrows = torch.where(fpos >= 0, nseq * w + fpos, -1)
        else:
            wrows = seq[:, None] * w + torch.arange(w, device="cuda")
            wrows[:, -1] = nseq * w + tok
        if prefill:
            grows = torch.rand(ntok, ctx, device="cuda").topk(kg, dim=-1).indices.sort(-1).values
        else:
            grows = torch.rand(ntok, ctx, device="cuda").topk(kg, dim=-1).indices.sort(-1).values \
                + seq[:, None] * ctx
        shape = (f"prefill T=4096 ctx={ctx}" if prefill else f"B={b} ctx={ctx // 1024}K") + \
            " H=64 D=512 W=128 K=512"
        per_tok_fp4 = 2 * h * d * 2 + w * (d + d // 32) + kg * (d // 2 + d // 16) + (w + kg) * 8
        per_tok_bf16 = 2 * h * d * 2 + w * (d + d // 32) + kg * d * 2 + (w + kg) * 8
        nb_fp4, nb_bf16 = ntok * per_tok_fp4, ntok * per_tok_bf16
        t_ref = None
        if not prefill:
            base = ref.sparse_attention_over_caches(q, ring, ring_sc, fresh, wrows, gc, gs, grows,
                                                    sink, scale)
            t_ref = tbench(lambda: ref.sparse_attention_over_caches(q, ring, ring_sc, fresh, wrows,
                                                                    gc, gs, grows, sink, scale),
                           rep=20)
            row("sparse_attention", shape, "torch composite (gather+dequant+ref), eager", t_ref, nb_fp4, bw=bw)
        else:
            base = None
        flop = ntok * h * (w + kg) * d * 4          # q k^T and P v over every listed row
        # "heads": today's head-tile kernel (BH heads per program, register prefetch); "tile": all
        # heads of a token in one MMA tile (software-pipelined `stages` deep). split None = the
        # kernel's default; the tile sweep is the tuning run behind attention.tile_config's rule
        heads = [dict(kernel="heads", block_h=bh, n_split=sp) for bh in (16, 64)
                 for sp in ([1] if prefill else [None, 1])]
        heads += [dict(kernel="heads", block_h=bh, n_split=1 if prefill else None, ptx_decode=False)
                  for bh in (16, 64)]
        tile_splits = [1] if prefill else ([None] if quick else [None, 1, 2, 3, 4, 5, 10, 20])
        tiles = [dict(kernel="tile", n_split=sp, stages=st, block_s=bs)
                 for sp in tile_splits for st in tile_stages for bs in tile_rows]
        tiles.append(dict(kernel="tile"))         # what the op runs: the table's choice
        best = {}
        for fmt in ("fp4", "bf16"):
            seen = set()
            for v in heads + tiles:
                gcache, gscale = (gc, gs) if fmt == "fp4" else (gbf, None)
                if v["kernel"] == "tile" and "n_split" in v:
                    cfg = tk.tile_config(ntok, w, kg, q.device, v["n_split"], v["stages"], v["block_s"])
                    key = ("tile", cfg)
                    name = f"tile BS={cfg[0]} split={cfg[1]} stages={cfg[3]}"
                elif v["kernel"] == "tile":
                    cfg = tk.tile_config(ntok, w, kg, q.device)
                    key, name = None, f"tile, the op's choice (BS={cfg[0]} split={cfg[1]} stages={cfg[3]})"
                else:
                    cfg = tk.attention_config(ntok, h, w, kg, q.device, v["block_h"], 32, v["n_split"])
                    key = ("heads", cfg, v.get("ptx_decode", True))
                    name = (f"heads BH={cfg[0]} split={cfg[2]}" + ("" if v.get("ptx_decode", True)
                                                                     else " generic decode"))
                if key is not None and key in seen:      # the same launch under another name
                    continue
                seen.add(key)
                try:
                    def fn():
                        return tk.sparse_attention(q, ring, ring_sc, fresh, wrows, gcache, gscale,
                                                   grows, sink, scale, **v)
                    out = fn()
                    err = rel(out, base) if (base is not None and fmt == "fp4") else None
                    t = cbench(fn, reps=4 if prefill else 8)
                    nb = nb_fp4 if fmt == "fp4" else nb_bf16
                    r = row("sparse_attention", shape, f"triton {fmt} {name}", t, nb, base_us=t_ref,
                            err=err, bw=bw, note=f"{flop / t / 1e6:.0f} TFLOP/s")
                    group = (fmt, v["kernel"])
                    if group not in best or t < best[group]["us"]:
                        best[group] = r
                except Exception as ex:   # noqa: BLE001
                    say(f"  FAILED {fmt} {name}: {type(ex).__name__}: " + str(ex)[-600:])
        n_split = tk.tile_config(ntok, w, kg, q.device)[1]
        if not prefill and n_split > 1:     # the op's split combine alone, on its workspace's shapes
            ws_acc = torch.randn(ntok, n_split, h, d, device="cuda")
            ws_ml = torch.randn(ntok, n_split, h, 2, device="cuda")
            out = torch.empty(ntok, h, d, device="cuda", dtype=torch.bfloat16)
            t = cbench(lambda: tk._combine_splits(ws_acc, ws_ml, sink, out.view(torch.int32), ntok, h, d, n_split,
                                                  tl.bfloat16, True))
            row("sparse_attention", shape, f"the tile kernel's split combine alone (split={n_split})", t,
                ws_acc.numel() * 4 + ws_ml.numel() * 4 + out.numel() * 2, bw=bw)
            del ws_acc, ws_ml, out
        for (fa, ka), (fb, kb), what in ((("fp4", "tile"), ("fp4", "heads"), "tile vs heads kernel (FP4)"),
                                         (("fp4", "tile"), ("bf16", "tile"), "FP4 vs BF16 cache (tile)"),
                                         (("fp4", "heads"), ("bf16", "heads"), "FP4 vs BF16 cache (heads)")):
            if (fa, ka) in best and (fb, kb) in best:
                a, b = best[(fa, ka)], best[(fb, kb)]
                row("sparse_attention", shape, f"BEST {what}: {a['variant']}", a["us"],
                    nb_fp4 if fa == "fp4" else nb_bf16, base_us=b["us"], bw=bw,
                    note=f"vs {b['variant']} {b['us']} us; {flop / a['us'] / 1e6:.0f} TFLOP/s")
        del gc, gs, gbf, ring, ring_sc, fresh, q
        torch.cuda.empty_cache()


# =============================================================================== Engram gather
def bench_engram(tk, bw, h2d, quick):
    from v41graph.custom_ops import reference as ref
    rows, dh, m = 4 << 20, 256, 24
    tdev = torch.randint(0, 256, (rows, dh), dtype=torch.uint8, device="cuda")
    tdev[(tdev & 0x7F) == 0x7F] = 0
    sdev = torch.randint(110, 140, (rows, dh // 32), dtype=torch.uint8, device="cuda")
    thost = torch.empty((rows, dh), dtype=torch.uint8, pin_memory=True)
    shost = torch.empty((rows, dh // 32), dtype=torch.uint8, pin_memory=True)
    thost.copy_(tdev)
    shost.copy_(sdev)
    for n in ([1, 64] if quick else [1, 8, 64, 4096]):
        ids = torch.randint(0, rows, (n, m), device="cuda")
        shape = f"N={n} x 24 rows x 256 B"
        src_bytes = n * m * (dh + dh // 32)
        base = ref.engram_gather(tdev, sdev, ids, torch.bfloat16)
        t_ref = cbench(lambda: ref.engram_gather(tdev, sdev, ids, torch.bfloat16))
        row("engram_gather", shape, "torch reference, device table", t_ref, src_bytes, bw=bw)
        for rpp in (4, 16):
            out = tk.engram_gather(tdev, sdev, ids, torch.bfloat16, rows_per_program=rpp)
            same = torch.equal(out, base)
            t = cbench(lambda: tk.engram_gather(tdev, sdev, ids, torch.bfloat16, rows_per_program=rpp))
            row("engram_gather", shape, f"triton device table rpp={rpp}", t, src_bytes, base_us=t_ref,
                bw=bw, note="bit-identical" if same else "MISMATCH")
        hsrc = torch.empty(src_bytes, dtype=torch.uint8, pin_memory=True)
        hdst = torch.empty(src_bytes, dtype=torch.uint8, device="cuda")
        t_copy = cbench(lambda: hdst.copy_(hsrc, non_blocking=True))
        row("engram_gather", shape, "pinned H2D copy of the same bytes (contiguous)", t_copy, src_bytes)
        for rpp in (4, 16):
            out = tk.engram_gather(thost, shost, ids, torch.bfloat16, rows_per_program=rpp)
            same = torch.equal(out, base)
            t = cbench(lambda: tk.engram_gather(thost, shost, ids, torch.bfloat16, rows_per_program=rpp))
            gbps = src_bytes / t / 1e3
            row("engram_gather", shape, f"triton PINNED HOST table rpp={rpp}", t, src_bytes, base_us=t_copy,
                note=("bit-identical" if same else "MISMATCH")
                + f"; {100 * gbps / h2d:.0f}% of bulk H2D {h2d:.0f} GB/s")


# =============================================================================== lightning indexer
def bench_indexer(tk, bw, quick):
    """Reindex layer (score the candidate source's P = 2048 x 8 listed positions, top-512) vs the
    candidate source / Full layer (score all C positions, candidate blocks, top-512), decode, at
    contexts 64K..512K: the Reindex time must stay flat in C (issue 4: within +-15 %). Index keys
    FP4 [rows, 64 B] + UE8M0 [rows, 4]; each sequence owns `ctx` rows; real widths (32 heads x 128)."""
    from v41graph.custom_ops import codecs
    ops = torch.ops.v41graph
    h, d, topk, blk, keep = 32, 128, 512, 8, 2048
    p = blk * keep
    for n in ([1, 64] if quick else [1, 8, 64]):
        ctxs = [1 << 16, 1 << 19] if quick else [1 << 16, 1 << 17, 1 << 18, 1 << 19]
        for ctx in ctxs:
            rows_total = n * ctx
            if rows_total * 68 > 8 << 30:
                continue
            kc = torch.randint(0, 256, (rows_total, d // 2), dtype=torch.uint8, device="cuda")
            ks = torch.randint(118, 130, (rows_total, d // 32), dtype=torch.uint8, device="cuda")
            q = codecs.qdq_fp4_ue8m0(torch.randn(n, h, d, device="cuda"), 32).bfloat16()
            w = (torch.randn(n, h, device="cuda") * 0.1).bfloat16()
            base = (torch.arange(n, device="cuda") * ctx).unsqueeze(1)
            # Reindex: P candidate positions per query, ascending (the candidate source's list)
            cand = torch.sort(torch.randperm(ctx, device="cuda")[:p].expand(n, p), dim=1).values.contiguous()
            cand_rows = (cand + base).contiguous()
            shape = f"N={n} ctx={ctx >> 10}K P={p}"
            t = gbench([lambda: ops.indexer_topk_candidates(q, w, kc, ks, cand_rows, cand, topk)] * 4)
            row("indexer", shape, "Reindex layer: indexer_topk_candidates", t, n * p * 68, bw=bw,
                note="reads only the listed keys")
            # Full layer / candidate source: all C positions visible
            all_rows = (torch.arange(ctx, device="cuda").unsqueeze(0) + base).contiguous()
            visible = torch.ones(n, ctx, dtype=torch.bool, device="cuda")
            t = gbench([lambda: ops.indexer_topk(q, w, kc, ks, all_rows, visible, topk, blk, keep)] * 2)
            row("indexer", shape, "Full layer (candidate source): indexer_topk over all C", t,
                n * ctx * 68, bw=bw)
            del kc, ks, all_rows, visible
            torch.cuda.empty_cache()


# =============================================================================== ratio-2 compressor
def bench_ratio2(tk, bw, quick):
    """The ratio-2 compressor step (fp32 projection pair [N, 5120] x [512, 5120]^T x 2, pooling
    of each token's 2 group members from the state ring / this call, cast to bf16, RMSNorm, ring
    write): the model's unfused ops (reference.ratio2_compressor_update = what attention.Compressor
    runs) vs the fused op (the same cuBLAS projections + one Triton kernel). Graph of calls over 4
    weight copies (84 MB > L2, like consecutive layers); us per call."""
    from v41graph.custom_ops import reference as ref
    ops = torch.ops.v41graph
    d, k, ring, copies = 512, 5120, 32, 4
    weights = [(torch.randn(d, k, device="cuda") / 72, torch.randn(d, k, device="cuda") / 72)
               for _ in range(copies)]
    g = torch.rand(d, device="cuda") + 0.5
    shapes = [("decode B=1", [(0, 4095, 1)]), ("decode B=64", [(s, 4000 + s, 1) for s in range(64)]),
              ("prefill T=4096", [(0, 0, 4096)])]
    if not quick:
        shapes.insert(1, ("decode B=8", [(s, 4000 + s, 1) for s in range(8)]))
    for shape, chunks in shapes:
        slots = len(chunks) + 1
        members, writes, base = [], [], slots * ring
        for slot, start, length in chunks:          # the model's layout (tests/test_ratio2_kernel.py)
            for p in range(start, start + length):
                for q in (max(p - 1, 0), p):
                    members.append(base + q - start if q >= start else slot * ring + q % ring)
                writes.append(slot * ring + p % ring if p >= start + length - ring else -1)
            base += length
        members = torch.tensor(members, device="cuda")
        writes = torch.tensor(writes, device="cuda")
        n = writes.shape[0]
        x = torch.randn(n, k, device="cuda").bfloat16()
        state = torch.randn(slots, ring, 2 * d, device="cuda")
        # weights, x, out, and the [N, 2D] fp32 projection rows written once and read back
        nbytes = 2 * d * k * 4 + n * k * 2 + n * d * 2 + 2 * n * 2 * d * 4
        unfused = [lambda w=w: ref.ratio2_compressor_update(x, w[0], w[1], state, members, writes, g, 1e-6,
                                                            torch.bfloat16) for w in weights]
        fused = [lambda w=w: ops.fused_ratio2_compressor_update(x, w[0], w[1], state, members, writes, g,
                                                                1e-6, torch.bfloat16) for w in weights]
        proj = [lambda w=w: (torch.nn.functional.linear(x.float(), w[0]),
                             torch.nn.functional.linear(x.float(), w[1])) for w in weights]
        s0 = state.clone()
        want = ref.ratio2_compressor_update(x, *weights[0], s0, members, writes, g, 1e-6, torch.bfloat16)
        s1 = state.clone()
        got = ops.fused_ratio2_compressor_update(x, *weights[0], s1, members, writes, g, 1e-6, torch.bfloat16)
        err = rel(got, want)
        ring = "state ring bit-identical" if torch.equal(s0, s1) else "STATE RING DIFFERS"
        t_un = gbench(unfused)
        row("ratio2_compressor", shape, "torch (model's ops, unfused)", t_un, nbytes, bw=bw)
        row("ratio2_compressor", shape, "cuBLAS projection pair alone", gbench(proj), nbytes, bw=bw)
        row("ratio2_compressor", shape, "fused: projections + 1 kernel (pool, norm, ring write)",
            gbench(fused), nbytes, base_us=t_un, err=err, bw=bw, note=ring)


# =============================================================================== released formats
# The model's FP8 projections at bench_rank widths: (name, N, K)
FP8_SWEEP_KERNELS = ("blocks", "skinny", "tiles")   # --fp8-sweep
FP8_SHAPES = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wkv", 512, 5120), ("wo_b", 5120, 8192),
              ("shared w1", 2304, 5120), ("shared w2", 5120, 2304)]


def _fp8_sweep_configs(m: int, quick: bool, kernel: str = "tiles"):
    """(BM or BT, BN, BK, split, num_warps, num_stages) candidates (quant_gemm._config's and
    _skinny_config's fields) of one kernel."""
    if kernel == "blocks":
        if m > 16:      # its scale product grows with the token tile: a decode kernel only
            return []
        bts = (8, 16) if m <= 8 else (16,)
        return [(bt, bn, bk, split, warps, stages, tma) for bt in bts for bn in (64, 128) + (() if quick else (256,))
                for bk in ((128,) if quick else (128, 256)) for split in (1, 2, 4, 8, 16, 32)
                for warps in ((4,) if bn < 256 else (8,)) for stages in ((4, 6) if quick else (3, 4, 6, 8))
                for tma in (False, True)]
    if kernel == "skinny":
        from v41graph.custom_ops.triton.quant_gemm import skinny_token_tile
        bt = skinny_token_tile(m)
        return [(bt, bn, bk, split, warps, stages, tma) for bn in (64, 128) for bk in ((128,) if quick else (128, 256))
                for split in (1, 2, 4, 8, 16, 32) for warps in ((4,) if bn == 64 or quick else (4, 8))
                for stages in ((3, 5) if quick else (3, 4, 5, 6)) for tma in (False, True)]
    bm = 16 if m <= 16 else (64 if m <= 64 else 128)
    if m > 64:
        return ([(128, 256, 64, split, 8, 3) for split in (1, 2, 4, 8, 16)]
                + [(64, 64, 128, split, 4, 4) for split in (1, 2, 4, 8, 16)] + [(128, 128, 64, 1, 8, 3)])
    out = []
    for bn in ((64, 128) if quick else (32, 64, 128)):
        for bk in (128, 256):
            for split in (1, 2, 4, 8, 16):
                for stages in ((4,) if quick else (3, 4)):
                    out.append((bm, bn, bk, split, 4, stages))
    return out


def bench_fp8_linear(bw, quick, rows=None):
    """fp8_linear (the checkpoint's FP8 weights + E8M0/32x32, activation quantization fused) vs
    the bf16 cuBLAS linear of the same shape, decode M = 1 / 8 / 64 and prefill M = 4096. Cold
    L2 per call (cbench). The rows sweep the kernel's tile table (BEST = the fastest config,
    checked against the reference)."""
    import torch.nn.functional as F
    from v41graph.custom_ops import codecs, reference as ref
    from v41graph.custom_ops.triton import quant_gemm
    ops = torch.ops.v41graph
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = FP8_SHAPES   # --quick sweeps fewer configs, not fewer shapes
    for name, n, k in shapes:
        w = torch.randint(0, 256, (n, k), device="cuda", dtype=torch.uint8, generator=g) & 0xB7
        sc = torch.randint(118, 126, ((n + 31) // 32, k // 32), device="cuda", dtype=torch.uint8, generator=g)
        dense = codecs.dequant_fp8_weight(w.view(torch.float8_e4m3fn), sc).bfloat16()
        wbytes = n * k + sc.numel()
        for m in rows or ((1, 8, 64, 4096) if name in ("wq_a", "wq_b", "wo_b") else (1, 8, 64)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            shape = f"{name} M={m} N={n} K={k}"
            t_bf16 = cbench(lambda: F.linear(x, dense))
            row("fp8_linear", shape, "bf16 cuBLAS F.linear (dense copy)", t_bf16, n * k * 2, bw=bw)
            want = ref.fp8_linear(x, w, sc, torch.float32)
            err = rel(ops.fp8_linear(x, w, sc, torch.float32), want)
            t_def = cbench(lambda: ops.fp8_linear(x, w, sc, torch.bfloat16))
            default = ("QDQ kernel + dequant kernel + cuBLAS" if m >= quant_gemm.PREFILL_ROWS
                       else f"triton {quant_gemm.decode_kernel(m, n, k, x.device)} kernel")
            err = rel(ops.fp8_linear(x, w, sc, torch.bfloat16).float(), want.bfloat16().float()) \
                if m >= quant_gemm.PREFILL_ROWS else err
            row("fp8_linear", shape, f"default: {default}", t_def, wbytes, base_us=t_bf16, err=err, bw=bw)
            if m < quant_gemm.PREFILL_ROWS:   # both decode kernels at their own table's config
                for kernel, table in (("blocks", quant_gemm._blocks_config), ("skinny", quant_gemm._skinny_config),
                                      ("tiles", quant_gemm._config)):
                    t_k = cbench(lambda kernel=kernel: quant_gemm.fp8_linear(x, w, sc, torch.bfloat16, kernel=kernel))
                    e_k = rel(quant_gemm.fp8_linear(x, w, sc, torch.float32, kernel=kernel), want)
                    row("fp8_linear", shape, f"{kernel} kernel {table(m, n, k, x.device)}", t_k, wbytes,
                        base_us=t_bf16, err=e_k, bw=bw)
            for kernel in FP8_SWEEP_KERNELS if m < quant_gemm.PREFILL_ROWS else ():
                best = None
                for cfg in _fp8_sweep_configs(m, quick, kernel):
                    try:
                        t = cbench(lambda cfg=cfg: quant_gemm.fp8_linear(x, w, sc, torch.bfloat16, config=cfg,
                                                                         kernel=kernel), reps=4)
                    except Exception as e:   # noqa: BLE001  (a config Triton cannot build: skip it)
                        say(f"  config {kernel} {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    say(f"  sweep {shape} {kernel} {cfg}: {t:.2f} us")
                    if best is None or t < best[0]:
                        best = (t, cfg)
                if best is not None:
                    e_best = rel(quant_gemm.fp8_linear(x, w, sc, torch.float32, config=best[1], kernel=kernel),
                                 want)
                    row("fp8_linear", shape, f"BEST {kernel} {best[1]}", best[0], wbytes, base_us=t_bf16,
                        err=e_best, bw=bw)
        del dense
        torch.cuda.empty_cache()



def bench_mxfp4_moe(bw, quick, token_counts=(), kernels=()):
    """The MXFP4 MoE (48 experts, top-6, 5120 x 2304: one EP8 rank's share) vs the model's bf16
    torch._grouped_mm path over the same experts, 1 / 8 / 64 tokens (+ 4096 and a tile sweep
    without --quick; token_counts and kernels, moe_fp4.KERNELS, narrow them). Both are the
    model's own MoE.routed. Cold L2 per call (cbench)."""
    from v41graph import V41Config
    from v41graph.custom_ops import reference as ref
    from v41graph.model.layers import default_dtype
    from v41graph.model.model import init_random_weights_
    from v41graph.model.moe import MoE

    def moe(fmt_cfg, numerics):
        cfg = V41Config.bench(n_routed_experts=48, num_experts_per_tok=6, torch_dtype="bfloat16", **fmt_cfg)
        with default_dtype(torch.bfloat16), torch.device("cuda"):
            m = MoE(cfg)
        init_random_weights_(m, torch.Generator(device="cuda").manual_seed(1))
        for mod in m.modules():
            if hasattr(mod, "numerics"):
                mod.numerics = numerics
        return m.eval().requires_grad_(False)
    fp4 = moe({"weight_format": "checkpoint"}, "released").pack_experts_()
    fp4_bytes = sum(t.numel() for t in (fp4._w13, fp4._s13, fp4._w2, fp4._s2))
    per_expert = fp4_bytes / 48
    dense = moe({"weight_format": "dense"}, "fast")
    from v41graph.custom_ops.triton import moe_fp4
    for tokens in token_counts or ((1, 8, 64) if quick else (1, 8, 64, 4096)):
        x = torch.randn(tokens, 5120, device="cuda", dtype=torch.bfloat16)
        weights, chosen = fp4.gate(x)
        touched = int(torch.unique(chosen).numel())
        shape = f"MoE 48x(5120x2304) top-6 T={tokens} ({touched} experts)"
        t_bf16 = cbench(lambda: dense.routed(x, weights, chosen), reps=4)
        row("mxfp4_moe", shape, "bf16 torch._grouped_mm (model's grouped path)", t_bf16,
            touched * per_expert * 4, bw=bw)
        want = ref.mxfp4_moe(x, weights, chosen, fp4._w13, fp4._s13, fp4._w2, fp4._s2, 10.0) if tokens <= 64 else None
        got = fp4.routed(x, weights, chosen)
        err = rel(got, want) if want is not None else None
        t_fp4 = cbench(lambda: fp4.routed(x, weights, chosen), reps=4)
        row("mxfp4_moe", shape, f"default: triton {moe_fp4._config(tokens * 6 / 48)}", t_fp4,
            touched * per_expert, base_us=t_bf16, err=err, bw=bw)
        # the default's routing and combine (one launch each) against torch ops
        # (V41GRAPH_MOE_ROUTING=torch): the same bits, more launches
        with mock.patch.dict(os.environ, {"V41GRAPH_MOE_ROUTING": "torch"}):
            same = torch.equal(fp4.routed(x, weights, chosen), got)
            t_routing = cbench(lambda: fp4.routed(x, weights, chosen), reps=4)
        row("mxfp4_moe", shape, "default, routing + combine as torch ops (V41GRAPH_MOE_ROUTING=torch)", t_routing,
            touched * per_expert, base_us=t_fp4, err=err, bw=bw,
            note="bit-identical to the default" if same else "DIFFERS from the default")
        # the tokens gate_up with K split over more programs (moe_fp4._split_k), default tiles
        for split in ((2, 4, 8) if tokens <= 64 else ()):
            got_s = moe_fp4.mxfp4_moe(x, weights, chosen, fp4._w13, fp4._s13, fp4._w2, fp4._s2, 10.0, split=split)
            t = cbench(lambda split=split: moe_fp4.mxfp4_moe(x, weights, chosen, fp4._w13, fp4._s13, fp4._w2,
                                                             fp4._s2, 10.0, split=split), reps=4)
            row("mxfp4_moe", shape, f"default tiles, gate_up K split {split}", t, touched * per_expert,
                base_us=t_fp4, err=rel(got_s, want), bw=bw,
                note=f"{100 * torch.eq(got_s, want).float().mean().item():.1f} % of outputs bit-equal to the reference")
        sweep = [(16, 64, 128, 128, 4, 3), (16, 128, 128, 128, 4, 3), (16, 64, 256, 256, 4, 3),
                 (16, 32, 128, 128, 4, 4), (16, 64, 128, 128, 8, 3),
                 # deeper pipelines of the default tile: more weight bytes in flight per program;
                 # and its registers capped at 128 (moe_fp4.maxnreg_of): 4 programs per SM, not 3
                 (16, 64, 128, 128, 4, 4), (16, 64, 128, 128, 4, 5), (16, 64, 256, 256, 4, 2),
                 (16, 64, 128, 128, 4, 3, "tokens", 128), (16, 64, 128, 128, 4, 4, "tokens", 128),
                 # the weight rows as the MMA's M side on FP8 dots, one per 32-wide K block
                 (16, 64, 128, 128, 4, 3, "blocks"), (16, 128, 128, 128, 4, 3, "blocks"),
                 (16, 128, 128, 128, 8, 3, "blocks"), (16, 128, 128, 128, 4, 4, "blocks"),
                 (16, 128, 128, 128, 4, 2, "blocks"), (32, 128, 128, 128, 8, 3, "blocks")] if tokens <= 64 else \
                [(64, 64, 64, 64, 4, 3), (128, 64, 64, 64, 8, 3), (64, 128, 64, 64, 8, 3), (128, 128, 64, 64, 8, 3)]
        if not quick:
            best = {}       # the best config of each kernel pair (moe_fp4.KERNELS)
            for cfg in (c for c in sweep if not kernels or moe_fp4.kernel_of(c) in kernels):
                try:
                    t = cbench(lambda cfg=cfg: moe_fp4.mxfp4_moe(x, weights, chosen, fp4._w13, fp4._s13, fp4._w2,
                                                                 fp4._s2, 10.0, config=cfg), reps=4)
                except Exception as e:   # noqa: BLE001
                    say(f"  config {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                say(f"  config {cfg}: {t:.1f} us")
                family = moe_fp4.kernel_of(cfg)
                if family not in best or t < best[family][0]:
                    best[family] = (t, cfg)
            for family, (t, cfg) in sorted(best.items()):
                got_b = moe_fp4.mxfp4_moe(x, weights, chosen, fp4._w13, fp4._s13, fp4._w2, fp4._s2, 10.0,
                                          config=cfg)
                equal = f"{100 * torch.eq(got_b, want).float().mean().item():.1f} % of outputs bit-equal to " \
                    "the reference" if want is not None else ""
                row("mxfp4_moe", shape, f"BEST {family} {cfg}", t, touched * per_expert, base_us=t_bf16,
                    err=rel(got_b, want) if want is not None else None, bw=bw, note=equal)


# =============================================================================== MoE gate
def bench_gate(bw, quick):
    """The MoE router at the released widths (384 experts x 5120, bf16 weight, top-6): the
    moe_gate kernels vs reference.moe_gate (the torch form the model ran before: fp32 cast of the
    weight, cuBLAS fp32 GEMM, softplus, sqrt, sort, gather, normalization), 1 / 8 / 64 tokens
    (+ 4096 without --quick); the ids checked equal first. Cold L2 per call (cbench), bytes: the
    bf16 weight."""
    from v41graph.custom_ops import reference as ref
    from v41graph.custom_ops.triton import moe_gate
    g = torch.Generator(device="cuda").manual_seed(5)
    e, d = 384, 5120
    w = (torch.randn(e, d, device="cuda", generator=g) / 64).to(torch.bfloat16)
    bias = torch.randn(e, device="cuda", generator=g) / 8
    for n in ((1, 8, 64) if quick else (1, 8, 64, 4096)):
        x = torch.randn(n, d, device="cuda", generator=g).to(torch.bfloat16)
        want_w, want_ids = ref.moe_gate(x, w, bias, 6, 2.5)
        got_w, got_ids = moe_gate.moe_gate(x, w, bias, 6, 2.5)
        same = torch.equal(got_ids, want_ids)
        shape = f"gate 384x5120 top-6 N={n}"
        t_ref = cbench(lambda: ref.moe_gate(x, w, bias, 6, 2.5))
        row("moe_gate", shape, "torch (reference.moe_gate)", t_ref, e * d * 2, bw=bw)
        row("moe_gate", shape, f"triton partials + select {moe_gate.gate_config(n, e, d, x.dtype, x.device)}",
            cbench(lambda: moe_gate.moe_gate(x, w, bias, 6, 2.5)), e * d * 2, base_us=t_ref,
            err=rel(got_w, want_w), bw=bw, note="same ids" if same else "IDS DIFFER")


# =============================================================================== mHC
def bench_mhc(quick):
    """mHC's input side at the released width (4 streams x 5120, fp32 fn [24, 20480]), 1 / 64
    tokens (+ 8 without --quick): mhc_pre (partials + finish with the Sinkhorn) vs the torch ops
    (reference.mhc_pre), over its column-slice table (pre_config's split and BK; the profile puts
    the two launches at ~22 / ~35 µs a call at B = 1 / 64, far above their ~2 MB of reads), and
    P9's split form: mhc_collapse alone (what stays on the main stream) and mhc_predict. Each
    variant's outputs are checked against mhc_pre's default first (same bits, or the rel err of
    pre / post / comb where the slicing changes the sum order). Cold L2 per call (cbench)."""
    from v41graph.custom_ops import reference as ref
    from v41graph.custom_ops.triton import mhc as tk
    g = torch.Generator(device="cuda").manual_seed(3)
    hc, d, iters = 4, 5120, 20
    fn = torch.randn((2 + hc) * hc, hc * d, device="cuda", generator=g) / 64
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    base = torch.randn((2 + hc) * hc, device="cuda", generator=g)
    for n in ((1, 64) if quick else (1, 8, 64)):
        streams = torch.randn(n, hc, d, device="cuda", generator=g).to(torch.bfloat16)
        pre_prev = torch.rand(n, hc, device="cuda", generator=g)
        args = (fn, scale, base, hc, iters, 1e-6, 1e-6)
        shape = f"mhc_pre N={n} 4x{d}"
        nbytes = streams.numel() * 2 + fn.numel() * 4
        want = tk.mhc_pre(streams, pre_prev, *args)
        t_ref = cbench(lambda: ref.mhc_pre(streams, pre_prev, *args))
        row("mhc_pre", shape, "torch ops (reference.mhc_pre)", t_ref, nbytes, bw=None)
        default = tk.pre_config(n, d, streams.device)
        table = [(32, default["split"]), (32, 80), (32, 40), (32, 20), (64, 40), (128, 20), (128, 10), (256, 10)]
        for bk, split in dict.fromkeys(table):
            cfg = dict(BM=default["BM"], BK=bk, split=split)
            got = tk.mhc_pre(streams, pre_prev, *args, config=dict(cfg))
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            err = max(rel(a, b) for a, b in zip(got[1:], want[1:]))
            name = "default " if (bk, split) == (32, default["split"]) else ""
            row("mhc_pre", shape, f"{name}triton BK={bk} split={split}",
                cbench(lambda cfg=cfg: tk.mhc_pre(streams, pre_prev, *args, config=dict(cfg))), nbytes,
                base_us=t_ref, err=err, note="same bits as the default" if same else "sum order differs")
        collapsed = tk.mhc_collapse(streams, pre_prev)
        predicted = tk.mhc_predict(streams, *args)
        same = torch.equal(collapsed, want[0]) and all(torch.equal(a, b) for a, b in zip(predicted, want[1:]))
        note = "same bits as mhc_pre" if same else "DIFFERS from mhc_pre"
        row("mhc_pre", shape, "P9 main stream: mhc_collapse alone", cbench(lambda: tk.mhc_collapse(streams, pre_prev)),
            streams.numel() * 2, base_us=t_ref, note=note)
        row("mhc_pre", shape, "P9 side stream: mhc_predict alone", cbench(lambda: tk.mhc_predict(streams, *args)),
            nbytes, base_us=t_ref, note=note)


# =============================================================================== indexer top-k
def bench_topk(indexer, quick):
    """The lightning indexer's top-512 selection over [N, C] scores: the one-launch Triton select
    (indexer.topk_ascending) vs reference.topk_ascending (torch's two sorts, what ran before it),
    the same ids checked first; N = 1 / 8 / 64 tokens, C = 2048 / 8192 / 16384 compressed
    positions (8192 = a 32K context at ratio 4). CUDA-graph replay (both capture)."""
    from v41graph.custom_ops import reference as ref
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in ((64,) if quick else (1, 8, 64)):
        for c in ((8192,) if quick else (2048, 8192, 16384)):
            s = torch.randn(n, c, device="cuda", generator=g)
            s[:, c // 2:][torch.rand(n, c - c // 2, device="cuda", generator=g) < 0.5] = float("-inf")
            assert torch.equal(indexer.topk_ascending(s, 512), ref.topk_ascending(s, 512))
            shape = f"top-512 of N={n} x C={c}"
            t_ref = gbench([lambda: ref.topk_ascending(s, 512)])
            row("indexer_topk", shape, "torch: sort + sort (reference)", t_ref)
            row("indexer_topk", shape, "triton: bitwise select + compaction, 1 launch",
                gbench([lambda: indexer.topk_ascending(s, 512)]), base_us=t_ref)


# =============================================================================== main
def main():
    global LOG, FP8_SWEEP_KERNELS, FLUSH
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--quick", action="store_true", help="fewer shapes (fp8: fewer configs)")
    ap.add_argument("--attn-rows", default="16,32,64", help="attn: the tile kernel's rows per block to sweep")
    ap.add_argument("--attn-stages", default="1,2,3", help="attn: the tile kernel's pipelining depths to sweep")
    ap.add_argument("--attn-batches", default="", help="attn: decode batch sizes and/or 'prefill' "
                    "(default 1,8,32,64,prefill; --quick 1,64,prefill)")
    ap.add_argument("--fp8-rows", default="", help="fp8: the token counts (default 1,8,64 and 4096 for three shapes)")
    ap.add_argument("--fp8-sweep", default=",".join(FP8_SWEEP_KERNELS),
                    help="fp8: the kernels whose tile tables are swept (blocks,skinny,tiles; empty: none)")
    ap.add_argument("--moe-tokens", default="", help="mxfp4: the token counts (default 1,8,64 and 4096)")
    ap.add_argument("--moe-kernels", default="", help="mxfp4: the kernel families swept (tokens,rows,blocks; default all)")
    ap.add_argument("--flush", choices=("write", "read"), default="write",
                    help="how cold-L2 timings evict L2 (see _flush_l2); write: every run before the 16th session")
    ap.add_argument("--only", default="", help="comma list of sections: wkv,writes,attn,engram,indexer,topk,ratio2,fp8,gate,mhc,mxfp4 "
                         "(quant = fp8,mxfp4)")
    args = ap.parse_args()
    FP8_SWEEP_KERNELS = tuple(filter(None, args.fp8_sweep.split(",")))
    FP8_ROWS = tuple(int(r) for r in args.fp8_rows.split(",") if r)
    FLUSH = args.flush
    os.makedirs(args.out, exist_ok=True)
    LOG = open(os.path.join(args.out, "bench.log"), "w")
    if not torch.cuda.is_available():
        say("bench_ops: needs a CUDA GPU")
        return 2
    import triton
    import v41graph.custom_ops  # noqa: F401
    from v41graph.custom_ops.triton import attention, cache_writes, compressor, engram, indexer, norms
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError:
        smi = "?"
    env = dict(gpu=props.name, sms=props.multi_processor_count, smi=smi, torch=torch.__version__,
               triton=triton.__version__, python=platform.python_version(),
               command="python " + " ".join(sys.argv))
    say("env:", json.dumps(env))
    t0 = time.time()
    d2d, h2d = ceilings()
    only = set(filter(None, args.only.replace("quant", "fp8,mxfp4").split(",")))
    sections = [("wkv", lambda: bench_wkv(norms, d2d, args.quick)),
                ("writes", lambda: bench_writes(cache_writes, d2d, args.quick)),
                ("attn", lambda: bench_attention(attention, d2d, args.quick, _ints(args.attn_rows),
                                                 _ints(args.attn_stages),
                                                 tuple(filter(None, args.attn_batches.split(","))))),
                ("engram", lambda: bench_engram(engram, d2d, h2d, args.quick)),
                ("indexer", lambda: bench_indexer(indexer, d2d, args.quick)),
                ("topk", lambda: bench_topk(indexer, args.quick)),
                ("ratio2", lambda: bench_ratio2(compressor, d2d, args.quick)),
                ("fp8", lambda: bench_fp8_linear(d2d, args.quick, FP8_ROWS)),
                ("gate", lambda: bench_gate(d2d, args.quick)),
                ("mhc", lambda: bench_mhc(args.quick)),
                ("mxfp4", lambda: bench_mxfp4_moe(d2d, args.quick, _ints(args.moe_tokens),
                                                  tuple(filter(None, args.moe_kernels.split(",")))))]
    for name, fn in sections:
        if only and name not in only:
            continue
        say(f"== {name} ({time.time() - t0:.0f} s)")
        try:
            fn()
        except Exception:   # noqa: BLE001
            say(f"SECTION {name} FAILED:\n" + traceback.format_exc())
        torch.cuda.empty_cache()
    env["d2d_GBps"], env["h2d_GBps"], env["seconds"] = round(d2d), round(h2d, 1), round(time.time() - t0)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(dict(env=env, rows=ROWS), f, indent=1)
    lines = [f"Machine: {env['gpu']} ({env['smi']}), torch {env['torch']}, triton {env['triton']}; "
             f"copy ceilings d2d {env['d2d_GBps']} GB/s (read+write), pinned H2D {env['h2d_GBps']} GB/s.",
             "", "| op | shape | variant | us | GB/s | % copy BW | speedup | rel err | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in ROWS:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k in
                                       ("op", "shape", "variant", "us", "GBps", "pct_copy_bw", "speedup",
                                        "rel_err", "note")) + " |")
    with open(os.path.join(args.out, "bench_ops.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    say("\n".join(lines))
    say("\nSUMMARY (us; speedup vs the baseline named in the full table)")
    for r in ROWS:
        v = r["variant"]
        if (r["op"] == "ceiling" or "(default" in v or v.startswith(("BEST", "graph:", "default:"))
                or (r["op"].endswith("_write") and v == "triton") or "PINNED" in v and "rpp=4" in v
                or r["op"] == "indexer" or v.startswith("bf16")):
            say(f"{r['op'][:18]:18s} {r['shape'][:34]:34s} {v[:52]:52s} {r['us']:>9} "
                f"x{r.get('speedup', '')} {r.get('pct_copy_bw', '')}% err={r.get('rel_err', '')} {r.get('note', '')[:60]}")
    say(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
