"""Hand-over benchmark of prefill/decode disaggregation (v41graph.disagg).

One process, one device (the H200 run):

    python scripts/bench_disagg.py --out OUT                         # bench config, 4K prompt, cuda
    python scripts/bench_disagg.py --config tiny --device cpu --lengths 12,40 --repeats 1 --out OUT

P and D live in one process and share one random model (seed 0; D holds the whole model, P
reads its share of it); each has its own caches. The hand-over goes through the same code as
between processes (PrefillWorker packs each part as its encoder layer is done, Sender / Receiver
speak the same messages, DecodeWorker.admit writes the caches and runs the decoder replay), with
`LocalTransport` as the link: every message copied on a transfer stream while the encoder goes
on on the main stream. Why not two processes on the GPU: NCCL refuses two ranks on one device,
and gloo would move every part through host memory and TCP (a host round trip, not a GPU link)
while each process held its own copy of the ~60 GB bench weights.

Per prompt length, medians of --repeats after one warm-up run (every time waits for the device):
  full_prefill_s / replay_prefill_s   one process's Session.prefill (mode full / replay)
  p_alone_s       P's prefill without sends (encoder half + packing the parts)
  p_with_sends_s  the same with every part sent the moment its layer is done, until the last copy
                  has landed (send_prefill: BEGIN, parts, END, wait)
  exposed_s       p_with_sends_s - p_alone_s: what the hand-over adds to P's time
  copy_busy_s     the transfer stream's copy time of the request's messages (CUDA events; CPU: 0)
  host_roundtrip_s  the request's parts copied to host memory and back (what a gloo route adds
                  at the least, TCP aside)
  admit_s         D: writing the hand-over into its caches + the decoder replay (first token)
  first_token_equal  D's first-token logits == the one-process replay prefill's (torch.equal)
  bytes           the hand-over's bytes by kind (layout) and what the Sender counted
--compile runs P and D through v41graph.compile (default: eager; either way P sends each part
from between two encoder layers).
Writes OUT/bench_disagg.json (or OUT itself when it ends in .json) and prints a table last.

Launched under torchrun with two processes (WORLD_SIZE=2) it runs the CPU gloo variant of the
earlier measurement instead (docs/BENCHMARKS.md, tiny): rank 0 P, rank 1 D, over gloo.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import torch  # noqa: E402

import v41graph  # noqa: E402
from v41graph.disagg.handover import byte_counts, layout  # noqa: E402
from v41graph.disagg.transfer import LocalTransport, Receiver, Sender, send_prefill  # noqa: E402
from v41graph.disagg.workers import DecodeWorker, PrefillWorker  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import build_model  # noqa: E402  (scripts/bench.py: the bench model with random weights)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def measure_length(model, n: int, repeats: int, block_size: int, device: torch.device, roles_model=None) -> dict:
    """roles_model: what P and D run (a CompiledModel with --compile; default the eager model);
    the one-process reference Sessions run the eager model."""
    cfg = model.config
    roles_model = roles_model if roles_model is not None else model
    gen = torch.Generator().manual_seed(n)
    prompt = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
    sessions = {m: v41graph.Session(model, 1, n, block_size=block_size) for m in ("full", "replay")}
    p = PrefillWorker(roles_model, 1, n, block_size)
    d = DecodeWorker(roles_model, 1, n, block_size)
    transport = LocalTransport()
    sender = Sender(dst=1, isend=transport.isend, payload_device=None)
    rx = Receiver(cfg, model.compute_dtype, d.fingerprint)
    rec = {k: [] for k in ("full_prefill_s", "replay_prefill_s", "p_alone_s", "p_with_sends_s", "copy_busy_s",
                           "host_roundtrip_s", "admit_s")}
    first_equal = []
    for r in range(repeats + 1):                       # run 0 warms up (kernel JIT, allocator)
        want = None
        for mode, s in sessions.items():
            t, logits = timed(lambda: s.prefill([prompt], mode=mode), device)
            s.release(0)
            if r:
                rec[f"{mode}_prefill_s"].append(t)
            if mode == "replay":
                want = logits[0]
        t_alone, _ = timed(lambda: p.prefill([prompt], [r]), device)
        copies_before = len(transport.copies)
        t_sends, info = timed(lambda: send_prefill(p, sender, [prompt], [r]), device)
        busy = sum(start.elapsed_time(end) / 1e3 for _, start, end in transport.copies[copies_before:])
        [(rid, h)] = transport.deliver(rx)
        if isinstance(h, Exception):
            raise h
        t_admit, logits = timed(lambda: d.admit(0, h), device)
        d.release(0)
        # what a host route (gloo) moves at the least: every part to host memory and back
        t_host, _ = timed(lambda: [t.cpu().to(device) for t in h.parts.values()], device)
        if r:
            rec["host_roundtrip_s"].append(t_host)
            rec["p_alone_s"].append(t_alone)
            rec["p_with_sends_s"].append(t_sends)
            rec["copy_busy_s"].append(busy)
            rec["admit_s"].append(t_admit)
            first_equal.append(bool(torch.equal(logits, want)))
    row = {"n": n, **{k: statistics.median(v) for k, v in rec.items()}}
    row["exposed_s"] = row["p_with_sends_s"] - row["p_alone_s"]
    row["first_token_equal"] = all(first_equal)
    row["bytes_layout"] = byte_counts(layout(cfg, n, model.compute_dtype))
    row["bytes_sent_per_request"] = {k: v // (repeats + 1) for k, v in sender.bytes.items()}
    row["kv_bytes_per_token"] = row["bytes_layout"]["kv"] / n
    return row


def table(rows: list, device: str, config: str, compiled: bool) -> str:
    ms = lambda s: f"{s * 1e3:.2f}"   # noqa: E731
    roles = "P and D compiled" if compiled else "P and D eager"
    lines = [f"prefill/decode hand-over, {config} config, {device}, {roles}, one process (LocalTransport)",
             "| prompt | full prefill ms | replay prefill ms | P alone ms | P with sends ms | exposed ms "
             "| copy busy ms | host round trip ms | D admit ms | hand-over bytes (KV + fixed) | first token equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['n']} | failed: {r['error'].strip().splitlines()[-1]} |")
            continue
        b = r["bytes_layout"]
        lines.append(f"| {r['n']} | {ms(r['full_prefill_s'])} | {ms(r['replay_prefill_s'])} | {ms(r['p_alone_s'])} "
                     f"| {ms(r['p_with_sends_s'])} | {ms(r['exposed_s'])} | {ms(r['copy_busy_s'])} "
                     f"| {ms(r['host_roundtrip_s'])} | {ms(r['admit_s'])} | {b['total']:,} ({b['kv']:,} + {b['total'] - b['kv']:,}) "
                     f"| {r['first_token_equal']} |")
    return "\n".join(lines)


def run_local(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    model = build_model(args.config, device.type)
    build_s = time.perf_counter() - t0
    # --compile: P's encoder and D's decoder replay as graphs of our passes (one CompiledModel
    # serves both roles: they share the weights); the first run traces them
    roles_model = v41graph.compile(model, batch_sizes=(1,)) if args.compile else None
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    for n in lengths:
        try:
            rows.append(measure_length(model, n, args.repeats, args.block_size, device, roles_model))
        except Exception:           # report it and go on: the other lengths still measure
            rows.append({"n": n, "error": traceback.format_exc()})
            print(rows[-1]["error"], file=sys.stderr)
    out = Path(args.out)
    path = out if out.suffix == ".json" else out / "bench_disagg.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {"config": args.config, "device": str(device), "compiled_roles": bool(args.compile),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "repeats": args.repeats, "build_s": build_s,
              "total_s": time.perf_counter() - t0, "rows": rows}
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    print(table(rows, str(device), args.config, args.compile))
    return 1 if any("error" in r for r in rows) else 0


# ----------------------------------------------------------------------------- two processes (gloo, CPU)
def run_gloo(args) -> int:
    """The CPU two-process variant: rank 0 P, rank 1 D, gloo; OUT.rank{r}.json."""
    import torch.distributed as dist
    from v41graph.disagg.transfer import BEGIN, END, receive

    class TimedReceiver(Receiver):
        def __init__(self, *a):
            super().__init__(*a)
            self.began, self.ended = {}, {}

        def feed(self, header, payload):
            kind, rid = header[1], header[2]
            (self.began if kind == BEGIN else self.ended if kind == END else {})[rid] = time.perf_counter()
            return super().feed(header, payload)

    cpu = torch.device("cpu")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    model = build_model(args.config, "cpu")
    lengths = [int(x) for x in args.lengths.split(",")]
    max_len, rows = max(lengths), []
    if rank == 0:
        sender = Sender(dst=1)
        for n in lengths:
            prompt = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            rec = {"n": n, "full_prefill_s": [], "replay_prefill_s": [], "encode_alone_s": [],
                   "encode_with_sends_s": [], "wait_s": []}
            worker = PrefillWorker(model, 1, max_len, args.block_size)
            for r in range(args.repeats):
                for mode in ("full", "replay"):
                    s = v41graph.Session(model, 1, max_len, block_size=args.block_size)
                    rec[f"{mode}_prefill_s"].append(timed(lambda: s.prefill([prompt], mode=mode), cpu)[0])
                rec["encode_alone_s"].append(timed(lambda: worker.prefill([prompt], [0]), cpu)[0])
                before = dict(sender.bytes)
                t = send_prefill(worker, sender, [prompt], [r])
                rec["encode_with_sends_s"].append(t["encode_s"])
                rec["wait_s"].append(t["wait_s"])
                rec["bytes"] = {k: sender.bytes[k] - before[k] for k in before}
            rows.append({k: statistics.median(v) if isinstance(v, list) else v for k, v in rec.items()})
        sender.stop()
        sender.wait()
    else:
        d = DecodeWorker(model, 1, max_len, args.block_size)
        rx = TimedReceiver(model.config, model.compute_dtype, d.fingerprint)
        per_n: dict = {}
        for rid, h in receive(rx, src=0):
            admit_s, _ = timed(lambda: d.admit(0, h), cpu)
            r = per_n.setdefault(h.prompt_len, {"receive_s": [], "admit_s": []})
            r["receive_s"].append(rx.ended[rid] - rx.began[rid])
            r["admit_s"].append(admit_s)
            d.release(0)
        rows = [{"n": n, **{k: statistics.median(v) for k, v in r.items()}} for n, r in per_n.items()]
    dist.destroy_process_group()
    gathered = {"rank": rank, "config": args.config, "threads": torch.get_num_threads(), "rows": rows}
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(gathered, f, indent=1)
    print(json.dumps(gathered))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bench", choices=["tiny", "bench"])
    ap.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    ap.add_argument("--lengths", default="4096", help="prompt lengths, comma-separated (default 4096)")
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per length after one warm-up")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--compile", action="store_true",
                    help="P and D through v41graph.compile (encoder and decoder-replay graphs). Adds "
                         "their traces to the run (minutes on the bench config)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if int(os.environ.get("WORLD_SIZE", "1")) == 2:
        return run_gloo(args)
    return run_local(args)


if __name__ == "__main__":
    raise SystemExit(main())
