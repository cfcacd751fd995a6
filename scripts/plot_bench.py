"""Plot scripts/bench.py's bench.json: decode step time vs batch, one line per variant, one panel
per context, with the roofline floor dashed.

    python scripts/plot_bench.py path/to/bench.json [more.json ...] docs/bench_decode.png

Several files are merged row by row; a later file's row replaces an earlier one with the same
(variant, batch, context). (Rows from different runs come from different machine starts: say
which runs a plot merges where it is shown.)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    merged: dict = {}
    for path in argv[:-1]:
        data = json.loads(Path(path).read_text())
        for r in data["rows"]:
            if r["kind"] == "decode":
                merged[(r["variant"], r["batch"], r["context"])] = r
    rows = list(merged.values())
    contexts = sorted({r["context"] for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        for v in variants:
            pts = sorted((r["batch"], r["step_ms"]) for r in rows if r["variant"] == v and r["context"] == ctx)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=v)
        floor = sorted({(r["batch"], r["floor_ms"]) for r in rows if r["context"] == ctx})
        ax.plot(*zip(*floor), "k--", label="floor (bytes / copy BW)")
        ax.set(xscale="log", yscale="log", xlabel="batch (sequences)", ylabel="decode step (ms)",
               title=f"{data['config']} config, context {ctx}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{data.get('gpu') or data['device']}, torch {data.get('torch', '?')}")
    fig.tight_layout()
    fig.savefig(argv[-1], dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
