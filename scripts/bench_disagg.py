"""Hand-over benchmark of prefill/decode disaggregation (v41graph.disagg), two processes:

    python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 \\
        --master-port 29731 scripts/bench_disagg.py --config tiny --lengths 512,4096 --out OUT

Both ranks build the same random model (seed 0); rank 0 is the prefill worker, rank 1 the
decode worker (gloo on CPU). Per prompt length, median of --repeats:
  rank 0  full_prefill_s / replay_prefill_s: one process's Session.prefill (mode full / replay)
          of the prompt on the whole model; encode_alone_s: P's encoder half without sending;
          encode_with_sends_s: the same with every part isend-ed the moment its layer is done;
          wait_s: waiting for the sends after the encoder; bytes sent by kind
  rank 1  receive_s: the request's BEGIN to its END arriving (P encodes in between); admit_s: writing the hand-over into
          D's caches + the decoder replay (first token)
Writes OUT.json (rank 0's and rank 1's rows).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import v41graph  # noqa: E402
from v41graph.disagg.transfer import BEGIN, END, Receiver, Sender, receive, send_prefill  # noqa: E402
from v41graph.disagg.workers import DecodeWorker, PrefillWorker  # noqa: E402
from v41graph.model.layers import default_dtype  # noqa: E402
from v41graph.model.model import V41Model, init_random_  # noqa: E402
from v41graph.weights.names import compute_dtype  # noqa: E402


class TimedReceiver(Receiver):
    """A Receiver that notes when each request's BEGIN and END arrived."""

    def __init__(self, *args):
        super().__init__(*args)
        self.began, self.ended = {}, {}

    def feed(self, header, payload):
        kind, rid = header[1], header[2]
        (self.began if kind == BEGIN else self.ended if kind == END else {})[rid] = time.perf_counter()
        return super().feed(header, payload)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny", choices=["tiny", "bench"])
    ap.add_argument("--lengths", default="512,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    cfg = getattr(v41graph.V41Config, args.config)()
    with default_dtype(compute_dtype(cfg)):
        model = init_random_(V41Model(cfg), seed=0).eval()
    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths)
    rows = []
    if rank == 0:
        sender = Sender(dst=1)
        for n in lengths:
            prompt = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            rec = {"n": n, "full_prefill_s": [], "replay_prefill_s": [], "encode_alone_s": [],
                   "encode_with_sends_s": [], "wait_s": []}
            worker = PrefillWorker(model, 1, max_len, args.block_size)
            for r in range(args.repeats):
                for mode in ("full", "replay"):
                    s = v41graph.Session(model, 1, max_len, block_size=args.block_size)
                    rec[f"{mode}_prefill_s"].append(timed(lambda: s.prefill([prompt], mode=mode))[0])
                rec["encode_alone_s"].append(timed(lambda: worker.prefill([prompt], [0]))[0])
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
        rx = TimedReceiver(cfg, model.compute_dtype, d.fingerprint)
        per_n: dict = {}
        for rid, h in receive(rx, src=0):
            admit_s, _ = timed(lambda: d.admit(0, h))
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


if __name__ == "__main__":
    main()
