"""Demo: build the tiny model with random weights, prefill a prompt, decode 16 tokens greedily.

    python -m v41graph.demo [--prompt-len 40] [--steps 16] [--seed 0]

Prints the layer plan, the accounting (parameters, KV bytes per token) of the tiny and the
released configs, the generated tokens, and checks that decoding reproduces the logits a
single prefill of the same tokens gives (the caches at work).
"""
from __future__ import annotations

import argparse
import time

import torch

from .accounting import accounting, format_accounting
from .config import V41Config
from .layer_plan import build_layer_plan, format_layer_plan
from .model import V41Model, init_random_
from .session import Session


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    cfg = V41Config.tiny()
    print("== layer plan (tiny config) ==")
    print(format_layer_plan(build_layer_plan(cfg)))
    print("\n== accounting: tiny ==")
    print(format_accounting(accounting(cfg)))
    print("\n== accounting: released DeepSeek-V4.1-Flash ==")
    print(format_accounting(accounting(V41Config.full())))

    torch.manual_seed(args.seed)
    model = init_random_(V41Model(cfg), seed=args.seed).eval()
    max_len = args.prompt_len + args.steps
    session = Session(model, max_batch_size=1, max_seq_len=max_len, block_size=16)
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_len))
    t0 = time.perf_counter()
    logits = session.prefill(prompt)
    t_prefill = time.perf_counter() - t0
    tokens, step_logits = [], [logits]
    t0 = time.perf_counter()
    for _ in range(args.steps):
        nxt = logits.argmax(-1, keepdim=True)
        tokens.append(int(nxt))
        logits = session.decode(nxt)
        step_logits.append(logits)
    t_decode = time.perf_counter() - t0
    print(f"\n== generation (random weights) ==\nprompt ({args.prompt_len} tokens): {prompt[0].tolist()}")
    print(f"greedy tokens ({args.steps}): {tokens}")
    print(f"prefill {t_prefill * 1e3:.0f} ms, decode {t_decode / max(args.steps, 1) * 1e3:.0f} ms/token (CPU, eager)")
    print(f"cache memory allocated: {session.caches.nbytes() / 1024:.1f} KiB")

    # The cached decode must agree with one prefill over the same tokens.
    check = Session(model, max_batch_size=1, max_seq_len=max_len, block_size=16)
    full = torch.cat([prompt, torch.tensor([tokens])], 1)
    meta_logits = check.extend([0], [full[0, :-1].tolist()]) if args.steps else None
    if meta_logits is not None:
        diff = (meta_logits - step_logits[-2]).abs().max().item()
        print(f"decode vs one-shot prefill, last logits max |diff| = {diff:.2e}")
        if diff > 1e-3:
            print("MISMATCH")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
