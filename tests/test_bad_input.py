"""Bad requests through Session raise a clear error and change nothing: every cache tensor is
bitwise unchanged, the session's bookkeeping is unchanged, and the next valid step of the
other sequences gives exactly the logits of an identical session that never saw the request."""
from __future__ import annotations

import pytest
import torch

import v41graph
from v41graph.runtime.batch import CacheCapacityError
from v41graph.model.metadata import build_metadata
from v41graph.model.model import V41Model
from v41graph.runtime.session import Session

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCK = 16


def _toks(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _state(s: Session):
    return ([t.clone() for t in s.caches.tensors()], list(s.seq_lens), [list(b) for b in s.blocks],
            s.allocator.num_free)


def _assert_unchanged(s: Session, before):
    tensors, lens, blocks, free = before
    after = s.caches.tensors()
    assert len(after) == len(tensors)
    for i, (a, b) in enumerate(zip(after, tensors)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"cache tensor {i} changed"
    assert s.seq_lens == lens
    assert s.blocks == blocks
    assert s.allocator.num_free == free


def _twins(model, prompts, **kw):
    """Two identical sessions with the same prompts prefilled: one gets the bad request."""
    out = []
    for _ in range(2):
        s = Session(model, **kw)
        s.prefill(prompts)
        out.append(s)
    return out


KW = dict(max_batch_size=2, max_seq_len=64, block_size=BLOCK)
PROMPTS = [_toks(20, 1), _toks(9, 2)]


def _check_same_next_decode(bad: Session, good: Session, ids=((7,), (11,))):
    ids = torch.tensor([list(i) for i in ids])
    assert torch.equal(bad.decode(ids), good.decode(ids))


# =============================================================================== token ids
@pytest.mark.parametrize("bad_id", [-1, 256, 10 ** 6])
def test_token_id_out_of_range_in_decode(tiny_model, bad_id):
    s, ref = _twins(tiny_model, PROMPTS, **KW)
    before = _state(s)
    with pytest.raises(ValueError, match=rf"token id {bad_id}\b.*vocabulary"):
        s.decode(torch.tensor([[5], [bad_id]]))
    _assert_unchanged(s, before)
    _check_same_next_decode(s, ref)


@pytest.mark.parametrize("bad_id", [-3, 256])
def test_token_id_out_of_range_in_extend_of_another_sequence(tiny_model, bad_id):
    s, ref = _twins(tiny_model, PROMPTS, **KW)
    before = _state(s)
    with pytest.raises(ValueError, match=rf"sequence 1: token id {bad_id}\b.*vocabulary"):
        s.extend([1], [[3, 4, bad_id, 5]])
    _assert_unchanged(s, before)
    _check_same_next_decode(s, ref)


def test_token_id_out_of_range_in_a_first_prefill(tiny_model):
    s = Session(tiny_model, **KW)
    before = _state(s)
    with pytest.raises(ValueError, match=r"sequence 1: token id 256\b.*vocabulary 0\.\.255"):
        s.prefill([[1, 2, 3], [4, 256, 5]])
    _assert_unchanged(s, before)
    ref = Session(tiny_model, **KW)
    assert torch.equal(s.prefill(PROMPTS), ref.prefill(PROMPTS))


# =============================================================================== positions / capacity
def test_position_beyond_max_position_embeddings(tiny_model):
    cfg = v41graph.V41Config.tiny(max_position_embeddings=32)
    model = V41Model(cfg)
    model.load_state_dict(tiny_model.state_dict())        # same weights, shorter position range
    kw = dict(max_batch_size=2, max_seq_len=32, block_size=BLOCK)
    s, ref = _twins(model.eval(), [_toks(32, 3), _toks(10, 4)], **kw)
    before = _state(s)
    with pytest.raises(ValueError, match=r"position 32\b.*max_position_embeddings 32"):
        s.extend([0], [[1]])
    _assert_unchanged(s, before)
    assert torch.equal(s.extend([1], [[6]]), ref.extend([1], [[6]]))


def test_max_seq_len_beyond_max_position_embeddings_is_refused(tiny_model):
    cfg = v41graph.V41Config.tiny(max_position_embeddings=32)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Session(V41Model(cfg), max_batch_size=1, max_seq_len=33, block_size=BLOCK)


def test_context_beyond_the_cache_budget(tiny_model):
    kw = dict(max_batch_size=2, max_seq_len=24, block_size=BLOCK)
    s, ref = _twins(tiny_model, [_toks(20, 5), _toks(10, 6)], **kw)
    before = _state(s)
    with pytest.raises(CacheCapacityError, match=r"context of 25 tokens exceeds the cache capacity of 24"):
        s.extend([0], [[1, 2, 3, 4, 5]])
    _assert_unchanged(s, before)
    _check_same_next_decode(s, ref)


def test_prompt_longer_than_the_cache_budget(tiny_model):
    s = Session(tiny_model, max_batch_size=1, max_seq_len=16, block_size=BLOCK)
    before = _state(s)
    with pytest.raises(CacheCapacityError, match="cache capacity"):
        s.prefill([_toks(17, 7)])
    _assert_unchanged(s, before)


def test_no_free_blocks(tiny_model):
    kw = dict(max_batch_size=2, max_seq_len=32, block_size=BLOCK, num_blocks=1)
    s, ref = _twins(tiny_model, [_toks(6, 8)], **kw)     # sequence 0 holds the only block
    before = _state(s)
    with pytest.raises(CacheCapacityError, match=r"needs 1 more cache blocks but only 0 are free"):
        s.extend([1], [_toks(5, 9)])
    _assert_unchanged(s, before)
    assert torch.equal(s.decode(torch.tensor([[3]])), ref.decode(torch.tensor([[3]])))


def test_no_free_blocks_for_a_two_sequence_prefill(tiny_model):
    s = Session(tiny_model, max_batch_size=2, max_seq_len=32, block_size=BLOCK, num_blocks=1)
    before = _state(s)
    with pytest.raises(CacheCapacityError, match=r"needs 2 more cache blocks but only 1 are free"):
        s.prefill([_toks(5, 10), _toks(7, 11)])
    _assert_unchanged(s, before)


# =============================================================================== call order, dtype, shape
def test_decode_before_prefill(tiny_model):
    s = Session(tiny_model, **KW)
    before = _state(s)
    with pytest.raises(ValueError, match=r"sequence 0 has no prefill"):
        s.decode(torch.tensor([[1], [2]]))
    _assert_unchanged(s, before)


def test_decode_of_a_sequence_that_was_never_prefilled(tiny_model):
    s, ref = _twins(tiny_model, [_toks(12, 12)], **KW)     # only sequence 0 is running
    before = _state(s)
    with pytest.raises(ValueError, match=r"sequence 1 has no prefill"):
        s.decode(torch.tensor([[1], [2]]))
    _assert_unchanged(s, before)
    assert torch.equal(s.decode(torch.tensor([[4]])), ref.decode(torch.tensor([[4]])))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_wrong_dtype(tiny_model, dtype):
    s, ref = _twins(tiny_model, PROMPTS, **KW)
    before = _state(s)
    with pytest.raises(TypeError, match=r"integer tensor.*" + str(dtype).replace(".", r"\.")):
        s.decode(torch.tensor([[5], [6]]).to(dtype))
    with pytest.raises(TypeError, match=r"integer tensor"):
        s.prefill(torch.zeros(2, 4, dtype=dtype))
    _assert_unchanged(s, before)
    _check_same_next_decode(s, ref)


@pytest.mark.parametrize("shape", [(2, 1, 1), (1, 2, 1, 1)])
def test_wrong_shape(tiny_model, shape):
    s, ref = _twins(tiny_model, PROMPTS, **KW)
    before = _state(s)
    with pytest.raises(ValueError, match=r"expected shape \[B, T\]"):
        s.decode(torch.ones(shape, dtype=torch.long))
    with pytest.raises(ValueError, match=r"expected shape \[B, T\]"):
        s.prefill(torch.ones(shape, dtype=torch.long))
    _assert_unchanged(s, before)
    _check_same_next_decode(s, ref)


def test_decode_with_more_than_one_token(tiny_model):
    s, ref = _twins(tiny_model, PROMPTS, **KW)
    before = _state(s)
    with pytest.raises(ValueError, match="exactly one token"):
        s.decode(torch.tensor([[5, 6], [7, 8]]))
    _assert_unchanged(s, before)
    _check_same_next_decode(s, ref)


def test_repeated_sequence_in_one_step(tiny_model):
    s, ref = _twins(tiny_model, PROMPTS, **KW)
    before = _state(s)
    with pytest.raises(ValueError, match="repeat"):
        s.extend([1, 1], [[5], [6]])
    _assert_unchanged(s, before)
    _check_same_next_decode(s, ref)


def test_rejected_prefill_leaves_the_running_sequences_alone(tiny_model):
    s, ref = _twins(tiny_model, PROMPTS, **KW)
    before = _state(s)
    with pytest.raises(ValueError, match="vocabulary"):
        s.prefill([[1, 2, 3], [4, 256]])
    _assert_unchanged(s, before)
    _check_same_next_decode(s, ref)


# =============================================================================== metadata
def test_build_metadata_mismatched_lengths():
    with pytest.raises(ValueError, match="metadata lengths differ"):
        build_metadata([0, 1], [0], [3, 4], [[0], [1]], 4)
    with pytest.raises(ValueError, match="metadata lengths differ"):
        build_metadata([0, 1], [0, 0], [3, 4], [[0]], 4)
    with pytest.raises(ValueError, match="metadata lengths differ"):
        build_metadata([0], [0], [3, 4], [[0]], 4)
    with pytest.raises(ValueError, match="query length 0"):
        build_metadata([0], [0], [0], [[0]], 4)
    with pytest.raises(ValueError, match="max_blocks"):
        build_metadata([0], [0], [3], [[0, 1, 2]], 2)


# =============================================================================== types at the boundary
@pytest.mark.parametrize("chunk, what", [([1.5, 2.0], r"chunks\[0\] must hold integers.*1\.5"),
                                         ("12", r"chunks\[0\] must be .*str"),
                                         ([True], r"chunks\[0\] must hold integers.*True")])
def test_extend_rejects_non_integer_ids_without_coercing(tiny_model, chunk, what):
    """int(1.5) would silently be 1 and "12" would become [1, 2]: both are refused, nothing
    changes, and the other sequence's next decode is the clean twin's."""
    s, ref = _twins(tiny_model, PROMPTS, **KW)
    before = _state(s)
    with pytest.raises(TypeError, match=what):
        s.extend([0], [chunk])
    _assert_unchanged(s, before)
    _check_same_next_decode(s, ref)


def test_decode_takes_a_flat_list_of_one_token_per_sequence(tiny_model):
    """Session.decode's [B] form as a plain list: the same step as the [B, 1] tensor."""
    s, ref = _twins(tiny_model, PROMPTS, **KW)
    assert torch.equal(s.decode([7, 11]), ref.decode(torch.tensor([[7], [11]])))
    with pytest.raises(TypeError, match=r"ids must hold integers.*2\.5"):
        s.decode([7, 2.5])


def test_meta_tensor_ids_are_a_clear_error(tiny_model):
    s, ref = _twins(tiny_model, PROMPTS, **KW)
    before = _state(s)
    with pytest.raises(ValueError, match="meta tensor"):
        s.prefill(torch.zeros(2, 4, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="meta tensor"):
        s.decode(torch.zeros(2, 1, dtype=torch.long, device="meta"))
    _assert_unchanged(s, before)
    _check_same_next_decode(s, ref)


@pytest.mark.parametrize("kw, what", [(dict(block_size=0), "block_size must be a positive integer"),
                                      (dict(max_batch_size=0), "max_batch_size must be a positive integer"),
                                      (dict(num_blocks=0), "num_blocks must be a positive integer"),
                                      (dict(max_seq_len=2.5), "max_seq_len must be a positive integer")])
def test_session_sizes_are_checked(tiny_model, kw, what):
    with pytest.raises(ValueError, match=what):
        Session(tiny_model, **{**KW, **kw})


def test_release_of_an_unknown_sequence_is_a_clear_error(tiny_model):
    s, ref = _twins(tiny_model, PROMPTS, **KW)
    before = _state(s)
    with pytest.raises(ValueError, match=r"release: sequence id 999 outside 0\.\.1"):
        s.release(999)
    _assert_unchanged(s, before)
    _check_same_next_decode(s, ref)


# =============================================================================== the model contract
def _contract_step(s: Session, n_tokens=3):
    """(input_ids, positions, metadata) of a valid one-sequence step of n tokens on a free slot."""
    meta = build_metadata([1], [0], [n_tokens], [[s.allocator.num_free - 1]], s.max_blocks)
    return torch.arange(n_tokens) + 5, torch.arange(n_tokens), meta


@pytest.mark.parametrize("change, error, what", [
    (lambda i, p, m: (i.float(), p, m), TypeError, r"input_ids must be an integer tensor \(int32 or int64\), got torch\.float32"),
    (lambda i, p, m: (i.bool(), p, m), TypeError, r"input_ids must be an integer tensor \(int32 or int64\), got torch\.bool"),
    (lambda i, p, m: (i[None], p, m), ValueError, r"input_ids must be 1-D \[N\].*\[1, 3\]"),
    (lambda i, p, m: (i, p.double(), m), TypeError, r"positions must be an integer tensor"),
    (lambda i, p, m: (i, torch.arange(4), m), ValueError, r"positions has 4 entries but input_ids 3"),
    (lambda i, p, m: (i[:2], p[:2], m), ValueError, r"metadata\.token_seq has shape \[3\]; dim 0 must be its tokens count 2"),
    (lambda i, p, m: (i.tolist(), p, m), TypeError, r"input_ids must be a torch\.Tensor, got list"),
    (lambda i, p, m: (i, p, None), TypeError, r"metadata must be an AttentionMetadata, got NoneType"),
])
def test_model_contract_inputs_are_checked_at_the_boundary(tiny_model, change, error, what):
    """model(input_ids, positions, caches, metadata) with float / 2-D ids, mismatched lengths or
    no metadata: an error naming the argument and the rule, raised before any layer ran (no
    cache written: the next decode of the running sequences is the clean twin's)."""
    s, ref = _twins(tiny_model, PROMPTS, **KW)
    before = _state(s)
    ids, pos, meta = change(*_contract_step(s))
    with pytest.raises(error, match=what):
        tiny_model(ids, pos, s.caches, meta)
    _assert_unchanged(s, before)
    _check_same_next_decode(s, ref)


# =============================================================================== configs
@pytest.mark.parametrize("field, value, error, what", [
    ("sliding_window", 0, ValueError, r"'sliding_window': must be > 0, got 0"),
    ("head_dim", 48, ValueError, r"'head_dim': must be a multiple of the quantization block 32"),
    ("o_groups", 3, ValueError, r"'o_groups': must divide num_attention_heads \(4\), got 3"),
    ("hidden_size", -64, ValueError, r"'hidden_size': must be > 0, got -64"),
    ("index_topk", -1, ValueError, r"'index_topk': must be > 0, got -1"),
    ("num_experts_per_tok", -1, ValueError, r"'num_experts_per_tok': must be > 0, got -1"),
    ("num_experts_per_tok", 5, ValueError, r"'num_experts_per_tok': must be at most n_routed_experts \(4\)"),
    ("qk_rope_head_dim", 15, ValueError, r"'qk_rope_head_dim': must be even"),
    ("engram_pad_token_id", 256, ValueError, r"'engram_pad_token_id': must be a token id below vocab_size \(256\)"),
    ("rms_norm_eps", float("nan"), ValueError, r"'rms_norm_eps': must be a finite number >= 0"),
    ("scoring_func", "softmax", ValueError, r"'scoring_func': must be one of \['sqrtsoftplus'\]"),
    ("hidden_size", "64", TypeError, r"'hidden_size' must be int, got str '64'"),
    ("vocab_size", 256.0, TypeError, r"'vocab_size' must be int, got float"),
    ("fake_quant", 1, TypeError, r"'fake_quant' must be bool, got int"),
    ("compress_ratios", [0, 0, 2.0], TypeError, r"'compress_ratios' must be a list of ints"),
])
def test_config_fields_are_validated_at_construction(field, value, error, what):
    """A config that would build and then fail in the first forward, or run with nonsense, is
    refused when it is made (by any route: constructor, tiny(**overrides), dataclasses.replace)."""
    import dataclasses
    with pytest.raises(error, match=what):
        v41graph.V41Config.tiny(**{field: value})
    with pytest.raises(error, match=what):
        dataclasses.replace(v41graph.V41Config.tiny(), **{field: value})


def test_config_json_with_a_string_for_a_number_names_file_and_field(tmp_path):
    import json
    raw = v41graph.V41Config.tiny().to_hf_dict()
    raw["num_attention_heads"] = "4"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(TypeError, match=r"config\.json: config field 'num_attention_heads' must be int, got str '4'"):
        v41graph.V41Config.from_json(tmp_path)


def test_checkpoint_config_round_trip_keeps_hf_keys_and_leaves_ours_out(tmp_path):
    """save_pretrained writes config.json as released (keys v41graph does not use kept, its own
    settings left out) and v41graph.json with those settings; from_json reads both back."""
    import json
    cfg = v41graph.V41Config.from_dict({**v41graph.V41Config.tiny().to_hf_dict(), "pad_token_id": 1,
                                        "bos_token_id": 0, "eos_token_id": 1, "model_type": "deepseek_v41",
                                        "architectures": ["DeepseekV41ForCausalLM"], "fake_quant": False,
                                        "weight_format": "dense"})
    cfg.save_pretrained(tmp_path)
    official = json.loads((tmp_path / "config.json").read_text())
    assert {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 1, "model_type": "deepseek_v41",
            "architectures": ["DeepseekV41ForCausalLM"]}.items() <= official.items()
    assert "fake_quant" not in official and "weight_format" not in official and "extra" not in official
    assert json.loads((tmp_path / "v41graph.json").read_text()) == {"fake_quant": False, "weight_format": "dense"}
    assert v41graph.V41Config.from_json(tmp_path) == cfg
    (tmp_path / "v41graph.json").write_text(json.dumps({"fake_quant": False, "hidden_size": 8}))
    with pytest.raises(ValueError, match=r"v41graph\.json: unknown v41graph settings \['hidden_size'\]"):
        v41graph.V41Config.from_json(tmp_path)
