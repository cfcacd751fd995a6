#!/usr/bin/env python
"""The golden tiny checkpoint (DeepSeek's reference vectors) through numerics="released" on the
GPU vs the CPU reference numerics: argmax at every step, max |delta logit|, and the first layer
whose block output differs (and by how much), for the prefill and each decode step.

    python scripts/released_numerics.py [--out DIR]

The CPU side runs with MKL_CBWR=COMPATIBLE and 2 threads, as the golden vectors were made; its
prefill logits are checked against the golden file first, so the comparison is against
DeepSeek's reference, not against our own output.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def run(model, io, device: str):
    from v41graph.runtime.session import Session
    session = Session(model, max_batch_size=1, max_seq_len=64, block_size=64)
    steps = []
    model.debug = {}
    logits = session.prefill(io["prompt_ids"].to(device))
    steps.append(("prefill", logits.float().cpu(), {k: v.float().cpu() for k, v in model.debug.items()
                                                    if k.startswith("block_out.")}))
    for s in range(io["decode_ids"].shape[1]):
        model.debug = {}
        logits = session.decode(io["decode_ids"][:, s:s + 1].to(device))
        steps.append((f"decode {s}", logits.float().cpu(), {k: v.float().cpu() for k, v in model.debug.items()
                                                            if k.startswith("block_out.")}))
    model.debug = None
    return steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("released_numerics: needs a CUDA GPU")
        return 2
    torch.set_num_threads(2)
    sys.path.insert(0, str(REPO / "tests"))
    from golden_path import GOLDEN_DIR
    from safetensors.torch import load_file
    from v41graph.weights.load import from_pretrained
    io = load_file(str(GOLDEN_DIR / "io.safetensors"))
    cpu = run(from_pretrained(GOLDEN_DIR, numerics="reference"), io, "cpu")
    assert torch.equal(cpu[0][1], io["prefill_logits"].float()), "CPU reference no longer matches the golden file"
    gpu_model = from_pretrained(GOLDEN_DIR, numerics="released", device="cuda")
    gpu = run(gpu_model, io, "cuda")
    rows = []
    for (name, lc, dc), (_, lg, dg) in zip(cpu, gpu):
        layers = sorted(dc, key=lambda k: int(k.split("layer")[-1]))
        first = next((k for k in layers if not torch.equal(dc[k], dg[k])), None)
        rows.append(dict(step=name, argmax_equal=bool(torch.equal(lc.argmax(-1), lg.argmax(-1))),
                         max_abs_dlogit=float((lc - lg).abs().max()),
                         logit_scale=float(lc.abs().max()),
                         first_layer_differing=first,
                         first_layer_max_abs_diff=float((dc[first] - dg[first]).abs().max()) if first else 0.0))
    print(f"{'step':<10} {'argmax':>7} {'max|dlogit|':>12} {'|logit|max':>11} first differing block (max |d|)")
    for r in rows:
        print(f"{r['step']:<10} {str(r['argmax_equal']):>7} {r['max_abs_dlogit']:>12.4g} {r['logit_scale']:>11.3g} "
              f"{r['first_layer_differing']} ({r['first_layer_max_abs_diff']:.3g})")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "released_numerics.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["argmax_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
