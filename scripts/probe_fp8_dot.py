"""Does Hopper's FP8 tensor-core dot sum its exact products in fp32? The same values (E2M1 codes
placed as E4M3, times E4M3 activation codes: every product exact) through a K = 32 FP8 dot and an
fp16 dot (Triton), against the exact sum (fp64) rounded once to fp32. Why the MXFP4 MoE's blocks
kernels are not the reference arithmetic on the GPU (docs/BENCHMARKS.md, twenty-fourth session).

    python3 scripts/probe_fp8_dot.py      # on a GPU with FP8 tensor cores (sm89+)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from v41graph.custom_ops import codecs

M, N, K = 64, 16, 32      # one wgmma tile: 64 weight rows, 16 tokens, one 32-wide K block


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + n[:, None] * K + k[None, :])
    tl.store(out_ptr + m[:, None] * N + n[None, :], tl.dot(a, tl.trans(b)))


def main() -> None:
    g = torch.Generator().manual_seed(0)
    results = {"fp8": [], "fp16": []}
    for _ in range(20):
        codes = torch.randint(0, 16, (M, K), generator=g, dtype=torch.uint8)
        w = codecs.e2m1_decode(codes).float() * 2.0 ** -6                 # E2M1 as E4M3, exactly
        x = (torch.randn(N, K, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        exact = (w.double() @ x.double().T).float()                        # one rounding to fp32
        for name, dtype in (("fp8", torch.float8_e4m3fn), ("fp16", torch.float16)):
            out = torch.empty(M, N, device="cuda")
            _dot_kernel[(1,)](w.to(dtype).cuda(), x.to(dtype).cuda(), out, M=M, N=N, K=K)
            got = out.cpu()
            rel = ((got - exact).abs() / exact.abs().clamp_min(1e-30)).max().item()
            results[name].append((torch.eq(got, exact).float().mean().item(), rel))
    for name, rows in results.items():
        equal = 100 * sum(r[0] for r in rows) / len(rows)
        print(f"{name} dot, K = {K}: {equal:.2f} % bit-equal to the correctly rounded fp32 sum, "
              f"max rel {max(r[1] for r in rows):.2e}")


if __name__ == "__main__":
    main()
