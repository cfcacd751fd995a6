"""Hand-overs over torch.distributed point-to-point (gloo between CPU processes, NCCL between
GPUs): P sends each part as its encoder layer finishes (`isend`, so the send of layer i runs
while layer i+1 computes), D receives them in order and assembles Handovers.

Messages, P -> D, in order on one (src, dst) pair: an int64 header [MAGIC, kind, request id,
a, b, c, d, e, payload bytes], then the payload (uint8) when it has one:

  BEGIN  a = prompt length, b = number of parts, c, d, e = P's fingerprint (config, weights,
         numerics); payload: prompt ids
  PART   a = part index (layout order); payload: the part's bytes
  END    a = the request's part bytes in all
  STOP   P sends nothing more

`Receiver` is the state machine (no I/O: `feed(header, payload)`), so every way a transfer can
go wrong is tested in one process; `receive` drives it from `dist.recv`. A request that cannot
be admitted (an unknown request id, parts missing when the next request begins or at STOP,
another model's fingerprint, a part count or size D's layout does not have) comes out as a
HandoverError for that request alone; the stream stays in step (every payload is read whatever
happens to its request), so the next request is received as if nothing happened.
"""
from __future__ import annotations

import collections
import time

import torch
import torch.distributed as dist

from .handover import Handover, HandoverError, check_fingerprint, layout
from .roles import FINGERPRINT_BYTES

MAGIC = 0x50374B56          # "P7KV"
BEGIN, PART, END, STOP = 1, 2, 3, 4
HEADER_LEN = 9
HEADER_BYTES = HEADER_LEN * 8
_FP_WORDS = FINGERPRINT_BYTES // 8


def _fingerprint_words(fp: bytes) -> tuple:
    if len(fp) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fp)}")
    return tuple(int.from_bytes(fp[8 * i:8 * i + 8], "little", signed=True) for i in range(_FP_WORDS))


def _fingerprint_bytes(*words: int) -> bytes:
    return b"".join(w.to_bytes(8, "little", signed=True) for w in words)


class Sender:
    """P's side: every message an `isend` to `dst`; the tensors are kept until `wait()`."""

    def __init__(self, dst: int, group=None, isend=None, payload_device="cpu"):
        """isend: the transport (default torch.distributed.isend; tests pass a recorder,
        LocalTransport its stream copy). payload_device: where the transport needs payloads
        ("cpu", the default, for gloo: parts packed on a GPU are copied to the host here;
        None: where they were packed, for LocalTransport)."""
        self.dst, self.group = dst, group
        self._isend = isend if isend is not None else dist.isend
        self.payload_device = payload_device
        self._works, self._keep = [], []
        self.bytes = {"header": 0, "prompt": 0, "parts": 0}
        self.wait_s = 0.0

    def _send(self, kind: int, request_id: int, a=0, b=0, c=0, d=0, e=0, payload: torch.Tensor | None = None,
              what: str = "parts") -> None:
        n = 0 if payload is None else int(payload.numel())
        header = torch.tensor([MAGIC, kind, request_id, a, b, c, d, e, n], dtype=torch.int64)
        if payload is not None:
            payload = payload.contiguous()
            if self.payload_device is not None:
                payload = payload.to(self.payload_device)
        tensors = [header] if payload is None else [header, payload]
        for t in tensors:
            self._works.append(self._isend(t, self.dst, group=self.group))
            self._keep.append(t)
        self.bytes["header"] += HEADER_BYTES
        self.bytes[what] += n

    def begin(self, request_id: int, prompt_ids: list, fingerprint: bytes, n_parts: int) -> None:
        ids = torch.tensor(prompt_ids, dtype=torch.int64).view(torch.uint8)
        self._send(BEGIN, request_id, len(prompt_ids), n_parts, *_fingerprint_words(fingerprint),
                   payload=ids, what="prompt")

    def part(self, request_id: int, index: int, data: torch.Tensor) -> None:
        self._send(PART, request_id, index, payload=data)

    def end(self, request_id: int, total: int) -> None:
        self._send(END, request_id, total)

    def stop(self) -> None:
        self._send(STOP, -1)

    def wait(self) -> None:
        """Wait for every send issued so far (the time spent here is what the sends did not
        overlap with compute)."""
        t0 = time.perf_counter()
        for w in self._works:
            w.wait()
        self._works.clear()
        self._keep.clear()
        self.wait_s += time.perf_counter() - t0


