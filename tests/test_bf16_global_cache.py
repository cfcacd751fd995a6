"""The BF16 global-cache comparison variant (the seed's P2 asks for FP4-native attention; this is
the format a BF16-only kernel would need, kept so benchmarks can compare the two)."""
import pytest
import torch

import v41graph
from v41graph.model.kv_cache import ModelCaches
from v41graph.model.metadata import build_metadata, positions_of
from v41graph.model.model import V41Model, init_random_

ops = torch.ops.v41graph


def test_write_then_gather_is_exact_and_skips_minus_one():
    cache = torch.full((3, 4, 32), 7.0, dtype=torch.bfloat16)
    scale = torch.zeros(3, 4, 0, dtype=torch.uint8)
    kv = torch.randn(5, 32)
    slots = torch.tensor([0, -1, 5, 11, -1])
    ops.global_kv_write(cache, scale, kv, slots)
    flat = cache.view(-1, 32)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], kv[i].to(torch.bfloat16))
    untouched = [r for r in range(12) if r not in (0, 5, 11)]
    assert (flat[untouched] == 7.0).all()
    from v41graph.custom_ops.reference import gather_global_kv
    got = gather_global_kv(cache, scale, torch.tensor([[5, 0], [11, -1]]), torch.float32)
    assert torch.equal(got[0, 0], kv[2].to(torch.bfloat16).float())
    assert torch.equal(got[1, 0], kv[3].to(torch.bfloat16).float())


def test_bad_cache_dtype_is_rejected():
    with pytest.raises(ValueError, match="global_kv_dtype"):
        ModelCaches.allocate(v41graph.V41Config.tiny(), 2, 4, 16, global_kv_dtype=torch.float16)


def _teacher_forced_logits(model, caches, prompt, n_prefill):
    """Prefill prompt[:n_prefill], then decode the rest of the prompt one token at a time."""
    table = [list(range(caches.num_blocks))]
    width = caches.num_blocks
    meta = build_metadata([0], [0], [n_prefill], table, width)
    logits = [model(prompt[:n_prefill], positions_of(meta), caches, meta)]
    for t in range(n_prefill, prompt.shape[0]):
        meta = build_metadata([0], [t], [1], table, width)
        logits.append(model(prompt[t:t + 1], positions_of(meta), caches, meta))
    return torch.cat(logits)


def test_model_runs_on_a_bf16_global_cache_close_to_fp4():
    """Same model, same tokens: the BF16 cache skips the FP4 quantization of the global rows, so
    logits move (not at all would mean the variant is not in use), but by about what FP4's ~10 %
    per-element error gives through this random tiny model (measured 0.17), far from the ~1 of
    reading wrong rows (what diverging greedy tokens give here)."""
    cfg = v41graph.V41Config.tiny()
    model = init_random_(V41Model(cfg), seed=5).eval()
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    runs = {}
    with torch.no_grad():
        for dtype in (torch.uint8, torch.bfloat16):
            caches = ModelCaches.allocate(cfg, 2, 4, 16, global_kv_dtype=dtype)
            runs[dtype] = _teacher_forced_logits(model, caches, prompt, 36)
    fp4, bf16 = runs[torch.uint8], runs[torch.bfloat16]
    rel = (fp4 - bf16).norm() / fp4.norm()
    assert 0.01 < rel < 0.3, rel
