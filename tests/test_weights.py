"""Weights in the official DeepSeek-V4.1-Flash layout: load / save / validate / shard.

Checkpoints here are small but in exactly the released layout (names, dtypes, F4 logical
shapes, scales, index + shards); the golden checkpoint of DeepSeek's reference is one of them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from golden_path import GOLDEN_DIR
from script_loader import load_script
from v41graph import Session, V41Config, V41Model, init_random_
from v41graph.weights.checkpoint import (INDEX_NAME, SINGLE_NAME, Checkpoint, CheckpointError, CheckpointWriter, SafetensorsFile)
from v41graph.model.layers import Linear
from v41graph.weights.load import from_pretrained, load_official_state_dict, place_model, _load_tensors
from v41graph.weights.names import official_tensor_specs
from v41graph.weights.random_checkpoint import write_random_checkpoint
from v41graph.weights.save import save_pretrained
from v41graph.weights.sharding import ShardSpec, load_sharded_state_dict, merge_shards

ROOT = Path(__file__).resolve().parents[1]
HAVE_GOLDEN = (GOLDEN_DIR / "model.safetensors").is_file()
needs_golden = pytest.mark.skipif(not HAVE_GOLDEN, reason=f"golden vectors not at {GOLDEN_DIR}")


def raw(t: torch.Tensor) -> torch.Tensor:
    """Comparable view: 1-byte float formats as their bytes."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def same_params(a: V41Model, b: V41Model) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and pa[k].shape == pb[k].shape, k
        assert torch.equal(raw(pa[k]), raw(pb[k])), k


def run_session(model: V41Model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = Session(model, max_batch_size=ids.shape[0], max_seq_len=64, block_size=16)
    return s.prefill(ids), s.decode(ids[:, :1])


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny CPU models: one intra-op thread is faster, and on a busy machine two OpenMP threads
    spin-wait each other into a 100x slowdown. Restored after this module."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_cfg():
    return V41Config.tiny(weight_format="checkpoint")


@pytest.fixture(scope="module")
def tiny_model(tiny_cfg):
    return init_random_(V41Model(tiny_cfg), seed=11).eval().set_numerics("fast")


@pytest.fixture(scope="module")
def tiny_ids():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def tiny_logits(tiny_model, tiny_ids):
    return run_session(tiny_model, tiny_ids)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model, tmp_path_factory):
    """The random tiny model saved sharded (64 KiB shards)."""
    d = tmp_path_factory.mktemp("tiny_sharded")
    save_pretrained(tiny_model, d, max_shard_bytes=64 << 10)
    return d


def mutable_copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------- layout
@needs_golden
def test_official_specs_match_the_golden_header_exactly():
    config = V41Config.from_json(GOLDEN_DIR)
    specs = official_tensor_specs(config)
    with Checkpoint.open(GOLDEN_DIR) as ckpt:
        assert set(specs) == set(ckpt.tensors)
        for name, spec in specs.items():
            info = ckpt.info(name)
            assert (info.dtype, info.shape) == (spec.dtype, spec.shape), name
    kinds = {s.dtype for s in specs.values()}
    assert kinds == {"F8_E4M3", "F8_E8M0", "F4", "BF16", "F32"}