def send_prefill(worker, sender: Sender, prompts, request_ids) -> dict:
    """P's step: BEGIN every request, encode them (each part sent the moment it is final), END
    them. Returns timings: encode_s (the encoder with the sends issued in between) and
    wait_s (waiting for the sends after it)."""
    dtype = worker.base.compute_dtype
    counts = {}
    for rid, p in zip(request_ids, prompts):
        n_parts = len(layout(worker.config, len(p), dtype))
        sender.begin(rid, list(p), worker.fingerprint, n_parts)
        counts[rid] = 0
    index = {}

    def on_part(rid, name, data):
        i = index.get(rid, 0)
        sender.part(rid, i, data)
        index[rid] = i + 1
        counts[rid] += int(data.numel())

    t0 = time.perf_counter()
    worker.prefill(prompts, request_ids, on_part=on_part)
    encode_s = time.perf_counter() - t0
    for rid in request_ids:
        sender.end(rid, counts[rid])
    w0 = sender.wait_s
    sender.wait()
    return {"encode_s": encode_s, "wait_s": sender.wait_s - w0, "part_bytes": dict(counts)}


class Receiver:
    """D's side: assembles messages into Handovers (checked against D's layout as they come).
    feed() returns the requests it completed: [(request_id, Handover | HandoverError)]."""

    def __init__(self, config, dtype: torch.dtype, fingerprint: bytes):
        self.config, self.dtype, self.fingerprint = config, dtype, fingerprint
        self.open: dict = {}           # request id -> (Handover, part names, bytes so far)
        self.draining: set = set()     # request ids already failed whose messages are skipped
        self.stopped = False
        self.bytes = {"header": 0, "prompt": 0, "parts": 0}

    def _fail_open(self, why: str) -> list:
        out = []
        for rid, (h, names, _) in self.open.items():
            out.append((rid, HandoverError(f"request {rid}: truncated transfer, {len(h.parts)} of "
                                           f"{len(names)} parts arrived before {why}")))
            self.draining.add(rid)
        self.open.clear()
        return out

    def feed(self, header, payload: torch.Tensor | None) -> list:
        if len(header) != HEADER_LEN or header[0] != MAGIC:
            raise HandoverError(f"not a hand-over message header: {list(header)[:HEADER_LEN]}")
        kind, rid, a, b, c, d, e, n = header[1:]
        self.bytes["header"] += HEADER_BYTES
        # what arrived, not what the header claims (a short payload then shows as a difference)
        arrived = 0 if payload is None else payload.numel() * payload.element_size()
        self.bytes["prompt" if kind == BEGIN else "parts"] += arrived
        if kind == STOP:
            self.stopped = True
            return self._fail_open("P stopped")
        if kind == BEGIN:
            out = self._fail_open(f"request {rid} began")      # one request in flight at a time
            fp = _fingerprint_bytes(c, d, e)
            if rid in self.draining:
                self.draining.discard(rid)
            try:
                if n != 8 * a or (a and payload is None):
                    raise HandoverError(f"request {rid}: BEGIN says {a} prompt tokens but carries {n} bytes of ids")
                h = Handover(rid, payload.view(torch.int64).tolist() if n else [], fp)
                check_fingerprint(self.fingerprint, fp, f"request {rid}")
                names = [p.name for p in layout(self.config, a, self.dtype)]
                if b != len(names):
                    raise HandoverError(f"request {rid}: P sends {b} parts, this worker's layout has "
                                        f"{len(names)} (P and D disagree on the layer plan)")
            except HandoverError as e:
                self.draining.add(rid)
                return out + [(rid, e)]
            self.open[rid] = (h, names, 0)
            return out
        if rid in self.draining:
            if kind == END:
                self.draining.discard(rid)
            return []
        if rid not in self.open:
            if kind == PART:        # skip the rest of this unknown request's messages
                self.draining.add(rid)
            return [(rid, HandoverError(f"request {rid}: {'part' if kind == PART else 'end'} of an unknown "
                                        "request id (no BEGIN for it on this worker)"))]
        h, names, total = self.open[rid]
        if kind == PART:
            if not 0 <= a < len(names):
                del self.open[rid]
                self.draining.add(rid)
                return [(rid, HandoverError(f"request {rid}: part index {a} outside 0..{len(names) - 1}"))]
            h.parts[names[a]] = payload if payload is not None else torch.empty(0, dtype=torch.uint8)
            self.open[rid] = (h, names, total + n)
            return []
        if kind == END:
            del self.open[rid]
            if a != total:
                return [(rid, HandoverError(f"request {rid}: P sent {a} part bytes, {total} arrived"))]
            return [(rid, h)]   # a missing part is DecodeWorker.admit's (handover.check) error
        raise HandoverError(f"request {rid}: unknown message kind {kind}")


