"""The MXFP4 MoE's Triton kernels (custom_ops/triton/moe_fp4.py) on the CPU, in Triton's
interpreter with the PTX decodes replaced by their stand-ins (tests/triton_ptx_doubles.py; the
PTX itself: tests/test_ptx_decodes_cpu.py):
- both kernel pairs (tokens, blocks) against the reference op, bf16 and fp32 x, groups
  longer than a token tile, an expert no token picked, tile tails in both widths;
- the split-pairs order of the activation codes (quantize_rows_codes(split_pairs=True)): each
  32-block's even columns, then its odd ones, the scales unchanged;
- the route and combine kernels (the default; and the torch combine, V41GRAPH_MOE_ROUTING=torch)
  against the torch routing (reference.pairs_by_expert) and the reference's loop, bit for bit,
  with experts held elsewhere (id = E), repeated ids and more pairs than one program takes;
- a bad tuning config or codes dtype is refused with the field and the rule, before anything
  is allocated or launched.
The CUDA tests run the same kernels on the GPU; these catch an indexing, layout or epilogue
mistake without one."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernels are Triton's; its interpreter runs them on the CPU")

from triton_interpreter import run_interpreted  # noqa: E402
from v41graph.custom_ops.triton import moe_fp4, quant_gemm  # noqa: E402

_KERNELS_SCRIPT = """
    import os
    os.environ["V41GRAPH_MOE_ROUTING"] = "kernels"       # the route and combine kernels too
    import torch
    import triton_ptx_doubles
    triton_ptx_doubles.install()
    from v41graph.custom_ops import reference
    from v41graph.custom_ops.triton import moe_fp4
    g = torch.Generator().manual_seed(5)
    e, d, i, n, topk = 4, 256, 96, 40, 2     # 80 pairs: groups of ~27 > a 16-token tile; I = 96: tails
    def stack(rows, k):
        return (torch.randint(0, 256, (e, rows, k // 2), generator=g, dtype=torch.uint8),
                torch.randint(118, 126, (e, rows, k // 32), generator=g, dtype=torch.uint8))
    w13, s13 = stack(2 * i, d)
    w2, s2 = stack(d, i)
    configs = [(16, 64, 128, 128, 4, 3, "tokens"), (16, 32, 64, 32, 4, 3, "tokens"),
               (16, 64, 128, 128, 4, 3, "blocks"), (16, 32, 256, 32, 4, 3, "blocks"),
               (16, 64, 128, 128, 4, 4, "tokens", 128)]     # a register cap (a launch option)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(n, d, generator=g) * 3).to(dtype)
        scores = torch.rand(n, e, generator=g)
        scores[:, 2] = -1                    # expert 2: no token
        chosen = scores.topk(topk, dim=-1).indices
        weights = torch.rand(n, topk, generator=g)
        want = reference.mxfp4_moe(x, weights, chosen, w13, s13, w2, s2, 10.0)
        for config in configs:
            got = moe_fp4.mxfp4_moe(x, weights, chosen, w13, s13, w2, s2, 10.0, config=config)
            rel = ((got - want).norm() / want.norm()).item()
            print(config[6], str(dtype), bool(torch.equal(got, want)), rel)
        first = moe_fp4.mxfp4_moe(x, weights, chosen, w13, s13, w2, s2, 10.0, config=configs[0])
        os.environ["V41GRAPH_MOE_ROUTING"] = "torch"     # the torch routing: same bits
        again = moe_fp4.mxfp4_moe(x, weights, chosen, w13, s13, w2, s2, 10.0, config=configs[0])
        os.environ["V41GRAPH_MOE_ROUTING"] = "kernels"
        print("routing", str(dtype), bool(torch.equal(again, first)), 0.0)
    # decode sizes: fewer pairs than experts, so the expert kernels launch min(E, pairs) slots
    # and each finds its busy expert (_expert_tile): 1 token -> experts 3, 1; 2 tokens -> 1, 2, 3
    for chosen in (torch.tensor([[3, 1]]), torch.tensor([[3, 1], [2, 3]])):
        x = (torch.randn(chosen.shape[0], d, generator=g) * 3).to(torch.bfloat16)
        weights = torch.rand(chosen.shape, generator=g)
        want = reference.mxfp4_moe(x, weights, chosen, w13, s13, w2, s2, 10.0)
        for config in (configs[0], configs[2]):
            got = moe_fp4.mxfp4_moe(x, weights, chosen, w13, s13, w2, s2, 10.0, config=config)
            rel = ((got - want).norm() / want.norm()).item()
            print(config[6], f"tokens={chosen.shape[0]}", bool(torch.equal(got, want)), rel)
"""


def test_every_kernel_pair_matches_the_reference_in_triton_interpreter(tmp_path):
    rows = [line.split() for line in run_interpreted(_KERNELS_SCRIPT, tmp_path)]
    assert len(rows) == 16, rows
    for kernel, dtype, equal, rel in rows:
        # blocks: the reference's own arithmetic (one partial per 32-wide K block, both scales,
        # block order), bit for bit where the dot sums in fp32 as the interpreter's does (Hopper's
        # FP8 dot does not: scripts/probe_fp8_dot.py); tokens sums the exact products of a wider
        # K tile in another order: fp32 rounding only
        if kernel in ("blocks", "routing"):      # routing: torch's routing gives the kernels' bits
            assert equal == "True", (kernel, dtype, rel)
        else:
            assert float(rel) < 1e-6, (kernel, dtype, rel)


_ROUTE_SCRIPT = """
    import torch
    from v41graph.custom_ops import reference
    from v41graph.custom_ops.triton import moe_fp4
    g = torch.Generator().manual_seed(3)
    e, d = 5, 96
    for n, k in ((1, 6), (13, 3), (50, 6)):          # 6, 39, 300 pairs: one program, tails, five
        chosen = torch.rand(n, e + 1, generator=g).argsort(dim=-1)[:, :k].contiguous()   # id e: elsewhere
        chosen[n // 2, :2] = e                       # two slots held elsewhere in one token
        chosen[-1, 1] = chosen[-1, 0] = min(int(chosen[-1, 0]), e - 1)   # a repeated id
        weights = torch.rand(n, k, generator=g).to(torch.bfloat16)
        ids, pair_w, perm, offs = reference.pairs_by_expert(weights, chosen, e)
        tok, pw, dest, ids_k, offs_k = moe_fp4.route_pairs(weights, chosen, e)
        used = int(offs[-1])                         # pairs past the last group are never read
        route_ok = (torch.equal(offs_k, offs) and torch.equal(dest[:used].long(), perm[:used])
                    and torch.equal(tok[:used].long(), perm[:used] // k) and torch.equal(pw[:used], pair_w[perm][:used])
                    and torch.equal(ids_k.long(), ids.reshape(-1)))
        pairs = torch.randn(n * k, d, generator=g).to(torch.bfloat16)
        pairs[ids.reshape(-1) >= e] = float("nan")   # rows of held-elsewhere pairs are never written
        want = torch.zeros(n, d)
        for j in range(k):
            want = want + torch.where(ids[:, j, None] < e, pairs.view(n, k, d)[:, j].float(), 0.0)
        got = moe_fp4.combine_pairs(pairs, ids_k, e, k)
        got_torch = moe_fp4.combine_pairs(pairs, ids_k, e, k, use_kernel=False)    # V41GRAPH_MOE_ROUTING=torch
        print(n * k, "route", route_ok, "combine", torch.equal(got, want), torch.equal(got_torch, want))
"""


def test_route_and_combine_kernels_match_torch_in_triton_interpreter(tmp_path):
    rows = [line.split() for line in run_interpreted(_ROUTE_SCRIPT, tmp_path)]
    assert [r[0] for r in rows] == ["6", "39", "300"], rows
    for r in rows:
        assert r[1:] == ["route", "True", "combine", "True", "True"], r


_SPLIT_K_SCRIPT = """
    import os
    import torch
    import triton_ptx_doubles
    triton_ptx_doubles.install()
    from v41graph.custom_ops import reference
    from v41graph.custom_ops.triton import moe_fp4
    g = torch.Generator().manual_seed(8)
    e, d, i, n, topk = 4, 512, 96, 24, 3     # 72 pairs: groups past a 16-token tile; 4 K steps of 128
    def stack(rows, k):
        return (torch.randint(0, 256, (e, rows, k // 2), generator=g, dtype=torch.uint8),
                torch.randint(118, 126, (e, rows, k // 32), generator=g, dtype=torch.uint8))
    w13, s13 = stack(2 * i, d)
    w2, s2 = stack(d, i)
    config = (16, 64, 128, 32, 4, 3, "tokens")        # I = 96: a column tile's tail
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(n, d, generator=g) * 3).to(dtype)
        scores = torch.rand(n, e + 1, generator=g)
        scores[:, 2] = -1                    # expert 2: no token
        chosen = scores.topk(topk, dim=-1).indices     # id e: an expert held elsewhere
        weights = torch.rand(n, topk, generator=g)
        want = reference.mxfp4_moe(x, weights, chosen, w13, s13, w2, s2, 10.0)
        unsplit = moe_fp4.mxfp4_moe(x, weights, chosen, w13, s13, w2, s2, 10.0, config=config, split=1)
        for split in (2, 4):
            got = moe_fp4.mxfp4_moe(x, weights, chosen, w13, s13, w2, s2, 10.0, config=config, split=split)
            again = moe_fp4.mxfp4_moe(x, weights, chosen, w13, s13, w2, s2, 10.0, config=config, split=split)
            rel = ((got - want).norm() / want.norm()).item()
            rel_unsplit = ((got - unsplit).norm() / unsplit.norm()).item()
            print(str(dtype), split, torch.equal(got, again), rel, rel_unsplit)
    from v41graph.custom_ops.triton import common
    [counts] = [held for key, held in common._ZEROED.items() if key[0] == "tile_counts"]
    print("counts", len(counts), int(counts[0].count_nonzero()))
"""


def test_split_k_gate_up_matches_the_reference_in_triton_interpreter(tmp_path):
    """The tokens gate_up with K split over programs (_gate_up_kernel with S > 1: fp32 slices, the
    last program of a tile adds them and runs the epilogue): within fp32 rounding of the
    reference and of the unsplit kernel (the slices add in another order), the same bits when
    run again (the last program of a tile sets its count back to zero for the next call), with
    an unpicked expert and experts held elsewhere."""
    rows = [line.split() for line in run_interpreted(_SPLIT_K_SCRIPT, tmp_path)]
    assert rows.pop() == ["counts", "1", "0"]    # one count buffer, left zeroed by every call
    assert [r[:2] for r in rows] == [[dt, sp] for dt in ("torch.bfloat16", "torch.float32") for sp in ("2", "4")], rows
    for dtype, split, same_again, rel, rel_unsplit in rows:
        assert same_again == "True", (dtype, split)
        assert float(rel) < 1e-6 and float(rel_unsplit) < 1e-6, (dtype, split, rel, rel_unsplit)


def test_split_width_takes_equal_slices_of_whole_steps():
    # K = 5120 in steps of 128 (40 steps), I = 2304 (18 steps): the split kernels' K loops have
    # no bound check, so a requested split falls to the largest one that divides the steps
    assert moe_fp4._split_width(5120, 4, 128) == (1280, 4)
    assert moe_fp4._split_width(5120, 3, 128) == (2560, 2)
    assert moe_fp4._split_width(2304, 4, 128) == (768, 3)
    assert moe_fp4._split_width(2304, 1, 128) == (2304, 1)
    assert moe_fp4._split_width(256, 8, 128) == (128, 2)          # never more slices than steps


_SPLIT_PAIRS_SCRIPT = """
    import torch
    from v41graph.custom_ops.triton import quant_gemm
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)) * 3
    for dtype in (torch.float16, torch.float8_e4m3fn):
        codes, scales = quant_gemm.quantize_rows_codes(x, dtype)
        split, split_scales = quant_gemm.quantize_rows_codes(x, dtype, split_pairs=True)
        unsplit = split.float().view(5, -1, 2, 16).transpose(-1, -2).reshape(5, -1)
        moved = not torch.equal(split.float(), codes.float())
        ok = torch.equal(split_scales, scales) and torch.equal(unsplit, codes.float()) and moved
        print(dtype, "OK" if ok else "FAIL")
"""


def test_split_pairs_codes_in_triton_interpreter(tmp_path):
    lines = run_interpreted(_SPLIT_PAIRS_SCRIPT, tmp_path)
    assert len(lines) == 2 and all(line.endswith("OK") for line in lines), lines


@pytest.mark.parametrize("config,message", [
    ((16, 64, 128, 128, 4, 3, "columns"), r"config kernel 'columns' is not one of \('tokens', 'blocks'\)"),
    ((16, 48, 128, 128, 4, 3, "blocks"), r"config BN must be a multiple of 32 .* got 48"),
    ((8, 64, 128, 128, 4, 3, "blocks"), r"the blocks kernels' token tile BM must be >= 16 .* got 8"),
    ((16, 64, 128, 128), r"config must be \(BM, BN, BK_gate_up, BK_down, num_warps, num_stages\[, kernel"
                         r"\[, maxnreg\]\]\), got \(16, 64, 128, 128\)"),
    ((16, 64, 128, 128, 4, 3, "tokens", 16), r"config maxnreg must be None or an integer in \[24, 255\] .* got 16"),
    ((16, 64, 128, 128, 4, 3, "tokens", 128.0), r"config maxnreg must be None .* got 128.0"),
])
def test_bad_config_is_refused_before_any_work(config, message):
    e, d, i = 4, 64, 32          # CPU tensors: the check comes before routing, buffers and launches
    args = (torch.zeros(2, d), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int64),
            torch.zeros(e, 2 * i, d // 2, dtype=torch.uint8), torch.zeros(e, 2 * i, d // 32, dtype=torch.uint8),
            torch.zeros(e, d, i // 2, dtype=torch.uint8), torch.zeros(e, d, i // 32, dtype=torch.uint8), 10.0)
    with pytest.raises(ValueError, match=message):
        moe_fp4.mxfp4_moe(*args, config=config)


@pytest.mark.parametrize("split", [0, 2.0, (2, 1), True])
def test_bad_split_is_refused_before_any_work(split):
    e, d, i = 4, 64, 32
    args = (torch.zeros(2, d), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int64),
            torch.zeros(e, 2 * i, d // 2, dtype=torch.uint8), torch.zeros(e, 2 * i, d // 32, dtype=torch.uint8),
            torch.zeros(e, d, i // 2, dtype=torch.uint8), torch.zeros(e, d, i // 32, dtype=torch.uint8), 10.0)
    with pytest.raises(ValueError, match=r"split must be an integer >= 1 \(gate_up's K slices\), got "):
        moe_fp4.mxfp4_moe(*args, split=split)
    with pytest.raises(ValueError, match=r"split 2: only the tokens kernels split K"):
        moe_fp4.mxfp4_moe(*args, config=(16, 64, 128, 128, 4, 3, "blocks"), split=2)


def test_moe_split_setting(monkeypatch):
    monkeypatch.delenv("V41GRAPH_MOE_SPLIT", raising=False)
    assert moe_fp4._split_k(1.0) == 1               # the default: no split
    monkeypatch.setenv("V41GRAPH_MOE_SPLIT", "4")
    assert moe_fp4._split_k(1.0) == 4
    assert moe_fp4._split_k(moe_fp4.SPLIT_MAX_PAIRS_PER_EXPERT + 1) == 1     # prefill sizes: never
    for bad in ("0", "a", "4,2"):
        monkeypatch.setenv("V41GRAPH_MOE_SPLIT", bad)
        with pytest.raises(ValueError, match=rf"V41GRAPH_MOE_SPLIT must be an integer >= 1 \(gate_up's K slices\), "
                                             rf"got '{bad}'"):
            moe_fp4._split_k(1.0)


def test_quantize_rows_codes_refuses_other_code_dtypes():
    with pytest.raises(ValueError, match=r"codes_dtype must be torch.float16 or torch.float8_e4m3fn, got torch.bfloat16"):
        quant_gemm.quantize_rows_codes(torch.zeros(2, 64), torch.bfloat16)


def test_moe_routing_setting(monkeypatch):
    monkeypatch.setenv("V41GRAPH_MOE_ROUTING", "sort")
    with pytest.raises(ValueError, match=r"V41GRAPH_MOE_ROUTING must be 'kernels' or 'torch', got 'sort'"):
        moe_fp4.routing_kernels_on(6)
    monkeypatch.setenv("V41GRAPH_MOE_ROUTING", "torch")
    assert not moe_fp4.routing_kernels_on(6)
    monkeypatch.delenv("V41GRAPH_MOE_ROUTING")      # the default: the kernels, up to the pair limit
    assert moe_fp4.routing_kernels_on(6) and not moe_fp4.routing_kernels_on(moe_fp4.ROUTE_KERNEL_MAX_PAIRS + 1)
