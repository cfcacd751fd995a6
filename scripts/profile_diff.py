"""Two profiled scripts/bench.py runs side by side, kernel by kernel: for every decode or prefill
row both runs profiled (same kind, context and batch), each kernel's time per step, calls per
step and time per call, old and new, the largest first. It reads the bench.json files that
`scripts/bench.py --profile-all --out DIR` writes, so it needs no GPU: what a change moved, and
where a step's time went, read off two runs.

    python scripts/profile_diff.py docs/bench_rank_h100_s29_profile.json docs/bench_rank_h100_s29_mhc.json
    python scripts/profile_diff.py OLD.json NEW.json --variant v41graph --top 15
    python scripts/profile_diff.py RUN.json RUN.json --old-variant v41graph-torchmhc --new-variant v41graph

Kernel times in a profile of a captured step include the time a kernel shared the GPU with
kernels on other streams (P6's side streams, the graph's independent branches), so a kernel's
time per call is an upper bound on its cost alone; docs/BENCHMARKS.md (thirty-first session).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

STEP_MARKERS = "v41graph.step"      # bench.py's record_function ranges, one per profiled step


@dataclass
class KernelRow:
    name: str
    old_ms: float           # per step; 0 where the kernel is not in that run's list
    new_ms: float
    old_calls: float
    new_calls: float


def per_call_us(ms: float, calls: float) -> float | None:
    return 1000.0 * ms / calls if calls else None


def _kernels(row: dict) -> dict[str, tuple[float, float]]:
    profile = row.get("profile") or {}
    return {k["name"]: (k["ms_per_step"], k["calls_per_step"]) for k in profile.get("top_kernels", [])
            if not k["name"].startswith(STEP_MARKERS)}


def _key(row: dict) -> tuple:
    return row["kind"], row["context"], row["batch"]


def profiled_rows(path: Path, variant: str | None) -> dict[tuple, dict]:
    """The rows of one bench.json that carry a profile, by (kind, context, batch), of one variant
    (None: the file must hold one variant per key)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"profile_diff: cannot read {path} as JSON: {e}")
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise SystemExit(f"profile_diff: {path} is not a scripts/bench.py result (no 'rows' list)")
    rows: dict[tuple, dict] = {}
    for row in data["rows"]:
        if not row.get("profile") or (variant is not None and row["variant"] != variant):
            continue
        if _key(row) in rows:
            raise SystemExit(f"profile_diff: {path} profiles {_key(row)} for variants "
                             f"{rows[_key(row)]['variant']!r} and {row['variant']!r}; name one with --variant")
        rows[_key(row)] = row
    return rows


def diff(old: dict, new: dict) -> list[KernelRow]:
    """Every kernel of either row, the largest time per step (old or new) first."""
    a, b = _kernels(old), _kernels(new)
    out = []
    for name in {**a, **b}:
        old_ms, old_calls = a.get(name, (0.0, 0.0))
        new_ms, new_calls = b.get(name, (0.0, 0.0))
        out.append(KernelRow(name, old_ms, new_ms, old_calls, new_calls))
    return sorted(out, key=lambda r: -max(r.old_ms, r.new_ms))


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def report(old: dict, new: dict, top: int) -> str:
    lines = [f"{old['kind']} ctx {old['context']} batch {old['batch']}: "
             f"{old['variant']} {old['step_ms']:.2f} ms -> {new['variant']} {new['step_ms']:.2f} ms per step "
             f"({new['step_ms'] / old['step_ms']:.3f}x); kernels per step "
             f"{old['profile'].get('kernels_per_step', '?')} -> {new['profile'].get('kernels_per_step', '?')}",
             f"  {'ms/step old':>11} {'new':>7} {'delta':>7} {'calls old':>9} {'new':>6} "
             f"{'us/call old':>11} {'new':>7}  kernel"]
    for r in diff(old, new)[:top]:
        lines.append(f"  {r.old_ms:11.3f} {r.new_ms:7.3f} {r.new_ms - r.old_ms:+7.3f} {r.old_calls:9.1f} "
                     f"{r.new_calls:6.1f} {_us(per_call_us(r.old_ms, r.old_calls)):>11} "
                     f"{_us(per_call_us(r.new_ms, r.new_calls)):>7}  {r.name[:90]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path, help="bench.json of the earlier run")
    ap.add_argument("new", type=Path, help="bench.json of the later run (may be the same file)")
    ap.add_argument("--variant", help="the variant to take from both files")
    ap.add_argument("--old-variant", help="the variant to take from OLD (default --variant)")
    ap.add_argument("--new-variant", help="the variant to take from NEW (default --variant)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed per row (default 25)")
    args = ap.parse_args(argv)
    if args.top < 1:
        ap.error(f"--top must be at least 1, got {args.top}")
    old = profiled_rows(args.old, args.old_variant or args.variant)
    new = profiled_rows(args.new, args.new_variant or args.variant)
    common = sorted(set(old) & set(new), key=str)
    if not common:
        print(f"profile_diff: no (kind, context, batch) row is profiled in both files "
              f"(old: {sorted(old, key=str)}, new: {sorted(new, key=str)})", file=sys.stderr)
        return 1
    print("\n\n".join(report(old[k], new[k], args.top) for k in common))
    return 0


if __name__ == "__main__":
    sys.exit(main())