def test_torch_has_the_official_dtypes():
    # this build stores FP4 / E8M0 with their own dtypes (fall back to uint8 where missing)
    assert torch.float4_e2m1fn_x2.itemsize == 1 and torch.float8_e8m0fnu.itemsize == 1


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_round_trip_tiny_identical_params_and_logits(layout, tiny_model, tiny_dir, tiny_ids,
                                                     tiny_logits, tmp_path):
    if layout == "sharded":
        d = tiny_dir
        index = json.loads((d / INDEX_NAME).read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 5 and not (d / SINGLE_NAME).exists()
        assert all(f.startswith("model-") and f.endswith(f"-of-{len(shards):05d}.safetensors")
                   for f in shards)
        assert index["metadata"]["total_size"] == sum(
            SafetensorsFile(d / f).size - SafetensorsFile(d / f).data_start for f in shards)
    else:
        d = tmp_path / "single"
        files = save_pretrained(tiny_model, d, single_file=True)
        assert [f.name for f in files] == [SINGLE_NAME] and not (d / INDEX_NAME).exists()
    loaded = from_pretrained(d, numerics="fast")
    same_params(tiny_model, loaded)
    prefill, decode = run_session(loaded, tiny_ids)
    assert torch.equal(prefill, tiny_logits[0]) and torch.equal(decode, tiny_logits[1])


def test_files_are_readable_by_the_safetensors_library(tiny_dir):
    from safetensors.torch import load_file
    ours = _load_tensors(tiny_dir)
    theirs = {}
    for f in sorted(tiny_dir.glob("model-*.safetensors")):
        theirs.update(load_file(str(f)))
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(raw(ours[k]), raw(theirs[k])), k
    assert theirs["layers.0.ffn.experts.0.w1.weight"].dtype == torch.float4_e2m1fn_x2


@needs_golden
def test_golden_round_trip_byte_identical_and_same_logits(tmp_path):
    model = from_pretrained(GOLDEN_DIR, numerics="reference")
    out = tmp_path / "golden_copy"
    save_pretrained(model, out, max_shard_bytes=1 << 20)
    assert (out / "tokenizer_stub.json").is_file()          # Engram's compressed-id map
    with Checkpoint.open(GOLDEN_DIR) as a, Checkpoint.open(out) as b:
        assert len(b.files) > 1 and set(a.tensors) == set(b.tensors)   # mtp.* carried over
        for name, info in a.tensors.items():
            assert (b.info(name).dtype, b.info(name).shape) == (info.dtype, info.shape), name
            assert torch.equal(raw(a.read(name)), raw(b.read(name))), name
    again = from_pretrained(out, numerics="reference")
    same_params(model, again)
    assert torch.equal(model.engram_token_map, again.engram_token_map)
    from safetensors.torch import load_file
    ids = load_file(str(GOLDEN_DIR / "io.safetensors"))["prompt_ids"][:, :10]
    la = Session(model, 1, 32, block_size=32).prefill(ids)
    lb = Session(again, 1, 32, block_size=32).prefill(ids)
    assert torch.equal(la, lb)


@needs_golden
def test_legacy_in_memory_state_dict_path_still_works():
    from safetensors.torch import load_file
    from v41graph.weights.load import _build_empty_model
    config = V41Config.from_json(GOLDEN_DIR)
    model = _build_empty_model(config)
    skipped = load_official_state_dict(model, load_file(str(GOLDEN_DIR / "model.safetensors")))
    assert skipped and all(n.startswith("mtp.") for n in skipped)
    same_params(model, from_pretrained(GOLDEN_DIR))


# ----------------------------------------------------------------------------- dequantization
# E4M3: sign | 4 exponent bits (bias 7) | 3 mantissa bits; E8M0 byte e = 2^(e-127).
FP8_BYTES = [0x38, 0x40, 0xB8, 0x01, 0x7E, 0x3C, 0x31, 0x80]
#            1.0   2.0   -1.0  2^-9  448   1.5   0.5625 -0
FP8_SCALE_0, FP8_SCALE_1 = 129, 120          # x4 for columns 0-31, x2^-7 for columns 32-63
FP8_EXPECTED = [4.0, 8.0, -4.0, 0.0078125, 1792.0, 6.0, 2.25, -0.0]
FP8_COL32 = [(0x38, 0.0078125), (0xC4, -0.0234375)]   # 1.0 * 2^-7; -3.0 * 2^-7
# E2M1 nibbles (low nibble = even element): code -> 0, .5, 1, 1.5, 2, 3, 4, 6 (bit 3 = sign).
FP4_BYTES = [0x21, 0xF7, 0x9A, 0x08]          # (0.5, 1), (6, -6), (-1, -0.5), (-0, 0)
FP4_SCALE_0, FP4_SCALE_1 = 126, 130          # x0.5 for elements 0-31, x8 for 32-63
FP4_EXPECTED = [0.25, 0.5, 3.0, -3.0, -0.5, -0.25, -0.0, 0.0]
FP4_BYTE16, FP4_EXPECTED_32 = 0x5C, [-16.0, 24.0]     # (-2, 3) x 8


@pytest.fixture(scope="module")
def hand_dir(tiny_cfg, tmp_path_factory):
    """A tiny checkpoint whose layer-0 wq_a (FP8) and expert-0 w1 (FP4) start with the
    hand-written bytes above."""
    model = init_random_(V41Model(tiny_cfg), seed=2)
    wq_a, w1 = model.layers[0].attn.wq_a, model.layers[0].ffn.experts[0].w1
    assert (wq_a.fmt, wq_a.in_features, w1.fmt, w1.in_features) == ("fp8", 64, "fp4", 64)
    with torch.no_grad():
        wq_a.weight[0, :8] = torch.tensor(FP8_BYTES, dtype=torch.uint8)
        wq_a.weight[0, 32], wq_a.weight[0, 33] = FP8_COL32[0][0], FP8_COL32[1][0]
        wq_a.scale[0, 0], wq_a.scale[0, 1] = FP8_SCALE_0, FP8_SCALE_1
        w1.weight[0, :4] = torch.tensor(FP4_BYTES, dtype=torch.uint8)
        w1.weight[0, 16] = FP4_BYTE16
        w1.scale[0, 0], w1.scale[0, 1] = FP4_SCALE_0, FP4_SCALE_1
    d = tmp_path_factory.mktemp("hand")
    save_pretrained(model, d)
    return d


def _check_hand_values(wq_a_row: torch.Tensor, w1_row: torch.Tensor) -> None:
    assert torch.equal(wq_a_row[:8], torch.tensor(FP8_EXPECTED))
    assert torch.equal(torch.signbit(wq_a_row[:8]), torch.signbit(torch.tensor(FP8_EXPECTED)))
    assert wq_a_row[32].item() == FP8_COL32[0][1] and wq_a_row[33].item() == FP8_COL32[1][1]
    assert torch.equal(w1_row[:8], torch.tensor(FP4_EXPECTED))
    assert torch.equal(torch.signbit(w1_row[:8]), torch.signbit(torch.tensor(FP4_EXPECTED)))
    assert w1_row[32:34].tolist() == FP4_EXPECTED_32


def test_fp8_fp4_dequantization_bit_exact_against_hand_computed_values(hand_dir):
    kept = from_pretrained(hand_dir)                         # bytes kept
    _check_hand_values(kept.layers[0].attn.wq_a.dequantized_weight()[0],
                       kept.layers[0].ffn.experts[0].w1.dequantized_weight()[0])
    dense = from_pretrained(hand_dir, dequantize=True)       # dequantized at load
    assert dense.layers[0].attn.wq_a.fmt == "dense" and dense.config.weight_format == "dense"
    _check_hand_values(dense.layers[0].attn.wq_a.weight[0], dense.layers[0].ffn.experts[0].w1.weight[0])


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("which", ["tiny", "golden"])
def test_dequantize_equals_dequantized_weight(which, tiny_dir, tiny_ids, tiny_logits):
    if which == "golden" and not HAVE_GOLDEN:
        pytest.skip("no golden vectors")
    src = tiny_dir if which == "tiny" else GOLDEN_DIR
    kept, dense = from_pretrained(src, numerics="fast"), from_pretrained(src, numerics="fast", dequantize=True)
    lk, ld = _linears(kept), _linears(dense)
    assert lk.keys() == ld.keys()
    n_quant = 0
    for name, m in lk.items():
        d = ld[name]
        assert d.fmt == "dense" and d.scale is None
        assert d.weight.dtype == (torch.float32 if m.fmt == "dense" else kept.compute_dtype) \
            or m.fmt == "dense"
        if m.fmt != "dense":
            n_quant += 1
            assert torch.equal(d.weight.float(), m.dequantized_weight()), name
        else:
            assert torch.equal(d.weight, m.weight), name
    assert n_quant > 50
    for e_kept, e_dense in zip(kept.engram, dense.engram):     # tables stay FP8 bytes
        assert e_dense.embed_weight.dtype == torch.uint8
        assert torch.equal(e_kept.embed_weight, e_dense.embed_weight)
    if which == "tiny":   # fast numerics: the byte-kept model dequantizes to the same weights
        assert torch.equal(run_session(dense, tiny_ids)[0], tiny_logits[0])


# ----------------------------------------------------------------------------- storage options
def test_engram_mmap_storage_and_host_placement(tiny_dir, tiny_model):
    model = from_pretrained(tiny_dir, engram_storage="mmap")
    table = model.engram[0].embed_weight
    assert not table.untyped_storage().resizable()           # backed by the file mapping
    assert torch.equal(table, tiny_model.engram[0].embed_weight)
    shard = next(tiny_dir.glob("model-*.safetensors"))
    before = {p: p.read_bytes() for p in tiny_dir.glob("*.safetensors")}
    with torch.no_grad():
        table.fill_(0)                                        # copy-on-write: file untouched
    assert before == {p: p.read_bytes() for p in tiny_dir.glob("*.safetensors")} and shard
    # everything moves except the Engram tables (meta stands in for an accelerator here)
    model = from_pretrained(tiny_dir, engram_storage="pinned" if torch.cuda.is_available() else "memory")
    place_model(model, torch.device("meta"))
    for e in model.engram:
        assert e.embed_weight.device.type == "cpu" and e.embed_scale.device.type == "cpu"
        assert e.wkv.weight.is_meta and e.q_weight.is_meta
    assert model.layers[0].attn.wq_a.weight.is_meta and model.head.is_meta


def test_progress_callback_and_stderr_line(tiny_dir, capsys):
    seen = []
    from_pretrained(tiny_dir, progress=lambda done, total, name: seen.append((done, total, name)))
    assert len(seen) > 100 and seen[-1][0] == seen[-1][1]
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    capsys.readouterr()
    from_pretrained(tiny_dir, progress=True)            # a tqdm bar over the bytes, finished
    err = capsys.readouterr().err
    assert "Loading checkpoint" in err and "100%" in err
    assert re.search(r"Loading checkpoint: +0%", err)
    from_pretrained(tiny_dir)                           # progress=None: stderr is no terminal here
    from_pretrained(tiny_dir, progress=False)
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- sharding hooks
@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    cfg = V41Config.tiny(weight_format="checkpoint", moe_intermediate_size=64)
    d = tmp_path_factory.mktemp("shardable")
    write_random_checkpoint(cfg, d, seed=4, max_shard_bytes=256 << 10)
    return d, cfg


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_rank_shards_reassemble_to_the_full_tensors(shard_dir, expert_parallel):
    d, cfg = shard_dir
    full = _load_tensors(d)
    specs = [ShardSpec(r, 2, expert_parallel=expert_parallel) for r in range(2)]
    states = [load_sharded_state_dict(d, s) for s in specs]
    merged = merge_shards(states, specs, cfg)
    assert merged.keys() == full.keys()
    for k in full:
        assert merged[k].dtype == full[k].dtype and torch.equal(raw(merged[k]), raw(full[k])), k
    r0, r1 = states
    # column-parallel on out, row-parallel on in, scales follow their weight
    assert r0["embed.weight"].shape == (128, 64) and r0["head.weight"].shape == (128, 64)
    assert r0["layers.2.attn.wq_b.weight"].shape == (64, 32)          # 2 of 4 heads
    assert r0["layers.2.attn.wq_b.scale"].shape == (2, 1)
    assert r1["layers.2.attn.wo_b.weight"].shape == (64, 32)          # in 64 -> 32
    assert r1["layers.2.attn.wo_b.scale"].shape == (2, 1)
    assert r0["layers.2.attn.attn_sink"].shape == (2,)
    assert r0["layers.2.ffn.shared_experts.w2.weight"].shape == (64, 32)
    assert r0["layers.2.attn.wq_a.weight"].shape == (32, 64)          # replicated
    assert torch.equal(raw(r0["layers.2.attn.wq_a.weight"]), raw(r1["layers.2.attn.wq_a.weight"]))
    assert torch.equal(r0["layers.2.attn.wq_b.weight"].view(torch.uint8),
                       full["layers.2.attn.wq_b.weight"].view(torch.uint8)[:64])
    if expert_parallel:   # 4 experts: rank 0 keeps 0-1 whole, rank 1 keeps 2-3
        assert "layers.0.ffn.experts.1.w1.weight" in r0 and "layers.0.ffn.experts.2.w1.weight" not in r0
        assert "layers.0.ffn.experts.2.w1.weight" in r1 and "layers.0.ffn.experts.0.w2.scale" not in r1
        assert r1["layers.0.ffn.experts.2.w2.weight"].shape == (64, 32)   # F4 [out, in/2]
    else:                 # every expert split: w1/w3 on out, w2 on in (F4 bytes: in/2/2)
        assert r1["layers.0.ffn.experts.3.w1.weight"].shape == (32, 32)
        assert r1["layers.0.ffn.experts.3.w2.weight"].shape == (64, 16)
        assert r1["layers.0.ffn.experts.3.w2.scale"].shape == (64, 1)
        assert torch.equal(r1["layers.0.ffn.experts.3.w2.weight"].view(torch.uint8),
                           full["layers.0.ffn.experts.3.w2.weight"].view(torch.uint8)[:, 16:])


def test_world_size_one_is_the_identity_and_bad_splits_are_refused(shard_dir):
    d, cfg = shard_dir
    full = _load_tensors(d)
    one = load_sharded_state_dict(d, ShardSpec(0, 1))
    assert one.keys() == full.keys() and all(torch.equal(raw(one[k]), raw(full[k])) for k in full)
    same_params(from_pretrained(d, shard=ShardSpec(0, 1)), from_pretrained(d))
    with pytest.raises(ValueError, match="cannot split .* over 3 ranks"):
        load_sharded_state_dict(d, ShardSpec(0, 3))
    with pytest.raises(NotImplementedError, match="load_sharded_state_dict"):
        from_pretrained(d, shard=ShardSpec(1, 2))
    with pytest.raises(ValueError, match="rank"):
        ShardSpec(2, 2)


# ----------------------------------------------------------------------------- validation errors
def test_one_error_lists_every_missing_unexpected_wrong_shape_and_dtype(tiny_dir, tmp_path):
    from safetensors.torch import save_file
    d = tmp_path / "bad"
    d.mkdir()
    shutil.copy(tiny_dir / "config.json", d / "config.json")
    tensors = _load_tensors(tiny_dir)
    del tensors["layers.0.attn.wq_a.scale"]
    del tensors["layers.7.ffn.experts.1.w3.weight"]
    tensors["layers.0.attn.bogus"] = torch.zeros(3)
    tensors["norm.weight"] = torch.zeros(65)
    tensors["head.weight"] = tensors["head.weight"].to(torch.bfloat16)
    save_file(tensors, str(d / SINGLE_NAME))
    with pytest.raises(CheckpointError) as err:
        from_pretrained(d)
    msg = str(err.value)
    assert "config.json" in msg and "(5 problems)" in msg
    for line in ["missing: layers.0.attn.wq_a.scale", "missing: layers.7.ffn.experts.1.w3.weight",
                 "unexpected: layers.0.attn.bogus in model.safetensors",
                 "wrong shape: norm.weight in model.safetensors is [65], expected [64]",
                 "wrong dtype: head.weight in model.safetensors is BF16, expected F32"]:
        assert line in msg, line
    assert len(err.value.problems) == 5


def _first_shard(d: Path) -> Path:
    return sorted(d.glob("model-*.safetensors"))[0]


def test_truncated_shard_names_the_file(tiny_dir, tmp_path):
    d = mutable_copy(tiny_dir, tmp_path)
    shard = _first_shard(d)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    with pytest.raises(CheckpointError, match=f"{shard.name}: truncated"):
        from_pretrained(d)


@pytest.mark.parametrize("damage", ["json", "length", "offsets", "tiny"])
def test_corrupt_shard_header_names_the_file(damage, tiny_dir, tmp_path):
    d = mutable_copy(tiny_dir, tmp_path)
    shard = _first_shard(d)
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    if damage == "json":
        data[9:20] = b"#" * 11
    elif damage == "length":
        data[:8] = (1 << 40).to_bytes(8, "little")
    elif damage == "offsets":
        header = json.loads(data[8:8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 4
        new = json.dumps(header).encode().ljust(n)
        data[8:8 + n] = new[:n] if len(new) >= n else new
    else:
        data = data[:5]
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name) as err:
        from_pretrained(d)
    assert err.value.path == shard


def test_bad_index_files(tiny_dir, tmp_path):
    d = mutable_copy(tiny_dir, tmp_path)
    index = d / INDEX_NAME
    good = json.loads(index.read_text())
    # malformed JSON
    index.write_text("{ not json")
    with pytest.raises(CheckpointError, match=f"{INDEX_NAME}: malformed index"):
        from_pretrained(d)
    # no weight_map
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        from_pretrained(d)
    # a shard the index names does not exist
    shards = sorted(set(good["weight_map"].values()))
    os.rename(d / shards[1], d / (shards[1] + ".moved"))
    index.write_text(json.dumps(good))
    with pytest.raises(CheckpointError, match=f"do not exist .*{shards[1]}"):
        from_pretrained(d)
    os.rename(d / (shards[1] + ".moved"), d / shards[1])
    # a tensor listed under a shard that does not contain it
    wm = dict(good["weight_map"])
    name = next(n for n, f in wm.items() if f == shards[0])
    wm[name] = shards[2]
    index.write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError) as err:
        from_pretrained(d)
    assert f"{name}: listed under {shards[2]} but that file does not contain it" in str(err.value)
    assert INDEX_NAME in str(err.value)
    # a tensor stored in a shard but missing from the index
    wm = dict(good["weight_map"])
    name = next(n for n, f in wm.items() if list(wm.values()).count(f) > 1)
    shard_of_name = wm.pop(name)
    index.write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match=f"{name}: stored in {shard_of_name} but not listed"):
        from_pretrained(d)


