"""Persistent decode metadata (the seed's P5, v41graph.runtime.batch.DecodeBatch): a steady-state decode
step reads nothing from the device and builds no tensor from host data, and gives exactly the
same results as rebuilding the metadata from host lists every step (the previous path).

CPU: torch.Tensor.item / tolist / cpu / numpy / __bool__ / __int__ / __float__ / __index__ and
torch.tensor / as_tensor / from_numpy are patched to raise inside the step's metadata build,
and a TorchDispatchMode lists every aten op that runs there. CUDA (`-m cuda`): the whole model
call of a steady-state step runs under torch.cuda.set_sync_debug_mode("error").
"""
from __future__ import annotations

import collections
import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import v41graph
from v41graph.runtime.batch import DecodeBatch
from v41graph.model.metadata import build_metadata, concat_metadata, positions_of
from v41graph.compiler.compiled_model import DecodeGraph
from v41graph.runtime.engine import Engine
from v41graph.runtime.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCK = 16
MAX_SEQ = 96

HOST_READS = [(torch.Tensor, n) for n in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__",
                                          "__float__", "__index__")]
HOST_TENSORS = [(torch, n) for n in ("tensor", "as_tensor", "from_numpy")]


@contextlib.contextmanager
def forbid(pairs, counts=None):
    """Patch these functions to raise (counts=None) or to count their calls (into counts)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in pairs]

    def make(name, fn):
        def guarded(*a, **k):
            if counts is None:
                raise AssertionError(f"{name} called inside a steady-state decode step")
            counts[name] += 1
            return fn(*a, **k)
        return guarded
    for owner, name, fn in saved:
        setattr(owner, name, make(name, fn))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _engine(model, **kw):
    kw.setdefault("max_num_batched_tokens", 24)
    kw.setdefault("prefill_chunk_size", 16)
    return Engine(model, kw.pop("max_batch_size", 4), MAX_SEQ, block_size=BLOCK, **kw)


def _to_steady_state(eng, prompts, max_tokens=40):
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=max_tokens))
    while eng.waiting or any(not r.output for r in eng.running):
        eng.step()
    eng.step()     # the decoding set's rows are in place now


# =============================================================================== CPU: no host reads
def test_steady_state_decode_metadata_reads_nothing_and_builds_nothing(tiny_model):
    eng = _engine(tiny_model)
    _to_steady_state(eng, _prompts([5, 13, 40]))
    log = {"build": OpLog(), "advance": OpLog()}
    build, advance = eng.decode_metadata, eng.decode_batch.advance

    def guarded_build():
        with forbid(HOST_READS + HOST_TENSORS), log["build"]:
            return build()

    def guarded_advance():
        with forbid(HOST_READS + HOST_TENSORS), log["advance"]:
            return advance()
    eng.decode_metadata, eng.decode_batch.advance = guarded_build, guarded_advance
    forward_counts = collections.Counter()
    fwd = eng._forward

    def counted_forward(batch):   # the whole model call: counted (the model's own ops included)
        with forbid(HOST_READS[:3] + HOST_TENSORS, forward_counts), OpLog() as ops:
            out = fwd(batch)
        forward_counts.update({k: v for k, v in ops.ops.items() if k in ("_local_scalar_dense", "lift_fresh", "nonzero")})
        return out
    eng._forward = counted_forward
    keys = list(eng.decode_batch.keys)
    for _ in range(5):
        assert len(eng.step()) == 3
    assert eng.decode_batch.keys == keys and eng.stats["steps"] > 5
    # metadata: cached views, nothing dispatched; advance: one in-place add on the device
    assert sum(log["build"].ops.values()) == 0, log["build"].ops
    assert dict(log["advance"].ops) == {"add_": 5}, log["advance"].ops
    # the whole step's model call: no .item() / .tolist() / .cpu(), no tensor from host data,
    # no data-dependent op
    assert not forward_counts, forward_counts


def test_insert_remove_are_row_updates_not_rebuilds(tiny_model):
    """A request joining or leaving the decode set touches only the rows, with the others'
    device state carried over (no host copy of the lengths)."""
    dec = DecodeBatch(4, 3)
    dec.insert(0, "a", 2, 10, [5])
    dec.insert(1, "c", 0, 3, [1, 2])
    dec.advance()
    dec.insert(1, "b", 1, 7, [9, 8, 7])       # between a and c
    dec.advance()
    v = dec.host_view()
    assert v["keys"] == ["a", "b", "c"] and v["slot"] == [2, 1, 0]
    assert v["chunk_start"] == [12, 8, 5] and v["seq_len"] == [13, 9, 6] and v["positions"] == [12, 8, 5]
    assert v["block_table"] == [[5, -1, -1], [9, 8, 7], [1, 2, -1]]
    dec.remove(0)
    dec.set_block(1, 2, 4)
    v = dec.host_view()
    assert v["keys"] == ["b", "c"] and v["chunk_start"] == [8, 5] and v["block_table"] == [[9, 8, 7], [1, 2, 4]]
    # sync: keep b's device state, drop c, add d; a reorder rebuilds from describe()
    got = dec.sync(["d", "b"], lambda k: (3, 20, [6]))
    assert got == ["d"] and dec.host_view()["chunk_start"] == [20, 8]
    assert dec.sync(["d", "b"], None) == []          # steady state: nothing to do
    got = dec.sync(["b", "d"], lambda k: {"b": (1, 8, [9, 8, 7]), "d": (3, 20, [6])}[k])
    assert got == ["b", "d"] and dec.host_view()["chunk_start"] == [8, 20]
    pos, meta = dec.metadata()
    want = build_metadata([1, 3], [8, 20], [1, 1], [[9, 8, 7], [6]], 3)
    for f in ("token_seq", "seq_slot", "chunk_start", "seq_len", "query_start", "block_table", "logits_index"):
        assert torch.equal(getattr(meta, f), getattr(want, f)), f
    assert torch.equal(pos, positions_of(want))


def test_concat_metadata_equals_one_build():
    a = build_metadata([2, 0], [7, 3], [1, 1], [[4], [1, 2]], 3)
    b = build_metadata([1, 3], [0, 16], [5, 2], [[5, 6], [7, 8, 9]], 3)
    want = build_metadata([2, 0, 1, 3], [7, 3, 0, 16], [1, 1, 5, 2], [[4], [1, 2], [5, 6], [7, 8, 9]], 3)
    got = concat_metadata(a, b)
    for f in ("token_seq", "seq_slot", "chunk_start", "seq_len", "query_start", "block_table", "logits_index"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f


# =============================================================================== same results
def _run_logged(eng, prompts, params, abort_at=None):
    """Drive the engine step by step; log every step's logits and events."""
    logged = []
    fwd = eng._forward

    def logging_forward(batch):
        out = fwd(batch)
        logged.append(out.clone())
        return out
    eng._forward = logging_forward
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    events, steps = [], 0
    while eng.has_unfinished():
        events.append(eng.step())
        steps += 1
        if steps == abort_at:
            eng.abort(rids[1])
        if eng.decode_batch is not None:   # persistent rows == the host's view of the decodes
            v = eng.decode_batch.host_view()
            reqs = [eng.requests[k] for k in v["keys"]]
            assert all(r.status == "running" or r.status == "finished" for r in reqs)
            live = [i for i, r in enumerate(reqs) if r.status == "running"]
            assert [v["slot"][i] for i in live] == [reqs[i].slot for i in live]
            assert [v["chunk_start"][i] for i in live] == [reqs[i].num_cached for i in live]
            assert [v["block_table"][i][:len(reqs[i].blocks)] for i in live] == [reqs[i].blocks for i in live]
    return logged, events, [eng.output(r) for r in rids]


