"""Text in, text out (v41graph/runtime/text.py, the Engine's text prompts and outputs, the random
checkpoint's tokenizer and the Engram map built from it).

References: the `tokenizers` library's full decode (not its DecodeStream, which the text layer
uses) and transformers' own tokenizer calls on the same folder; stop-string cuts are computed by
brute force over token prefixes."""
from __future__ import annotations

import json
import random

import pytest
import torch

import v41graph
from v41graph.model.engram_hash import build_compressed_token_map
from v41graph.runtime.engine import Engine, RequestError
from v41graph.runtime.sampling import SamplingParams
from v41graph.runtime.text import Tokenizer
from v41graph.weights.random_tokenizer import ASSISTANT, BOS, EOS, PAD, USER

pytest.importorskip("transformers", reason="the text layer loads tokenizers with transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

MULTIBYTE = "café 😀 naïve €5 über"


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return Tokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    from transformers import AutoTokenizer, PretrainedConfig
    return AutoTokenizer.from_pretrained(str(tiny_checkpoint), config=PretrainedConfig())


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return v41graph.from_pretrained(tiny_checkpoint)


def _stream(tok, ids, stop=()):
    """Push ids one by one; returns (the stream, the text after every push)."""
    s = tok.text_stream(stop)
    seen = []
    for t in ids:
        s.push(t)
        seen.append(s.text)
        if s.stopped:
            break
    s.finish()
    return s, seen


# ================================================================================ the tokenizer
def test_random_checkpoint_tokenizer(tiny_checkpoint, tok, hf):
    cfg = v41graph.V41Config.from_json(tiny_checkpoint / "config.json")
    assert len(hf) == cfg.vocab_size == 256
    assert [hf.convert_tokens_to_ids(t) for t in (BOS, EOS, PAD)] == [0, 1, cfg.engram_pad_token_id]
    assert tok.eos_token_id == 1 and tok.bos_token_id == 0
    # a string gets BOS; ASCII round-trips
    ids = tok.encode("Hello, world!")
    assert ids[0] == 0 and tok.decode(ids) == "Hello, world!"
    # the chat template: BOS <User> content <Assistant>
    content = hf("Hi there", add_special_tokens=False)["input_ids"]
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert chat == [0, hf.convert_tokens_to_ids(USER), *content, hf.convert_tokens_to_ids(ASSISTANT)]
    # multi-byte characters: the emoji takes several tokens, each alone an incomplete character
    emoji = hf("😀", add_special_tokens=False)["input_ids"]
    assert len(emoji) > 1 and all("\ufffd" in tok.decode([t]) for t in emoji)
    assert tok.decode(tok.encode(MULTIBYTE)) == MULTIBYTE


# ================================================================================ detokenization
def _id_sequences(tok):
    rng = random.Random(0)
    seqs = [tok.encode(MULTIBYTE)[1:], tok.apply_chat_template([{"role": "user", "content": MULTIBYTE}]),
            tok.encode("😀😀")[1:]]
    seqs += [[rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))] for _ in range(60)]
    return seqs


def test_incremental_detokenization_equals_full_decode(tok, hf):
    for ids in _id_sequences(tok):
        full = tok.backend.decode(ids, skip_special_tokens=True)      # the library's full decode
        assert hf.decode(ids, skip_special_tokens=True) == full
        s, seen = _stream(tok, ids)
        assert s.text == full, ids
        assert all(full.startswith(t) for t in seen), ids            # released text never changes
    # nothing of a multi-byte character is released before its last byte token
    emoji = tok.encode("😀")[1:]
    _, seen = _stream(tok, emoji)
    assert seen == [""] * (len(emoji) - 1) + ["😀"]
    # a generation that ends inside a character shows it as U+FFFD, like the full decode
    s, seen = _stream(tok, emoji[:-1])
    assert seen[-1] == "" and s.text == tok.backend.decode(emoji[:-1]) and "\ufffd" in s.text


def _expected_stop(tok, ids, stops):
    """Brute force: the first token prefix whose decode contains a stop string; the text is that
    decode cut before the earliest occurrence."""
    for k in range(1, len(ids) + 1):
        d = tok.backend.decode(ids[:k], skip_special_tokens=True)
        found = [d.find(s) for s in stops if s in d]
        if found:
            return k, d[:min(found)]
    return None, tok.backend.decode(ids, skip_special_tokens=True)


def test_stop_strings_cut_exactly(tok):
    ids = tok.encode("Hello, how are you today? café 😀 über alles")[1:]
    cases = [["how"], [", h"], ["you", "Hello"], ["😀"], ["é 😀"], ["ü"], ["never there"], ["s"],
             ["today? caf", "are"]]
    for stops in cases:
        k, want = _expected_stop(tok, ids, stops)
        s, seen = _stream(tok, ids, stops)
        assert s.text == want, stops
        assert (s.stop_reason is not None) == (k is not None) and len(seen) == (k or len(ids)), stops
        assert all(want.startswith(t) for t in seen), stops          # no part of a stop string shown
    # random sequences with stop strings taken from their own text
    rng = random.Random(1)
    for ids in _id_sequences(tok)[3:]:
        full = tok.backend.decode(ids, skip_special_tokens=True)
        if len(full) < 4:
            continue
        i = rng.randrange(len(full) - 2)
        stops = [full[i:i + rng.randint(1, 3)]]
        k, want = _expected_stop(tok, ids, stops)
        s, seen = _stream(tok, ids, stops)
        assert k is not None and s.text == want and s.stop_reason == stops[0], (ids, stops)
        assert all(want.startswith(t) for t in seen)