class _Done:
    def wait(self) -> None:
        pass


class _CopyDone:
    def __init__(self, event):
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()


class LocalTransport:
    """P and D in one process (one GPU): what a Sender would give torch.distributed is copied
    on a transfer stream into a buffer D owns (device payloads; headers and prompt ids are host
    tensors and are cloned), and D takes the messages in order (`recv_message`, `deliver`),
    each after its copy is done. The same Sender / Receiver protocol, parts and bytes as between
    processes, with the GPU's copy engine standing in for the link. NCCL refuses two ranks on
    one GPU and two processes would each need the weights, so this is how one GPU measures
    the hand-over overlapped with the encoder. On the CPU a plain copy.

        t = LocalTransport()
        sender = Sender(dst=1, isend=t.isend, payload_device=None)
        send_prefill(worker, sender, prompts, ids)        # P
        done = t.deliver(receiver)                        # D: [(request id, Handover | error)]
    """

    def __init__(self):
        self.queue: collections.deque = collections.deque()
        self.streams: dict = {}
        self.copies: list = []        # (bytes, start event, end event) of every device copy

    def isend(self, t: torch.Tensor, dst: int, group=None):
        if t.device.type != "cuda":
            self.queue.append((t.clone(), None))
            return _Done()
        side = self.streams.get(t.device)
        if side is None:
            side = self.streams[t.device] = torch.cuda.Stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))     # the part is packed
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record(side)
            out = t.clone()           # allocated on and copied by the transfer stream
            end.record(side)
        t.record_stream(side)         # P's tensor is read there: not reused before the copy ends
        self.copies.append((t.numel() * t.element_size(), start, end))
        self.queue.append((out, end))
        return _CopyDone(end)

    def _pop(self) -> torch.Tensor:
        if not self.queue:
            raise RuntimeError("LocalTransport: no message waiting (the sender sent nothing more)")
        t, done = self.queue.popleft()
        if done is not None:           # D's stream waits for the copy, and owns the buffer
            stream = torch.cuda.current_stream(t.device)
            stream.wait_event(done)
            t.record_stream(stream)
        return t

    def recv_message(self, src: int = 0, group=None):
        """The next (header as a list, payload or None), as receive() reads them."""
        h = self._pop().tolist()
        payload = self._pop() if h[0] == MAGIC and h[-1] > 0 else None
        return h, payload

    def deliver(self, receiver: Receiver) -> list:
        """Feed every message sent so far to `receiver`; the requests it completed."""
        out = []
        while self.queue:
            out += receiver.feed(*self.recv_message())
        return out


def receive(receiver: Receiver, src: int, group=None):
    """Yield (request_id, Handover | HandoverError) as they complete, until P's STOP. If the
    transport fails (P gone: gloo raises when its connection closes, or at the group's timeout)
    the requests in flight come out as HandoverErrors and the iteration ends: what D already
    admitted runs on."""
    while not receiver.stopped:
        try:
            header = torch.empty(HEADER_LEN, dtype=torch.int64)
            dist.recv(header, src, group=group)
            h = header.tolist()
            payload = None
            if h[0] == MAGIC and h[-1] > 0:
                payload = torch.empty(h[-1], dtype=torch.uint8)
                dist.recv(payload, src, group=group)
        except RuntimeError as e:          # torch.distributed's errors are RuntimeErrors
            receiver.stopped = True
            yield from receiver._fail_open(f"the transport from rank {src} failed ({type(e).__name__}: "
                                           f"{str(e).splitlines()[0] if str(e) else ''})")
            return
        yield from receiver.feed(h, payload)
