"""Demo: build the tiny model with random weights, compile it with every pass, prefill a
prompt and decode 16 tokens greedily.

    python -m v41graph.tools.demo [--prompt-len 40] [--steps 16] [--seed 0] [--no-compile] [--dump-dir DIR]

Prints the layer plan, the accounting (parameters, KV bytes per token) of the tiny and the
released configs, what each compiler pass did, the generated tokens (also as text, through the
random checkpoints' small tokenizer), and checks the compiled run against the eager model (same
tokens, logits within fp32 noise).
"""
from __future__ import annotations

import argparse
import time

import torch

from v41graph.weights.accounting import accounting, format_accounting
from v41graph.model.config import V41Config
from v41graph.model.layer_plan import build_layer_plan, format_layer_plan
from v41graph.model.model import V41Model, init_random_
from v41graph.runtime.session import Session


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-compile", action="store_true", help="run the eager model only")
    ap.add_argument("--dump-dir", default=None, help="write per-pass graph dumps here")
    args = ap.parse_args(argv)

    cfg = V41Config.tiny()
    print("== layer plan (tiny config) ==")
    print(format_layer_plan(build_layer_plan(cfg)))
    print("\n== accounting: tiny ==")
    print(format_accounting(accounting(cfg)))
    print("\n== accounting: released DeepSeek-V4.1-Flash ==")
    print(format_accounting(accounting(V41Config.full())))

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)   # the tiny model's ops are far too small to gain from threads
    model = init_random_(V41Model(cfg), seed=args.seed).eval().requires_grad_(False)
    max_len = args.prompt_len + args.steps + 1
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_len))
    runner = model
    if not args.no_compile:
        from v41graph.compiler.compiled_model import compile as v41compile
        print("\n== compile (v41graph backend, all passes) ==")
        runner = v41compile(model, backend="auto", batch_sizes=(1,), dump_dir=args.dump_dir)
    session = Session(runner, max_batch_size=1, max_seq_len=max_len, block_size=16)
    t0 = time.perf_counter()
    logits = session.prefill(prompt)
    t_prefill = time.perf_counter() - t0
    tokens, all_logits = [], [logits]
    t0 = time.perf_counter()
    for _ in range(args.steps):
        nxt = logits.argmax(-1, keepdim=True)
        tokens.append(int(nxt))
        logits = session.decode(nxt)
        all_logits.append(logits)
    t_decode = time.perf_counter() - t0
    if runner is not model:
        for graph_records in runner.pass_manager.records:
            print("  " + ", ".join(f"{r['pass']}: {r['matched_count']}" for r in graph_records))
        print(f"  (first prefill and first decode include compilation: {t_prefill:.1f} s, "
              f"{t_decode:.1f} s for {args.steps} steps)")
    print(f"\n== generation (random weights) ==\nprompt ({args.prompt_len} tokens): {prompt[0].tolist()}")
    print(f"greedy tokens ({args.steps}): {tokens}")
    prompt_text, text = _as_text(cfg.vocab_size, prompt[0].tolist(), tokens)
    print(f"as text (random weights, random text): prompt {prompt_text!r} -> {text!r}")
    print(f"cache memory allocated: {session.caches.nbytes() / 1024:.1f} KiB")

    # Eager reference: same prompt, same tokens teacher-forced.
    eager = Session(model, max_batch_size=1, max_seq_len=max_len, block_size=16)
    worst = (eager.prefill(prompt) - all_logits[0]).abs().max().item()
    for tok, ref in zip(tokens, all_logits[1:]):
        worst = max(worst, (eager.decode(torch.tensor([[tok]])) - ref).abs().max().item())
    label = "compiled" if runner is not model else "eager rerun"
    print(f"{label} vs eager, max |logit diff| over prefill + {args.steps} steps = {worst:.2e}")
    if worst > 1e-3:
        print("MISMATCH")
        return 1
    return 0


def _as_text(vocab_size: int, *id_lists) -> list[str]:
    """Decode with the tokenizer random checkpoints get (weights/random_tokenizer.py)."""
    import tempfile

    from tokenizers import Tokenizer

    from v41graph.weights.random_tokenizer import write_random_tokenizer
    with tempfile.TemporaryDirectory() as d:
        tok = Tokenizer.from_file(str(write_random_tokenizer(d, vocab_size)))
    return [tok.decode(ids, skip_special_tokens=True) for ids in id_lists]


if __name__ == "__main__":
    raise SystemExit(main())