def test_config_that_does_not_match_the_tensors(tiny_dir, tmp_path):
    d = mutable_copy(tiny_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["n_routed_experts"] = 6
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        from_pretrained(d)
    msg = str(err.value)
    assert f"{d / 'config.json'}" in msg
    assert "missing: layers.0.ffn.experts.5.w1.weight" in msg
    assert "wrong shape: layers.0.ffn.gate.weight" in msg and "expected [6, 64]" in msg
    (d / "config.json").write_text("{ broken")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        from_pretrained(d)


# ----------------------------------------------------------------------------- writer / script
def test_save_warns_when_official_dtype_rounds(tmp_path):
    cfg = V41Config.tiny(weight_format="checkpoint", torch_dtype="bfloat16")
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = V41Model(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    init_random_(model, seed=1)          # fp32 random values in the fp32 RMSNorm weights
    with pytest.warns(UserWarning, match="rounded to their official dtype"):
        save_pretrained(model, tmp_path / "bf16")
    with Checkpoint.open(tmp_path / "bf16") as ck:
        assert ck.info("norm.weight").dtype == "BF16" and ck.info("head.weight").dtype == "F32"


def test_writer_refuses_incomplete_checkpoints(tmp_path):
    with pytest.raises(RuntimeError, match="incomplete"):
        with CheckpointWriter(tmp_path / "w", [("a", "F32", [4]), ("b", "F4", [2, 64])]) as w:
            w.write("a", torch.zeros(4))
    assert not list((tmp_path / "w").glob("*.safetensors*"))


def _script():
    return load_script("make_random_checkpoint")


def test_make_random_checkpoint_script(tmp_path, capsys):
    script = _script()
    out = tmp_path / "tiny"
    assert script.main(["--config", "tiny", "--out", str(out), "--seed", "3",
                        "--max-shard-gb", str(200 / 1024 ** 2), "--quiet"]) == 0
    with Checkpoint.open(out) as ck:                       # full official layout, DSpark too
        assert set(ck.tensors) == set(official_tensor_specs(V41Config.from_json(out)))
        assert len(ck.files) > 1
    model = from_pretrained(out, numerics="reference")
    logits = Session(model, 1, 32, block_size=16).prefill(torch.arange(10)[None])
    assert logits.isfinite().all() and logits.std() > 0
    # deterministic in the seed
    again = tmp_path / "again"
    script.main(["--config", "tiny", "--out", str(again), "--seed", "3",
                 "--max-shard-gb", str(200 / 1024 ** 2), "--quiet"])
    same_params(model, from_pretrained(again, numerics="reference"))
    # a JSON config, single file
    cfg = dataclasses.replace(V41Config.tiny(weight_format="checkpoint"), n_routed_experts=2,
                              num_experts_per_tok=1)
    cfg.save_json(tmp_path / "my.json")
    script.main(["--config", str(tmp_path / "my.json"), "--out", str(tmp_path / "j"),
                 "--single-file", "--quiet"])
    assert (tmp_path / "j" / SINGLE_NAME).is_file()
    assert len(from_pretrained(tmp_path / "j").layers[0].ffn.experts) == 2
    # bench / full: plan only
    capsys.readouterr()
    script.main(["--config", "full", "--out", str(tmp_path / "full"), "--dry-run"])
    assert "GiB in" in capsys.readouterr().out and not (tmp_path / "full").exists()


# ----------------------------------------------------------------------------- peak memory
_MEASURE = textwrap.dedent("""
    import json, sys, torch
    from v41graph.weights.load import from_pretrained
    from v41graph.weights.save import save_pretrained

    def status():
        out = {}
        for line in open("/proc/self/status"):
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
        return out

    def reset_peak():
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                   # resets VmHWM to the current RSS
            return True
        except OSError:
            return False

    def measure(src, dst, shard_bytes, need_reset):
        if not reset_peak() and need_reset:
            return None
        base = status()["VmRSS"]
        model = from_pretrained(src, numerics="fast", progress=False)
        after = status()
        res = {"load_peak": after["VmHWM"] - base, "load_kept": after["VmRSS"] - base,
               "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
               "largest_tensor": max(p.numel() * p.element_size() for p in model.parameters())}
        if reset_peak():
            base = status()["VmRSS"]
            save_pretrained(model, dst, max_shard_bytes=shard_bytes, mtp=None)
            res["save_peak"] = status()["VmHWM"] - base
        del model
        return res

    if __name__ == "__main__":
        print(json.dumps(measure(sys.argv[1], sys.argv[2], int(sys.argv[3]), False)))
""")


def test_peak_memory_of_loading_is_bounded(tmp_path):
    """~330 MB checkpoint (wider tiny config: d=1024, 16 experts of 1024); the loader reads
    tensor by tensor into the model, so peak RSS growth ~ model bytes, far from 2x. Measured
    with VmHWM after resetting it (/proc/self/clear_refs), in a subprocess if that is refused."""
    cfg = V41Config.tiny(weight_format="checkpoint", hidden_size=1024,
                         moe_intermediate_size=1024, n_routed_experts=16)
    specs = official_tensor_specs(cfg)
    shard_bytes = 32 << 20
    d = tmp_path / "big"
    fill = torch.full((8 << 20,), 0x38, dtype=torch.uint8)      # 1.0 in E4M3, finite everywhere
    with CheckpointWriter(d, [(s.name, s.dtype, s.shape) for s in specs.values()], shard_bytes) as w:
        for s in specs.values():
            nbytes = w.tensors[s.name].nbytes
            for off in range(0, nbytes, fill.numel()):
                w.write(s.name, fill[: min(fill.numel(), nbytes - off)], byte_offset=off)
        total = w.total_bytes
    del fill
    cfg.save_json(d / "config.json")
    with Checkpoint.open(d) as ck:
        largest_shard = ck.largest_shard_bytes
    assert total > 300e6
    args = [str(d), str(tmp_path / "saved"), str(shard_bytes)]
    scope: dict = {"__name__": "measure"}
    exec(_MEASURE, scope)
    res = scope["measure"](d, args[1], shard_bytes, True)
    if res is None:      # VmHWM cannot be reset here: measure in a fresh process
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path))
        proc = subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True,
                              text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    mb = res["model_bytes"]
    print({k: f"{v / 2 ** 20:.1f} MiB" for k, v in res.items()},
          f"checkpoint {total / 2 ** 20:.1f} MiB, largest shard {largest_shard / 2 ** 20:.1f} MiB")
    margin = 48 << 20
    assert res["load_peak"] < mb + largest_shard + margin, res
    assert res["load_peak"] < mb + res["largest_tensor"] + margin, res     # tighter: no shard copy
    assert res["load_peak"] < 1.5 * total                                  # never 2x the checkpoint
    if "save_peak" in res:                                                 # saving writes views
        assert res["save_peak"] < res["largest_tensor"] + margin, res
