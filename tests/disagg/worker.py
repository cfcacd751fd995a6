"""One side of the two-process hand-over check, started by tests/test_disagg.py through
torch.distributed.run (gloo, CPU). Rank 0 is the prefill worker (role "prefill"), rank 1 the
decode worker (role "decode"). P sends, one request at a time, layer by layer as its encoder
runs: good requests, one with another checkpoint's fingerprint, one that loses a part, a part
of an unknown request id; D admits what arrives, compares the first token's logits and 16
greedy decode steps with a Session replay prefill of the whole model (same checkpoint), and
writes what happened to {--out}.rank{r}.json."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time

os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import v41graph  # noqa: E402
from v41graph.disagg.handover import HandoverError  # noqa: E402
from v41graph.disagg.transfer import Receiver, Sender, receive, send_prefill  # noqa: E402
from v41graph.disagg.workers import DecodeWorker, PrefillWorker  # noqa: E402

STEPS = 16
# request id -> (prompt length, what P does to it)
REQUESTS = {1: (5, None), 2: (30, None), 3: (12, "other checkpoint"), 4: (20, "lose part 2"),
            5: (31, None), 6: (8, None)}       # then request 7, which P leaves unfinished


def prompt(rid: int) -> list:
    return torch.randint(0, 256, (REQUESTS[rid][0],), generator=torch.Generator().manual_seed(rid)).tolist()


def run_prefill(ckpt: str) -> dict:
    worker = PrefillWorker(v41graph.from_pretrained(ckpt, role="prefill", progress=False), 1, 96, block_size=16)
    sender = Sender(dst=1)
    stats = {"requests": {}}
    real_part = sender.part
    for rid, (_, trouble) in REQUESTS.items():
        fingerprint = worker.fingerprint
        if trouble == "other checkpoint":      # what a P loaded from another checkpoint sends
            worker.fingerprint = fingerprint[:8] + bytes(8) + fingerprint[16:]
        sender.part = (lambda r, i, data: None if (r, i) == (4, 2) else real_part(r, i, data)) \
            if trouble == "lose part 2" else real_part
        stats["requests"][rid] = send_prefill(worker, sender, [prompt(rid)], [rid])
        worker.fingerprint = fingerprint
        if rid == 4:
            sender.part(99, 0, torch.zeros(16, dtype=torch.uint8))     # a request D never saw begin
    # the encoder alone (no sends) for the overlap figure
    t0 = time.perf_counter()
    worker.prefill([prompt(2)], [0])
    stats["encode_alone_s"] = time.perf_counter() - t0
    # request 7 begins, two of its parts go out, then P is gone (no STOP): D must report 7 as
    # truncated when its receive fails, and finish the rest
    sender.part = real_part
    ids = torch.arange(3, 23).tolist()
    [h] = worker.prefill([ids], [7])
    sender.begin(7, ids, worker.fingerprint, len(h.parts))
    for i, data in enumerate(list(h.parts.values())[:2]):
        sender.part(7, i, data)
    sender.wait()
    stats["bytes"] = sender.bytes
    stats["part_bytes"] = sum(sum(r["part_bytes"].values()) for r in stats["requests"].values())
    return stats


def run_decode(ckpt: str) -> dict:
    d = DecodeWorker(v41graph.from_pretrained(ckpt, role="decode", progress=False), 1, 96, block_size=32)
    whole = v41graph.from_pretrained(ckpt, progress=False)
    rx = Receiver(d.config, d.base.compute_dtype, d.fingerprint)
    results = []
    for rid, got in receive(rx, src=0):
        rec = {"request_id": rid}
        try:
            if isinstance(got, HandoverError):
                raise got
            rec["prompt_len"], rec["received_bytes"] = got.prompt_len, got.nbytes()
            logits = d.admit(0, got).unsqueeze(0)
            ref = v41graph.Session(whole, 1, 96, block_size=16)
            want = ref.prefill([got.prompt_ids], mode="replay")
            rec["first_equal"] = bool(torch.equal(logits, want))
            steps = 0
            for _ in range(STEPS):
                tok = want.argmax(-1, keepdim=True)
                logits, want = d.decode(tok), ref.decode(tok)
                steps += bool(torch.equal(logits, want))
            rec["steps_equal"], rec["ok"] = steps, True
            d.release(0)
        except HandoverError as e:
            rec["ok"], rec["error"] = False, str(e)
        results.append(rec)
    return {"requests": results, "bytes": rx.bytes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    try:
        out = run_prefill(args.ckpt) if rank == 0 else run_decode(args.ckpt)
    finally:
        dist.destroy_process_group()
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