def test_persistent_metadata_equals_rebuilt_path(tiny_model):
    """Continuous batching (5 requests, 3 slots), chunked prefill mixed with decodes, stop ids,
    sampling and an abort: the persistent path's logits equal the rebuilt path's bit for bit."""
    prompts = _prompts([5, 13, 40, 3, 21], seed=1)
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=20),
              SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=4),
              SamplingParams(max_tokens=15, stop_ids=(45,)), SamplingParams(max_tokens=11)]
    runs = [_run_logged(_engine(tiny_model, max_batch_size=3, persistent_metadata=p), prompts, params,
                        abort_at=14) for p in (True, False)]
    (la, ea, oa), (lb, eb, ob) = runs
    assert len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))
    assert ea == eb
    assert [(o.token_ids, o.finish_reason) for o in oa] == [(o.token_ids, o.finish_reason) for o in ob]
    assert any(o.finish_reason == "abort" for o in oa)


def test_session_persistent_decode_equals_rebuilt(tiny_model):
    """Session decodes across block boundaries (new blocks appended in place), a re-prefill,
    a release and one-token extends in another order."""
    prompts = _prompts([14, 6], seed=9)
    outs = []
    for persistent in (True, False):
        s = v41graph.Session(tiny_model, 2, 64, block_size=8, persistent_metadata=persistent)
        seq = [s.prefill(prompts)]
        for _ in range(12):                              # crosses the 8-token blocks
            seq.append(s.decode(seq[-1].argmax(-1, keepdim=True)))
        seq.append(s.extend([1, 0], [[3], [4]]))         # reordered one-token steps
        seq.append(s.extend([0], [[5]]))
        s.release(1)
        seq.append(s.decode([[6]]))
        seq.append(s.prefill([prompts[1], prompts[0]]))   # restart both
        seq.append(s.decode([[7], [8]]))
        outs.append(seq)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# =============================================================================== compiled decode graphs
