#!/usr/bin/env bash
# Whole-model decode step of another tree ($OLD_TREE, e.g. `git archive REV | tar -x -C DIR`) vs
# this one, on one machine, interleaved: old, new, old, new (each installed editable in turn);
# prints the step times and new/old. For a refactor that must keep step times (issue 16).
set -uo pipefail
ROOT=$(pwd)
OLD=${OLD_TREE:-$ROOT/.devrun/old}
OUT=${OUT:-out}; mkdir -p "$OUT"
ARGS="--config bench --device cuda --batches 1,64 --contexts 4096 --prefill 0 --variants v41graph --share-bucket-1 --steps 50 --no-profile"
export TRITON_CACHE_DIR=/tmp/triton_cache
for round in 1 2; do
  for tree in old new; do
    dir=$ROOT; [ $tree = old ] && dir=$OLD
    (cd "$dir" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1)
    mkdir -p "$OUT/${tree}_$round"
    (cd "$dir" && python3 scripts/bench.py $ARGS --out "$OUT/${tree}_$round" > "$OUT/${tree}_$round/table.txt" 2> "$OUT/${tree}_$round/bench.log")
    echo "== $tree round $round"; grep -E "decode" "$OUT/${tree}_$round/table.txt" | head -4
  done
done
python3 - "$OUT" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(os.path.join(out, "*_*", "bench.json"))):
    tree = os.path.basename(os.path.dirname(f))
    for r in json.load(open(f))["rows"]:
        if r.get("kind") == "decode":
            rows.setdefault(r["batch"], {})[tree] = r["step_ms"]
print("batch | " + " | ".join(sorted(next(iter(rows.values())))) + " | new/old (mean)")
for b, d in sorted(rows.items()):
    old = [v for k, v in d.items() if k.startswith("old")]; new = [v for k, v in d.items() if k.startswith("new")]
    print(b, "|", " | ".join(f"{d[k]:.2f}" for k in sorted(d)), "|", f"{(sum(new)/len(new))/(sum(old)/len(old)):.3f}")
PY
