"""Prefill/decode disaggregation (v41graph.disagg): role-restricted loading and its bytes against
accounting, the hand-over (P's encoder half -> bytes -> D's caches + decoder replay) bit for bit
against one process's Session.prefill(mode="replay") and 16 greedy decode steps, its byte
counts against the accounting formula, bad hand-overs, and the same over gloo between two
processes (tests/disagg/worker.py)."""
from __future__ import annotations

import json
import math
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import v41graph
from processes import free_port
from script_loader import load_script
from v41graph.disagg.handover import Handover, HandoverError, layout
from v41graph.disagg.roles import role_holds, role_weight_bytes
from v41graph.disagg.transfer import Receiver, Sender, send_prefill
from v41graph.disagg.workers import DecodeWorker, PrefillWorker
from v41graph.model.model import V41Model, init_random_
from v41graph.weights.accounting import accounting, checkpoint_shapes, module_params
from v41graph.weights.random_checkpoint import write_random_checkpoint

WORKER = Path(__file__).parent / "disagg" / "worker.py"
STEPS = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("disagg_ckpt")
    write_random_checkpoint(v41graph.V41Config.tiny(), out, seed=0, progress=False)
    return out


@pytest.fixture(scope="module")
def models(ckpt):
    load = lambda role: v41graph.from_pretrained(ckpt, role=role, progress=False)   # noqa: E731
    return {"both": load("both"), "prefill": load("prefill"), "decode": load("decode")}


def test_a_prefill_role_model_is_refused_where_decoding_starts(models):
    """The encoder half cannot decode: every front end that runs decoder steps says so when it
    is built (not with a meta-device error at the first step); P's own worker accepts it."""
    for front in (v41graph.Session, DecodeWorker, v41graph.Engine):
        with pytest.raises(ValueError, match=r"loaded with role='prefill'.*role='decode'"):
            front(models["prefill"], 1, 32)
    PrefillWorker(models["prefill"], 1, 32)


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ----------------------------------------------------------------------------- roles
def test_prefill_role_reads_only_its_tensors(models):
    cfg = models["both"].config
    p, d = models["prefill"], models["decode"]
    dec = p.decoder_start
    params = dict(p.named_parameters())
    loaded = {n for n, t in params.items() if not t.is_meta}
    # the encoder, its Engram, the embedding and the decoder start's KV build; nothing else
    assert all(not params[n].is_meta for n in params if n.startswith(("layers.0.", f"layers.{dec - 1}.", "engram.")))
    assert {n for n in loaded if n.startswith(f"layers.{dec}.")} == {
        f"layers.{dec}.attn_norm.weight", f"layers.{dec}.attn.compressor.wkv.weight",
        f"layers.{dec}.attn.compressor.norm.weight", f"layers.{dec}.attn.indexer.wk.weight",
        f"layers.{dec}.attn.indexer.k_norm.weight"}
    assert not any(n.startswith(f"layers.{dec + 1}.") for n in loaded)
    assert params["head"].is_meta and params["norm.weight"].is_meta and "embed.weight" in loaded
    assert p.role == "prefill" and d.role == "decode"
    # bytes read = the layout's bytes of the role's tensors (DSpark is load_dspark's)
    assert p.loaded_bytes == role_weight_bytes(cfg, "prefill", include_mtp=False)["role_bytes"]
    assert d.loaded_bytes == models["both"].loaded_bytes == role_weight_bytes(cfg, "both", include_mtp=False)["role_bytes"]
    # tiny: 6 encoder layers of 10, DSpark a fifth of the bytes: P reads 53.2 % of everything
    assert round(role_weight_bytes(cfg, "prefill")["fraction"], 3) == 0.532
    assert not any(t.is_meta for t in d.parameters())
    with pytest.raises(ValueError, match="role must be one of"):
        v41graph.from_pretrained(models["both"].checkpoint_dir, role="encoder", progress=False)


