"""Engram hash host/device pieces vs the reference golden vectors (golden_v41_tiny)
and the released table sizes (MODEL.md section 1 / 7)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from v41graph.model.engram_hash import (build_compressed_token_map, engram_hash_ids, engram_hash_params, engram_multipliers, engram_offsets, engram_prefill_history, engram_primes, engram_roll_history, engram_table_rows, is_prime, normalize_token_text)

from golden_path import GOLDEN_DIR

# Released config (MODEL.md section 1; HF config.json engram_* fields).
RELEASED_VOCAB_START = 16_000_000
RELEASED_LAYERS = [1, 14]
RELEASED_MAX_NGRAM = 4
RELEASED_HEADS = 8
RELEASED_TABLE_ROWS = [384006168, 384016682]


# ---------------------------------------------------------------- fixtures


def _need_golden() -> Path:
    if not (GOLDEN_DIR / "io.safetensors").is_file():
        pytest.skip(f"golden vectors not found at {GOLDEN_DIR} (set V41_GOLDEN_DIR)")
    return GOLDEN_DIR


@pytest.fixture(scope="module")
def golden():
    d = _need_golden()
    from safetensors.torch import load_file

    io = load_file(str(d / "io.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    meta = json.loads((d / "run_meta.json").read_text())
    stub = json.loads((d / "tokenizer_stub.json").read_text())
    return {"io": io, "cfg": cfg, "meta": meta, "stub": stub}


@pytest.fixture(scope="module")
def token_map(golden):
    stub = golden["stub"]
    return build_compressed_token_map(stub["texts"], stub["raw"])


@pytest.fixture(scope="module")
def params(golden):
    cfg = golden["cfg"]
    return engram_hash_params(
        cfg["engram_layer_ids"],
        cfg["engram_max_ngram_size"],
        cfg["engram_n_heads"],
        cfg["engram_vocab_size"],
        cfg["engram_compressed_vocab_size"],
    )


def _pad_cid(golden, token_map):
    return int(token_map[0][golden["cfg"]["engram_pad_id"]])


# ---------------------------------------------------------------- primes


def test_is_prime_matches_sympy():
    sympy = pytest.importorskip("sympy")
    for n in list(range(0, 2000)) + list(range(15_999_000, 16_001_000)):
        assert is_prime(n) == bool(sympy.isprime(n)), n


def test_golden_primes_offsets_rows(golden):
    cfg, io = golden["cfg"], golden["io"]
    primes = engram_primes(
        cfg["engram_vocab_size"],
        cfg["engram_layer_ids"],
        cfg["engram_max_ngram_size"],
        cfg["engram_n_heads"],
    )
    assert primes == golden["meta"]["engram_primes"]
    assert primes == io["engram_primes"].tolist()
    assert [engram_offsets(p) for p in primes] == io["engram_offsets"].tolist()
    assert [engram_table_rows(p) for p in primes] == cfg["engram_num_embeddings"]


def test_released_table_rows_fast():
    t0 = time.perf_counter()
    primes = engram_primes(
        RELEASED_VOCAB_START, RELEASED_LAYERS, RELEASED_MAX_NGRAM, RELEASED_HEADS
    )
    assert time.perf_counter() - t0 < 1.0
    assert [engram_table_rows(p) for p in primes] == RELEASED_TABLE_ROWS
    flat = [p for layer in primes for order in layer for p in order]
    assert len(flat) == len(set(flat)) == 2 * 3 * 8  # never reuses a prime
    # Offsets are an exclusive cumsum: last offset + last prime = table rows.
    for layer, rows in zip(primes, RELEASED_TABLE_ROWS):
        off = engram_offsets(layer)
        assert off[0] == 0 and off[-1] + layer[-1][-1] == rows


# ---------------------------------------------------------------- multipliers


def test_multipliers(golden):
    cfg, io = golden["cfg"], golden["io"]
    got = [
        engram_multipliers(l, cfg["engram_compressed_vocab_size"], cfg["engram_max_ngram_size"])
        for l in cfg["engram_layer_ids"]
    ]
    assert got == io["engram_multipliers"].tolist()
    assert all(m % 2 == 1 for row in got for m in row)


def test_hash_params_match_io(golden, params):
    io = golden["io"]
    for name in ("multipliers", "primes", "offsets"):
        assert torch.equal(params[name], io[f"engram_{name}"]), name
    assert params["table_rows"].tolist() == golden["cfg"]["engram_num_embeddings"]


# ---------------------------------------------------------------- token map


def test_compressed_token_map(golden, token_map):
    tmap, size = token_map
    assert size == golden["cfg"]["engram_compressed_vocab_size"]
    assert torch.equal(tmap, golden["io"]["engram_token_map"])


def test_whitespace_tokens_share_the_lone_space_class(golden, token_map):
    # README: whitespace collapse + lone-space sentinel + Strip.  Every
    # whitespace-only token must land in one class with " ", in the golden map.
    texts = golden["stub"]["texts"]
    gmap = golden["io"]["engram_token_map"]
    ws = [i for i, t in enumerate(texts) if t and t.strip(" \t\r\n") == ""]
    assert ws, "stub has no whitespace-only tokens"
    assert len({int(gmap[i]) for i in ws}) == 1
    assert all(normalize_token_text(texts[i]) == " " for i in ws)


# ---------------------------------------------------------------- device hash


def test_prefill_hash_ids(golden, token_map, params):
    io = golden["io"]
    n = golden["cfg"]["engram_max_ngram_size"]
    cids = token_map[0][io["prompt_ids"]]
    hist = engram_prefill_history(cids, _pad_cid(golden, token_map), n)
    out = engram_hash_ids(cids, hist, params["multipliers"], params["primes"], params["offsets"])
    ref = io["debug.engram_hash_ids.prefill"]
    assert out.dtype == torch.int64 and out.shape == ref.shape
    assert torch.equal(out, ref)


def test_single_layer_form(golden, token_map, params):
    io = golden["io"]
    n = golden["cfg"]["engram_max_ngram_size"]
    cids = token_map[0][io["prompt_ids"]]
    hist = engram_prefill_history(cids, _pad_cid(golden, token_map), n)
    ref = io["debug.engram_hash_ids.prefill"]
    for l in range(ref.shape[2]):
        out = engram_hash_ids(
            cids, hist, params["multipliers"][l], params["primes"][l], params["offsets"][l]
        )
        assert torch.equal(out, ref[:, :, l])


def _decode_steps(io):
    return sorted(
        int(k.rsplit("decode", 1)[1])
        for k in io
        if k.startswith("debug.engram_hash_ids.decode")
    )


def test_decode_hash_ids_with_rolled_history(golden, token_map, params):
    io = golden["io"]
    tmap = token_map[0]
    n = golden["cfg"]["engram_max_ngram_size"]
    steps = _decode_steps(io)
    assert steps == list(range(io["decode_ids"].shape[1]))
    prompt = tmap[io["prompt_ids"]]  # [B, T]
    # State carried into decode: the last prompt token and its history.
    hist = engram_prefill_history(prompt, _pad_cid(golden, token_map), n)[:, -1]
    cur = prompt[:, -1]
    for s in steps:
        hist = engram_roll_history(hist, cur)
        cur = tmap[io["decode_ids"][:, s]]  # [B] flat decode batch
        out = engram_hash_ids(cur, hist, params["multipliers"], params["primes"], params["offsets"])
        assert torch.equal(out.unsqueeze(1), io[f"debug.engram_hash_ids.decode{s}"]), s


def test_flat_token_batch_from_mixed_positions(golden, token_map, params):
    # A flat batch of tokens from different positions (all prompt tokens + all
    # decode tokens, shuffled) with per-token histories reproduces every capture.
    io = golden["io"]
    tmap = token_map[0]
    n = golden["cfg"]["engram_max_ngram_size"]
    full = tmap[torch.cat([io["prompt_ids"], io["decode_ids"]], dim=1)][0]  # [T+S]
    hist = engram_prefill_history(full, _pad_cid(golden, token_map), n)  # [T+S, N-1]
    ref = torch.cat(
        [io["debug.engram_hash_ids.prefill"][0]]
        + [io[f"debug.engram_hash_ids.decode{s}"][0] for s in _decode_steps(io)],
        dim=0,
    )
    perm = torch.randperm(full.shape[0], generator=torch.Generator().manual_seed(0))
    out = engram_hash_ids(
        full[perm], hist[perm], params["multipliers"], params["primes"], params["offsets"]
    )
    assert torch.equal(out, ref[perm])
