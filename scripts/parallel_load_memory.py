"""Peak host memory of loading a checkpoint whole vs as one rank's share (issue 19: no rank
materializes the full model). Writes a random checkpoint of a mid-sized config once, then loads
it in fresh subprocesses (one per case) and reports each one's peak RSS above its baseline
(torch imported, nothing loaded) and the bytes the loader read.

    python scripts/parallel_load_memory.py --dir /tmp/v41-mid
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

CONFIG = dict(hidden_size=1024, moe_intermediate_size=1024, vocab_size=32768, n_routed_experts=16,
              num_experts_per_tok=4, weight_format="checkpoint", torch_dtype="bfloat16")
CASES = {"whole": None, "tp2+ep2 rank 0": ("tp", 0), "dp2+ep2 rank 0": ("dp", 0)}


def child(path: str, case: str) -> None:
    import torch  # noqa: F401  (the baseline includes torch)
    import v41graph
    from v41graph.parallel import ParallelConfig, ParallelState
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    spec = CASES[case]
    if spec is None:
        model = v41graph.from_pretrained(path, progress=False)
        loaded = None
    else:
        layout = ParallelConfig(tp=2, ep=2) if spec[0] == "tp" else ParallelConfig(dp=2, ep=2)
        model = v41graph.from_pretrained(path, parallel=ParallelState(layout, spec[1]), progress=False)
        loaded = model.loaded_bytes
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"case": case, "peak_rss_above_baseline_mb": (peak - base) / 1024,
                      "param_mb": params / 2 ** 20, "loaded_mb": None if loaded is None else loaded / 2 ** 20}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    d = Path(args.dir)
    if not (d / "config.json").exists():
        import v41graph
        from v41graph.weights.random_checkpoint import write_random_checkpoint
        cfg = v41graph.V41Config.tiny(**CONFIG)
        write_random_checkpoint(cfg, d, seed=0, progress=False)
    size = sum(f.stat().st_size for f in d.glob("*.safetensors")) / 2 ** 20
    print(f"checkpoint {d}: {size:.0f} MiB")
    print(f"{'case':>16} {'peak RSS MiB':>13} {'params MiB':>11} {'read MiB':>9}")
    for case in CASES:
        out = subprocess.run([sys.executable, __file__, "--dir", str(d), "--child", str(d), case],
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        read = "-" if r["loaded_mb"] is None else f"{r['loaded_mb']:.0f}"
        print(f"{case:>16} {r['peak_rss_above_baseline_mb']:>13.0f} {r['param_mb']:>11.0f} {read:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