# ================================================================================ the engine
def test_engine_text_prompts_and_outputs(model, tok, hf):
    eng = Engine(model, 4, 96, block_size=16)
    assert eng.tokenizer is not None                   # found in the checkpoint folder
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    prompts = ["Hello world", chat]
    ref_ids = [hf("Hello world")["input_ids"],
               hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)]
    params = SamplingParams(max_tokens=12)
    by_ids = Engine(model, 4, 96, block_size=16, tokenizer=False).generate(ref_ids, params)
    outs = eng.generate(prompts, params)
    for o, ref, ids in zip(outs, by_ids, ref_ids):
        assert o.prompt_token_ids == ids and o.token_ids == ref.token_ids and ref.text is None
        assert o.text == hf.decode(ref.token_ids, skip_special_tokens=True)
    assert eng.num_free_blocks == eng.num_blocks


def test_engine_stop_strings_and_streamed_text(model, tok):
    eng = Engine(model, 4, 96, block_size=16)
    ref = eng.generate(["The quick brown fox"], SamplingParams(max_tokens=16))[0]
    full = ref.text
    # a stop string from the middle of the greedy text, first occurring there
    i = next(j for j in range(len(full) // 2, len(full) - 2)
             if full.find(full[j:j + 2]) == j and "\ufffd" not in full[j:j + 2])
    stop = full[i:i + 2]
    k, want = _expected_stop(tok, ref.token_ids, [stop])
    seen = []
    rid = eng.add_request("The quick brown fox", SamplingParams(max_tokens=16, stop=[stop]),
                          callback=lambda r, new, fin: seen.append(eng.text(r)))
    while eng.has_unfinished():
        eng.step()
    out = eng.release(rid)
    assert out.finish_reason == "stop" and out.text == want == full[:i]
    assert out.token_ids == ref.token_ids[:k]
    assert len(seen) == k and all(want.startswith(t) for t in seen)
    # end of sequence as a stop id: its text is not part of the output
    eos_ids = ref.token_ids[:3] + [tok.eos_token_id]
    assert tok.decode(eos_ids) == tok.decode(ref.token_ids[:3])
    assert eng.num_free_blocks == eng.num_blocks and len(eng.free_slots) == eng.max_batch_size


def test_engine_text_errors(model, tiny_model):
    eng = Engine(model, 2, 64, block_size=16)
    with pytest.raises(RequestError, match="empty prompt"):
        eng.add_request("")
    with pytest.raises(RequestError, match=r"messages\[1\].content must be a string"):
        eng.add_request([{"role": "user", "content": "a"}, {"role": "user", "content": 3}])
    with pytest.raises(RequestError, match="unknown role"):
        eng.add_request([{"role": "robot", "content": "a"}])
    with pytest.raises(TypeError, match="list of prompts"):
        eng.generate("Hello")
    bare = Engine(tiny_model, 2, 64, block_size=16)           # no checkpoint folder: no tokenizer
    assert bare.tokenizer is None
    with pytest.raises(RequestError, match="needs a tokenizer"):
        bare.add_request("Hello")
    with pytest.raises(RequestError, match="stop strings"):
        bare.add_request([1, 2], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="non-empty strings"):
        SamplingParams(stop=[""])
    with pytest.raises(TypeError, match="sequence of strings"):
        SamplingParams(stop="x")
    assert not eng.has_unfinished() and not bare.has_unfinished()


# ================================================================================ Engram's map
def test_engram_map_from_the_checkpoint_tokenizer(tiny_checkpoint, model, hf):
    """The loaded map equals the reference rule applied to transformers' view of the tokenizer,
    and the config's compressed size is the map's."""
    cfg = model.config
    texts = [hf.decode([i], skip_special_tokens=False) for i in range(cfg.vocab_size)]
    raw = hf.convert_ids_to_tokens(list(range(cfg.vocab_size)))
    want, size = build_compressed_token_map(texts, raw)
    assert torch.equal(model.engram_token_map, want)
    assert size == cfg.engram_compressed_vocab_size == json.loads(
        (tiny_checkpoint / "config.json").read_text())["engram_compressed_vocab_size"]
    # counted expectations: case and a leading space fold together; byte tokens stay apart
    vocab = hf.get_vocab()
    folded = [t for t in ("the", "The", "Ġthe") if t in vocab]
    assert len(folded) >= 2 and len({int(want[vocab[t]]) for t in folded}) == 1
    partial = [i for i, t in enumerate(texts) if "\ufffd" in t]
    assert len(partial) >= 4 and len({int(want[i]) for i in partial}) == len(partial)
    assert size < cfg.vocab_size