@pytest.mark.parametrize("config", ["tiny", "full"])
def test_role_params_against_accounting(config):
    """P's parameters (checkpoint shapes filtered by role) = accounting's module formulas for
    the embedding, the encoder layers, Engram and the decoder start's KV build; D's = the
    whole model's (backbone + Engram + DSpark)."""
    cfg = getattr(v41graph.V41Config, config)()
    acc, m = accounting(cfg), module_params(cfg)
    shapes = dict(checkpoint_shapes(cfg))
    count = lambda role: sum(math.prod(s) for n, s in shapes.items() if role_holds(n, role, cfg))  # noqa: E731
    assert count("decode") == acc.backbone_params + acc.engram_params + acc.dspark_params
    plan, dec = v41graph.build_layer_plan(cfg), cfg.candidate_source_layer_id
    enc = 0
    for r in plan[:dec]:
        enc += m["block_dense"] + (cfg.n_routed_experts + cfg.n_shared_experts) * m["expert"]
        if r.mode == "full":
            enc += m["compressor_gated" if r.ratio > 1 else "compressor_r1"] + m["indexer_query"] + m["indexer_key"]
        elif r.mode == "reindex":
            enc += m["indexer_query"]
    kv_build = cfg.hidden_size + m["compressor_r1"] + m["indexer_key"]
    assert count("prefill") == m["embed"] + enc + acc.engram_params + kv_build


def test_role_weight_bytes_released_config():
    """The released config's figures (README): P holds 68.9 % of the checkpoint's bytes (48.5 %
    without the Engram tables, which live in host memory), D all of it: a decode token runs the
    encoder too."""
    cfg = v41graph.V41Config.full()
    p, d = role_weight_bytes(cfg, "prefill"), role_weight_bytes(cfg, "decode")
    assert d["fraction"] == 1.0 and d["role_bytes"] == p["total_bytes"]
    assert round(p["fraction"], 3) == 0.689 and round(p["fraction_device"], 3) == 0.485


