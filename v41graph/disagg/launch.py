"""Launcher of a disaggregated run: rank 0 is the prefill worker, rank 1 the decode worker.

    python -m torch.distributed.run --nproc-per-node 2 -m v41graph.disagg.launch CKPT \\
        --prompt "Hello" --prompt "A longer prompt ..." --max-tokens 32

Rank 0 loads the checkpoint's prefill role, encodes the prompts one request at a time and sends
each request's hand-over layer by layer; rank 1 loads the decode role and runs a DecodeEngine:
a thread receives hand-overs, the main loop admits each as it arrives and steps the engine, and
prints one JSON line per finished request (request id, text, token ids, finish reason, or the
error of a hand-over that could not be admitted). Both ranks print their byte counts and
timings as a last JSON line ({"rank": r, ...}). gloo only: the message headers are host tensors
and the parts go through host memory (Sender's payload_device), which NCCL would not take; one
GPU cannot hold two NCCL ranks anyway (scripts/bench_disagg.py measures P and D on one GPU in
one process instead). This is the launcher of a disaggregated run: `v41graph serve --role
prefill|decode` points here (the HTTP server runs one process with the whole model).
"""
from __future__ import annotations

import argparse
import datetime
import json
import queue
import sys
import threading
import time

import torch.distributed as dist

from .handover import HandoverError

_DONE = object()


def run_prefill(worker, sender, prompts: list) -> dict:
    """P: every prompt (token ids) as request i, then STOP. Returns the byte counts / times."""
    from .transfer import send_prefill
    times = [send_prefill(worker, sender, [p], [i]) for i, p in enumerate(prompts)]
    sender.stop()
    sender.wait()
    return {"bytes": sender.bytes, "encode_s": sum(t["encode_s"] for t in times),
            "wait_s": sum(t["wait_s"] for t in times)}


def run_decode(engine, arrivals, params, emit) -> dict:
    """D: `arrivals` yields (request id, Handover | HandoverError) as they complete (receive());
    a thread drains it into a queue so the engine steps while transfers are in flight. emit(record)
    gets one dict per finished or failed request."""
    inbox: queue.Queue = queue.Queue()

    def pump():
        try:
            for item in arrivals:
                inbox.put(item)
        finally:
            inbox.put(_DONE)

    threading.Thread(target=pump, daemon=True, name="handover-receiver").start()
    ours, done, failed = {}, False, 0
    while not done or engine.has_unfinished():
        block = not engine.has_unfinished() and not done
        try:
            while True:
                item = inbox.get(block=block, timeout=None if block else 0)
                block = False
                if item is _DONE:
                    done = True
                    break
                rid, got = item
                try:
                    if isinstance(got, HandoverError):
                        raise got
                    ours[engine.add_handover(got, params)] = rid
                except (HandoverError, ValueError) as e:     # RequestError is a ValueError
                    failed += 1
                    emit({"request_id": rid, "error": str(e)})
        except queue.Empty:
            pass
        for eid, _, finished in engine.step():
            if finished and eid in ours:
                out = engine.release(eid)
                emit({"request_id": ours.pop(eid), "text": out.text, "token_ids": out.token_ids,
                      "finish_reason": out.finish_reason})
    return {"failed": failed, "stats": dict(engine.stats)}


def main(argv=None) -> None:
    import v41graph
    from .engine import DecodeEngine
    from .transfer import Receiver, Sender, receive
    from .workers import PrefillWorker

    ap = argparse.ArgumentParser(prog="python -m v41graph.disagg.launch", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt", action="append", default=[], help="a text prompt (repeat for more)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-batch-size", type=int, default=4)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--backend", default="gloo", choices=["gloo"],
                    help="torch.distributed backend: gloo (the one the transfer is built for)")
    ap.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    args = ap.parse_args(argv)
    if not args.prompt:
        ap.error("give at least one --prompt")
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit(f"v41graph.disagg.launch runs 2 processes (prefill, decode), got {dist.get_world_size()}")
    t0 = time.perf_counter()
    try:
        if rank == 0:
            from v41graph.runtime.text import Tokenizer
            tok = Tokenizer.from_pretrained(args.checkpoint)
            model = v41graph.from_pretrained(args.checkpoint, role="prefill", progress=False)
            worker = PrefillWorker(model, 1, args.max_seq_len, args.block_size)
            info = run_prefill(worker, Sender(dst=1), [tok.encode(p) for p in args.prompt])
        else:
            model = v41graph.from_pretrained(args.checkpoint, role="decode", progress=False)
            engine = DecodeEngine(model, args.max_batch_size, args.max_seq_len, args.block_size)
            rx = Receiver(model.config, model.compute_dtype, engine.fingerprint)
            params = v41graph.SamplingParams(max_tokens=args.max_tokens)
            info = run_decode(engine, receive(rx, src=0), params,
                              lambda rec: print(json.dumps(rec), flush=True))
            info["bytes"] = rx.bytes
    finally:
        dist.destroy_process_group()
    print(json.dumps({"rank": rank, "seconds": round(time.perf_counter() - t0, 3), **info}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