def test_decode_graph_skips_reloading_unchanged_block_tables():
    """DecodeGraph (compiler.py) copies slots and block tables only when the DecodeBatch's
    static_key (or the row count) changed; positions / lengths every step."""
    seen = []
    def step(ids, pos, caches, meta):
        seen.append((meta.block_table.clone(), meta.seq_len.clone()))
        return torch.zeros(4, 2)
    stub = SimpleNamespace(device=torch.device("cpu"), platform="cpu", _fn=step, _shared_decode_fn=step,
                           share_decode_graph=True, timings=collections.defaultdict(float),
                           _graph_ready_at=0.0, _traces=lambda name: contextlib.nullcontext())
    graph = DecodeGraph(stub, 4, SimpleNamespace(num_slots=5, scratch_slot=4), 3)
    dec = DecodeBatch(4, 3)
    dec.insert(0, 0, 0, 5, [1])
    dec.insert(1, 1, 1, 9, [2, 3])

    def run():
        pos, meta = dec.metadata()
        graph.run(dec.load_ids([11, 12]), pos, meta)
        dec.advance()
    run()
    assert seen[-1][0][:2].tolist() == [[1, -1, -1], [2, 3, -1]] and seen[-1][1].tolist() == [6, 10, 1, 1]
    graph.meta.block_table[0, 2] = 99                    # unchanged key: not reloaded
    run()
    assert seen[-1][0][0].tolist() == [1, -1, 99] and seen[-1][1].tolist() == [7, 11, 1, 1]
    dec.set_block(0, 1, 4)                               # new key: reloaded
    run()
    assert seen[-1][0][:2].tolist() == [[1, 4, -1], [2, 3, -1]]
    graph.meta.block_table[0, 2] = 99                    # plain metadata (no key): always loaded
    meta = build_metadata([0], [3], [1], [[7]], 3)
    graph.run(torch.tensor([1]), positions_of(meta), meta)
    assert seen[-1][0].tolist() == [[7, -1, -1]] + [[-1] * 3] * 3


# =============================================================================== CUDA: no syncs
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "captured"])
def test_cuda_steady_state_step_never_syncs(compiled):
    """Steady-state decode steps under torch.cuda.set_sync_debug_mode("error"): with a captured
    decode graph the whole model call (metadata, ids upload, graph replay, advance); with the
    eager model the metadata, the ids upload and the advance."""
    from v41graph.model.model import V41Model, init_random_
    model = init_random_(V41Model(v41graph.V41Config.tiny()), seed=4).cuda().eval().requires_grad_(False)
    runner = v41graph.compile(model, backend="cuda", batch_sizes=(1, 2, 4)) if compiled else model
    eng = _engine(runner)
    _to_steady_state(eng, _prompts([5, 13, 40]))
    eng.step()                       # the 3-row bucket's graph is captured by now
    torch.cuda.synchronize()
    dec = eng.decode_batch
    guarded = []

    def no_sync(fn):
        def run(*a, **k):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                guarded.append(fn.__name__)
        return run
    if compiled:
        eng._forward = no_sync(eng._forward)
    else:
        eng.decode_metadata = no_sync(eng.decode_metadata)
        dec.load_ids = no_sync(dec.load_ids)
        dec.advance = no_sync(dec.advance)
    keys = list(dec.keys)
    for _ in range(5):
        assert len(eng.step()) == 3
    assert dec.keys == keys and len(guarded) >= 5
    # and the tokens are the rebuilt path's
    ref = _engine(runner, persistent_metadata=False)
    outs = ref.generate(_prompts([5, 13, 40]), SamplingParams(max_tokens=40))
    for rid, o in enumerate(outs):
        got = eng.requests[rid].output
        assert o.token_ids[:len(got)] == got