# ----------------------------------------------------------------------------- hand-over
def _expected_bytes(cfg, n, elsize):
    """The hand-over's byte groups from the config alone (MODEL.md §5 row sizes)."""
    plan, dec, w = v41graph.build_layer_plan(cfg), cfg.candidate_source_layer_id, cfg.sliding_window
    row = cfg.head_dim // 2 + cfg.head_dim // 16 + cfg.index_head_dim // 2 + cfg.index_head_dim // 32
    kv = sum(n // plan[i].ratio * row for i in cfg.kv_source_layer_ids)
    ring = sum(n % plan[i].ratio * 2 * cfg.head_dim * 4 for i in cfg.kv_source_layer_ids if plan[i].ratio > 1)
    window = dec * min(n, w) * (cfg.head_dim + cfg.head_dim // 32)
    history = (cfg.engram_max_ngram_size - 1) * 8
    replay = min(n, w) * cfg.hc_mult * (cfg.hidden_size * elsize + 4)
    return {"kv": kv, "ring": ring, "window": window, "history": history, "replay": replay}


def _group_bytes(cfg, h: Handover, dtype):
    out = {"kv": 0, "ring": 0, "window": 0, "history": 0, "replay": 0}
    for part in layout(cfg, h.prompt_len, dtype):
        assert h.parts[part.name].numel() == part.nbytes      # what was packed, byte for byte
        for f in part.fields:
            out[f.group] += f.nbytes
    return out


def _reference_and_disagg(models, prompts, d_block=32):
    """(Session replay over the whole model, DecodeWorker after P's hand-over) for the batch."""
    ref = v41graph.Session(models["both"], len(prompts) + 1, 96, block_size=16)
    a = ref.prefill(prompts, mode="replay")
    p = PrefillWorker(models["prefill"], len(prompts), 96, block_size=16)
    d = DecodeWorker(models["decode"], len(prompts) + 1, 96, block_size=d_block)
    hs = p.prefill(prompts, request_ids=[10 + i for i in range(len(prompts))])
    b = d.admit_batch(list(range(len(hs))), hs)
    return ref, d, a, b, hs


def _decode_both(ref, d, logits, steps=STEPS):
    """Greedy decode `steps` tokens on both from the same tokens; every step's logits equal."""
    for step in range(steps):
        tok = logits.argmax(-1, keepdim=True)
        logits = ref.decode(tok)
        assert torch.equal(logits, d.decode(tok)), f"decode step {step}"


@pytest.mark.parametrize("n", [5, 8, 30, 31])      # tiny's window is 8
def test_handover_is_bit_identical_to_a_replay_prefill(models, n):
    cfg = models["both"].config
    ref, d, a, b, [h] = _reference_and_disagg(models, [_prompt(n, n)])
    assert torch.equal(a, b)
    _decode_both(ref, d, a)
    got = _group_bytes(cfg, h, torch.float32)
    assert got == _expected_bytes(cfg, n, 4)
    assert h.nbytes() == sum(got.values())
    if n % 2 == 0:       # a multiple of every ratio: exactly accounting's bytes per token
        assert got["kv"] == accounting(cfg).global_kv_bytes_per_token * n == 70 * n
    assert got["ring"] == (512 if n % 2 else 0)      # 2 ratio-2 sources x 1 row x 64 fp32


def test_two_requests_in_one_prefill_and_one_decode_batch(models):
    ref, d, a, b, _ = _reference_and_disagg(models, [_prompt(30, 1), _prompt(5, 2)], d_block=16)
    assert torch.equal(a, b)
    _decode_both(ref, d, a)


def test_released_config_bytes_per_request():
    """4K-token prompt on the released config: 890 B/token of KV + the fixed bundle."""
    cfg = v41graph.V41Config.full()
    groups = {"ring": 0}
    for part in layout(cfg, 4096, torch.bfloat16):
        for f in part.fields:
            groups[f.group] = groups.get(f.group, 0) + f.nbytes
    assert groups["kv"] == 890 * 4096
    assert groups == {**_expected_bytes(cfg, 4096, 2), "kv": 890 * 4096}
    assert groups["window"] == 20 * 128 * 528 and groups["replay"] == 128 * 4 * (5120 * 2 + 4)


# ----------------------------------------------------------------------------- bad input
def test_bad_handovers_fail_alone(models, tmp_path):
    cfg = models["both"].config
    ref, d, a, _, _ = _reference_and_disagg(models, [_prompt(30, 3)])
    p = PrefillWorker(models["prefill"], 1, 96, block_size=16)
    [good] = p.prefill([_prompt(12, 4)], [1])
    # another checkpoint (same config, other weights)
    write_random_checkpoint(cfg, tmp_path, seed=1, progress=False)
    other = PrefillWorker(v41graph.from_pretrained(tmp_path, role="prefill", progress=False), 1, 96)
    [h] = other.prefill([_prompt(12, 4)], [2])
    with pytest.raises(HandoverError, match=r"request 2: P and D do not hold the same model \(the same config but other weights"):
        d.admit(1, h)
    # another layer plan
    plan2 = init_random_(V41Model(v41graph.V41Config.tiny(kv_source_layer_ids=[2, 6],
                                                          index_source_layer_ids=[2, 6, 8])), seed=0).eval()
    [h] = PrefillWorker(plan2, 1, 96).prefill([_prompt(12, 4)], [3])
    with pytest.raises(HandoverError, match=r"request 3: .*another config or layer plan"):
        d.admit(1, h)
    # truncated: a part missing, a part cut short
    cut = Handover(4, good.prompt_ids, good.fingerprint, {k: v for k, v in good.parts.items() if k != "layer3"})
    with pytest.raises(HandoverError, match=r"request 4: truncated transfer, parts \['layer3'\] did not arrive"):
        d.admit(1, cut)
    short = Handover(5, good.prompt_ids, good.fingerprint, {**good.parts, "replay": good.parts["replay"][:-7]})
    with pytest.raises(HandoverError, match=r"request 5 part replay: \d+ bytes, the layout needs \d+"):
        d.admit(1, short)
    # sequence 0 was untouched by all of that; a good hand-over still goes into slot 1
    assert d.seq_lens[1] == 0
    d.admit(1, good)
    d.release(1)
    _decode_both(ref, d, a)


def test_numerics_mismatch_is_refused_naming_both_sides(ckpt, models):
    """P loaded with numerics="fast", D with from_pretrained's default "reference": the
    fingerprint's third part differs, D refuses the hand-over at admit and at BEGIN (the
    receiver), naming both modes; the next request (P of D's numerics) is admitted."""
    p_ref = PrefillWorker(v41graph.from_pretrained(ckpt, role="prefill", numerics="fast", progress=False),
                          1, 96, block_size=16)
    d = DecodeWorker(models["decode"], 1, 96)
    assert models["decode"].numerics == "reference"
    assert p_ref.fingerprint[:16] == d.fingerprint[:16] and p_ref.fingerprint[16:] != d.fingerprint[16:]
    want = r"request 3: P and D do not hold the same model \(numerics: P runs 'fast', this worker 'reference'"
    [h] = p_ref.prefill([_prompt(9, 3)], [3])
    with pytest.raises(HandoverError, match=want):
        d.admit(0, h)
    sender, sent = _recorded_sender()
    send_prefill(p_ref, sender, [_prompt(9, 3)], [3])
    good = _prompt(9, 4)
    send_prefill(PrefillWorker(models["prefill"], 1, 96, block_size=16), sender, [good], [4])
    rx = Receiver(d.config, d.base.compute_dtype, d.fingerprint)
    out = [r for hdr, pl in _messages(sent) for r in rx.feed(hdr, pl)]
    assert [rid for rid, _ in out] == [3, 4]
    assert isinstance(out[0][1], HandoverError) and re.search(want, str(out[0][1]))
    ref = v41graph.Session(models["both"], 1, 96)
    assert torch.equal(ref.prefill([good], mode="replay")[0], d.admit(0, out[1][1]))


def _recorded_sender():
    sent = []

    class Done:
        def wait(self):
            pass

    def isend(t, dst, group=None):
        sent.append(t.clone())
        return Done()
    return Sender(1, isend=isend), sent


def _messages(sent):
    """The recorded tensors back into (header, payload) messages, as receive() reads them."""
    out, i = [], 0
    while i < len(sent):
        h = sent[i].tolist()
        payload = sent[i + 1] if h[-1] > 0 else None
        out.append((h, payload))
        i += 2 if h[-1] > 0 else 1
    return out


def test_receiver_unknown_ids_truncation_and_recovery(models):
    p = PrefillWorker(models["prefill"], 1, 96, block_size=16)
    d = DecodeWorker(models["decode"], 2, 96)
    sender, sent = _recorded_sender()
    prompts = {7: _prompt(30, 7), 8: _prompt(5, 8), 9: _prompt(11, 9)}
    stats = send_prefill(p, sender, [prompts[7]], [7])
    sender.part(99, 0, torch.zeros(5, dtype=torch.uint8))          # a request D never saw begin
    send_prefill(p, sender, [prompts[8]], [8])
    sender.stop()
    msgs = _messages(sent)
    # request 8 loses its part 2 on the way; request 9 follows it and is fine
    lost = next(i for i, (h, _) in enumerate(msgs) if h[1] == 2 and h[2] == 8 and h[3] == 2)
    msgs = msgs[:lost] + msgs[lost + 1:]
    tail = msgs.pop()                                            # STOP, after request 9
    s9, sent9 = _recorded_sender()
    send_prefill(p, s9, [prompts[9]], [9])
    msgs += _messages(sent9) + [tail]
    rx = Receiver(d.config, d.base.compute_dtype, d.fingerprint)
    results = [r for h, payload in msgs for r in rx.feed(h, payload)]
    assert rx.stopped and [rid for rid, _ in results] == [7, 99, 8, 9]
    out = dict(results)
    assert isinstance(out[99], HandoverError) and "unknown request id" in str(out[99])
    assert isinstance(out[8], HandoverError) and "P sent" in str(out[8])   # END's byte count
    for rid in (7, 9):
        ref = v41graph.Session(models["both"], 1, 96)
        assert torch.equal(ref.prefill([prompts[rid]], mode="replay")[0], d.admit(0, out[rid]))
    # bytes: what the sender counted = what arrived (request 8's lost part aside)
    part_bytes = sum(stats["part_bytes"].values())
    assert part_bytes == out[7].nbytes()
    # a BEGIN while a request is open: the open one is truncated, the new one goes on
    rx = Receiver(d.config, d.base.compute_dtype, d.fingerprint)
    s, sent = _recorded_sender()
    send_prefill(p, s, [prompts[8]], [8])
    m8 = _messages(sent)
    s, sent = _recorded_sender()
    send_prefill(p, s, [prompts[9]], [9])
    res = [r for h, pl in m8[:3] + _messages(sent) for r in rx.feed(h, pl)]
    assert [rid for rid, _ in res] == [8, 9]
    assert "truncated transfer, 2 of" in str(res[0][1]) and isinstance(res[1][1], Handover)


# ----------------------------------------------------------------------------- two processes
def test_two_processes_over_gloo(ckpt, tmp_path):
    """P (rank 0, role prefill) and D (rank 1, role decode) over gloo: short and long prompts
    bit-identical to a Session replay prefill + 16 greedy steps on D's side; a request of
    another checkpoint's fingerprint, one with a part lost and an unknown request id fail
    alone, the requests after them succeed; P leaving in the middle of a request (no STOP)
    fails that request on D, which then ends normally."""
    out = tmp_path / "result"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_CBWR="COMPATIBLE")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(WORKER), "--ckpt", str(ckpt), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    p = json.loads(Path(f"{out}.rank0.json").read_text())
    d = json.loads(Path(f"{out}.rank1.json").read_text())
    by = {r["request_id"]: r for r in d["requests"]}
    assert sorted(by) == [1, 2, 3, 4, 5, 6, 7, 99]
    cfg = v41graph.V41Config.tiny()
    for rid in (1, 2, 5, 6):
        assert by[rid]["ok"] and by[rid]["first_equal"] and by[rid]["steps_equal"] == STEPS, by[rid]
        assert by[rid]["received_bytes"] == sum(_expected_bytes(cfg, by[rid]["prompt_len"], 4).values())
    assert "the same config but other weights" in by[3]["error"]
    assert "request 4: P sent" in by[4]["error"]
    assert "unknown request id" in by[99]["error"]
    assert "request 7: truncated transfer, 2 of 8 parts arrived before the transport from rank 0 failed" \
        in by[7]["error"]
    assert p["bytes"] == d["bytes"]          # every message sent arrived, byte for byte


# ----------------------------------------------------------------------------- D's Engine
def test_decode_engine_admits_handovers_alongside_plain_requests(models):
    """DecodeEngine: two hand-over requests (5 and 30 tokens) and one plain prompt give the
    greedy tokens of a plain Engine over the whole model (bounded replay prefill); a bad
    hand-over is refused at add_handover and changes nothing."""
    from v41graph.disagg.engine import DecodeEngine
    from v41graph import SamplingParams
    prompts = [_prompt(5, 21), _prompt(30, 22), _prompt(19, 23)]
    params = SamplingParams(max_tokens=12)
    ref = v41graph.Engine(models["both"], 4, 96, block_size=16, prefill_mode="replay", tokenizer=False)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    p = PrefillWorker(models["prefill"], 2, 96, block_size=16)
    hs = p.prefill(prompts[:2], [0, 1])
    eng = DecodeEngine(models["decode"], 4, 96, block_size=16, tokenizer=False)
    bad = Handover(9, hs[0].prompt_ids, hs[0].fingerprint, {k: v for k, v in hs[0].parts.items() if k != "replay"})
    with pytest.raises(HandoverError, match="request 9: truncated transfer"):
        eng.add_handover(bad, params)
    assert not eng.has_unfinished()
    rids = [eng.add_handover(h, params) for h in hs] + [eng.add_request(prompts[2], params)]
    while eng.has_unfinished():
        eng.step()
    assert [eng.release(r).token_ids for r in rids] == want
    assert eng.stats["handover_admissions"] == 2 and eng.num_free_blocks == eng.num_blocks


def test_launcher_loops_in_one_process(models):
    """The launcher's two loops (v41graph.disagg.launch: run_prefill on P, run_decode on D)
    over a recorded transport: every request's greedy tokens equal a plain Engine's, a request
    whose hand-over failed on the way is reported alone."""
    from v41graph import SamplingParams
    from v41graph.disagg.engine import DecodeEngine
    from v41graph.disagg.launch import run_decode, run_prefill
    prompts = [_prompt(n, 30 + n) for n in (3, 17, 40)]
    params = SamplingParams(max_tokens=6)
    ref = v41graph.Engine(models["both"], 4, 96, block_size=16, prefill_mode="replay", tokenizer=False)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    sender, sent = _recorded_sender()
    info = run_prefill(PrefillWorker(models["prefill"], 1, 96, block_size=16), sender, prompts)
    eng = DecodeEngine(models["decode"], 2, 96, block_size=16, tokenizer=False)
    rx = Receiver(eng.config, eng.base.compute_dtype, eng.fingerprint)
    msgs = _messages(sent)
    # request 1's BEGIN carries another model's fingerprint
    i = next(k for k, (h, _) in enumerate(msgs) if h[1] == 1 and h[2] == 1)
    msgs[i] = (msgs[i][0][:5] + [0, 0] + msgs[i][0][7:], msgs[i][1])
    arrivals = (r for h, pl in msgs for r in rx.feed(h, pl))
    records = []
    run_decode(eng, arrivals, params, records.append)
    by = {r["request_id"]: r for r in records}
    assert by[0]["token_ids"] == want[0] and by[2]["token_ids"] == want[2]
    assert "another config or layer plan" in by[1]["error"]
    assert info["bytes"] == rx.bytes and eng.num_free_blocks == eng.num_blocks


def test_transport_failure_mid_request_fails_it_alone(models, monkeypatch):
    """receive() over a transport that fails in the middle of request 1 (P gone while a part's
    payload is on the way: dist.recv raises): request 1 comes out as a truncated transfer,
    request 0, admitted before, decodes to the end with a plain Engine's tokens, and D ends
    normally with every block free."""
    from v41graph import SamplingParams
    from v41graph.disagg import transfer
    from v41graph.disagg.engine import DecodeEngine
    from v41graph.disagg.launch import run_decode
    prompts = [_prompt(20, 50), _prompt(11, 51)]
    params = SamplingParams(max_tokens=8)
    ref = v41graph.Engine(models["both"], 2, 96, block_size=16, prefill_mode="replay", tokenizer=False)
    want = ref.generate(prompts[:1], params)[0].token_ids
    p = PrefillWorker(models["prefill"], 1, 96, block_size=16)
    sender, sent = _recorded_sender()
    send_prefill(p, sender, [prompts[0]], [0])
    first = len(sent)
    send_prefill(p, sender, [prompts[1]], [1])
    wire = iter(sent[:first + 5])      # request 1: BEGIN + ids, part 0, part 1's header only

    def recv(t, src, group=None):
        try:
            t.copy_(next(wire))
        except StopIteration:
            raise RuntimeError("[gloo] Connection closed by peer") from None
    monkeypatch.setattr(transfer.dist, "recv", recv)
    eng = DecodeEngine(models["decode"], 2, 96, block_size=16, tokenizer=False)
    rx = Receiver(eng.config, eng.base.compute_dtype, eng.fingerprint)
    records = []
    run_decode(eng, transfer.receive(rx, src=0), params, records.append)
    by = {r["request_id"]: r for r in records}
    assert sorted(by) == [0, 1] and by[0]["token_ids"] == want
    n_parts = len(layout(eng.config, len(prompts[1]), eng.base.compute_dtype))
    assert by[1]["error"] == (f"request 1: truncated transfer, 1 of {n_parts} parts arrived before the transport "
                              "from rank 0 failed (RuntimeError: [gloo] Connection closed by peer)")
    assert eng.num_free_blocks == eng.num_blocks and not eng.has_unfinished()


def test_compiled_roles_are_bit_identical(models):
    """Both roles through v41graph.compile (our passes; CPU: our executor, not captured): P's
    encoder as one graph (CompiledModel.encode) that hands each layer's part over between its
    layers, D's decoder replay as one graph
    (CompiledModel.decode_replay) and D's decode steps through the decode bucket. Every part P
    packs equals the eager P's byte for byte; D's first-token logits and 16 greedy steps equal
    one process's eager Session replay prefill (~60 s: three traces of the tiny model)."""
    prompt = _prompt(30, 40)
    [want_h] = PrefillWorker(models["prefill"], 1, 96, block_size=16).prefill([prompt], [0])
    cp = v41graph.compile(models["prefill"], batch_sizes=(1,))
    worker = PrefillWorker(cp, 1, 96, block_size=16)
    dec = models["prefill"].decoder_start
    decoder_kv_written = {}         # part -> whether the decoder start's KV was written by then

    def on_part(rid, name, data):
        decoder_kv_written[name] = bool(worker.caches.global_kv[dec].any())
    [h] = worker.prefill([prompt], [0], on_part=on_part)
    assert len(cp.traced) == 1                     # the encoder graph ran, not the eager model
    # the graph called the hook between its layers: layer 0's part went out before the
    # decoder start's KV existed (its layer_done op comes after those writes)
    assert decoder_kv_written == {**{f"layer{i}": False for i in range(dec)}, f"layer{dec}": True, "replay": True}
    assert list(h.parts) == list(want_h.parts)
    for name, data in want_h.parts.items():
        assert torch.equal(h.parts[name], data), name
    cd = v41graph.compile(models["decode"], batch_sizes=(1,))
    d = DecodeWorker(cd, 1, 96)
    ref = v41graph.Session(models["both"], 1, 96, block_size=16)
    a, b = ref.prefill([prompt], mode="replay"), d.admit(0, h)[None]
    assert len(cd.traced) == 1                     # the decoder-replay graph
    assert torch.equal(a, b)
    _decode_both(ref, d, a)
    assert len(cd.traced) == 2                     # + the decode bucket's graph


@pytest.mark.parametrize("numerics", ["reference", "fast"])
def test_handover_in_the_released_formats(tmp_path_factory, numerics):
    """bf16 activations, FP8/FP4 weights as released (bf16 replay streams in the hand-over):
    still bit-identical, first token and 16 greedy steps."""
    cfg = v41graph.V41Config.tiny(weight_format="checkpoint", torch_dtype="bfloat16")
    ckpt = tmp_path_factory.mktemp("disagg_bf16")
    write_random_checkpoint(cfg, ckpt, seed=2, progress=False)
    load = lambda role: v41graph.from_pretrained(ckpt, role=role, numerics=numerics, progress=False)  # noqa: E731
    models = {"both": load("both"), "prefill": load("prefill"), "decode": load("decode")}
    ref, d, a, b, [h] = _reference_and_disagg(models, [_prompt(37, 5)])
    assert torch.equal(a, b)
    _decode_both(ref, d, a)
    assert _group_bytes(cfg, h, torch.bfloat16) == _expected_bytes(cfg, 37, 2)


# ----------------------------------------------------------------------------- command lines
def test_serve_role_points_at_the_torchrun_launcher(capsys, tmp_path):
    """`v41graph serve --role prefill|decode` starts nothing and names the launcher to run;
    a role that does not exist is argparse's error; the default is the whole model. The
    launcher's own command line refuses a run without prompts before any process group."""
    from v41graph.disagg import launch
    from v41graph.tools import cli
    for role in ("prefill", "decode"):
        assert cli.main(["serve", str(tmp_path), "--role", role]) == 2
        err = capsys.readouterr().err
        assert f"--role {role}: a prefill or decode worker" in err
        assert "python -m torch.distributed.run --nproc-per-node 2 -m v41graph.disagg.launch CHECKPOINT" in err
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", str(tmp_path), "--role", "encoder"])
    assert e.value.code == 2 and "invalid choice: 'encoder'" in capsys.readouterr().err
    assert cli._parser().parse_args(["serve", str(tmp_path)]).role == "both"
    with pytest.raises(SystemExit) as e:
        launch.main([str(tmp_path)])
    assert e.value.code == 2 and "give at least one --prompt" in capsys.readouterr().err


def test_bench_script_one_process_smoke(tmp_path):
    """scripts/bench_disagg.py in its one-process form (LocalTransport, the H200 run's code
    path) on the tiny config: D's first token equals the replay prefill's, the bytes the Sender
    counted equal the layout's, which equal the formula (a 41-token prompt: odd, so the ring rows
    travel too); a message header per BEGIN, part and END."""
    from v41graph.disagg.transfer import HEADER_BYTES
    bench = load_script("bench_disagg")
    assert bench.main(["--config", "tiny", "--device", "cpu", "--lengths", "41", "--repeats", "1",
                       "--out", str(tmp_path)]) == 0
    [row] = json.loads((tmp_path / "bench_disagg.json").read_text())["rows"]
    cfg = v41graph.V41Config.tiny()
    n_parts = len(layout(cfg, 41, torch.float32))
    assert row["first_token_equal"] is True
    assert {k: v for k, v in row["bytes_layout"].items() if k != "total"} == _expected_bytes(cfg, 41, 4)
    assert row["bytes_sent_per_request"] == {"header": HEADER_BYTES * (n_parts + 2), "prompt": 8 * 41,
                                             "parts": row["bytes_layout"]["total"]}
    assert all(row[k] > 0 for k in ("full_prefill_s", "replay_prefill_s", "p_alone_s", "p_with_sends_s", "admit_s"))
