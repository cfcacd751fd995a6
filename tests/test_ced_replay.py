"""CED decoder bounded replay (MODEL.md §9) vs running every layer over every prompt token."""
import pytest
import torch

import v41graph
from v41graph.model.model import V41Model, init_random_
from v41graph.runtime.session import Session


@pytest.fixture(scope="module")
def model():
    return init_random_(V41Model(v41graph.V41Config.tiny()), seed=3).eval()


def _pair(model, prompt):
    full, replay = (Session(model, 2, 64, block_size=16) for _ in range(2))
    return full, replay, full.prefill(prompt), replay.prefill(prompt, mode="replay")


@pytest.mark.parametrize("length", [5, 8])   # window of tiny() is 8
def test_replay_equals_full_prefill_within_window(model, length):
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(0, 256, (2, length), generator=g)
    full, replay, a, b = _pair(model, prompt)
    assert torch.equal(a, b)
    nxt = torch.randint(0, 256, (2, 1), generator=g)
    assert torch.equal(full.decode(nxt), replay.decode(nxt))


def test_replay_long_prompt_builds_the_same_global_kv(model):
    prompt = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(7))
    full, replay, a, b = _pair(model, prompt)
    # Encoder and decoder-source caches are built from every token in both modes.
    for layer in full.caches.global_kv:
        assert torch.equal(full.caches.global_kv[layer], replay.caches.global_kv[layer]), layer
        assert torch.equal(full.caches.index_k[layer], replay.caches.index_k[layer]), layer
    # Encoder layers' windows agree; the decoder only saw the replay segment, so logits differ.
    dec = model.decoder_start
    for layer in range(dec):
        assert torch.equal(full.caches.window_kv[layer], replay.caches.window_kv[layer]), layer
    assert not torch.equal(a, b)
    assert torch.isfinite(replay.decode(torch.zeros(2, 1, dtype=torch.long))).all()


def test_bad_prefill_mode(model):
    with pytest.raises(ValueError, match="prefill mode"):
        Session(model, 1, 16, block_size=16).prefill(torch.zeros(1, 4, dtype=torch.long), mode="fast")
