"""Write a random checkpoint of any config in the official DeepSeek-V4.1-Flash layout.

    python scripts/make_random_checkpoint.py --config tiny --out /tmp/v41_tiny
    python scripts/make_random_checkpoint.py --config bench --out /data/v41_bench --max-shard-gb 4
    python scripts/make_random_checkpoint.py --config bench_rank --out /data/v41_rank   # 48 experts, ~49 GB
    python scripts/make_random_checkpoint.py --config my_config.json --out DIR --seed 3
    python scripts/make_random_checkpoint.py --config full --out DIR --dry-run   # plan only

Weights come from `v41graph.model.init_random_`, applied one unit at a time (embedding, final
norm, head, each Engram module, each layer; DSpark `mtp.*` tensors one by one with the same
rules; Engram tables in blocks of rows), each written at its final offset and freed, so peak
memory is about one layer whatever the config. Named configs are written with
weight_format="checkpoint" (FP8 / FP4 as released) unless --weight-format dense; a JSON config
keeps its own weight_format. A small real tokenizer (byte-level BPE over the config's vocabulary,
with a chat template) is written too, unless --no-tokenizer. Load the result with
`v41graph.from_pretrained(DIR)`; `v41graph serve DIR` serves it over HTTP.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from v41graph.weights.checkpoint import plan_shards
from v41graph.model.config import V41Config
from v41graph.weights.names import official_tensor_specs
from v41graph.weights.random_checkpoint import write_random_checkpoint


def config_from_arg(name: str, weight_format: str | None) -> V41Config:
    if name in ("tiny", "bench", "bench_rank", "full"):
        config = getattr(V41Config, name)()
        return dataclasses.replace(config, weight_format=weight_format or "checkpoint")
    path = Path(name)
    if not path.exists():
        raise SystemExit(f"--config: {name!r} is not tiny, bench, bench_rank, full or an existing JSON file")
    config = V41Config.from_json(path)
    return dataclasses.replace(config, weight_format=weight_format) if weight_format else config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="tiny | bench | bench_rank | full | path to a config.json")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-gb", type=float, default=4.0, help="shard size limit (GiB)")
    ap.add_argument("--single-file", action="store_true", help="one model.safetensors, no index")
    ap.add_argument("--weight-format", choices=("checkpoint", "dense"), default=None)
    ap.add_argument("--no-mtp", action="store_true", help="leave out the DSpark stages (mtp.*)")
    ap.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    ap.add_argument("--dry-run", action="store_true", help="print the shard plan, write nothing")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    args = ap.parse_args(argv)

    config = config_from_arg(args.config, args.weight_format)
    max_bytes = int(args.max_shard_gb * 1024 ** 3)
    specs = official_tensor_specs(config, include_mtp=not args.no_mtp)
    shards = plan_shards(((s.name, s.dtype, s.shape) for s in specs.values()), max_bytes,
                         args.single_file or None)
    total = sum(p.nbytes for shard in shards for p in shard)
    print(f"{args.config}: {len(specs)} tensors, {total / 1024 ** 3:.3f} GiB in {len(shards)} "
          f"shard(s) -> {args.out}")
    if args.dry_run:
        return 0
    t0 = time.time()
    write_random_checkpoint(config, args.out, args.seed, max_shard_bytes=max_bytes,
                            single_file=args.single_file or None, include_mtp=not args.no_mtp,
                            tokenizer=not args.no_tokenizer, progress=False if args.quiet else True)
    print(f"wrote {args.out} in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
