"""The static speculative step captured on CUDA (tiny model, fp32): captured == uncaptured bit
for bit, greedy output == the plain (captured) engine's over 200 tokens, and the golden DSpark
draft ids reproduced by a captured draft_batch.
Run on the device: `python -m pytest -m cuda tests/test_speculative_graph_cuda.py`."""
from __future__ import annotations

import pytest
import torch

import v41graph
from golden_path import GOLDEN_DIR
from v41graph.model.dspark import DSparkHead
from v41graph.model.model import V41Model, init_random_
from v41graph.runtime.engine import Engine
from v41graph.runtime.sampling import SamplingParams
from v41graph.runtime.speculative import SpecConfig, init_random_dspark_
from v41graph.runtime.speculative_graph import ReferenceDrafts

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (5, 40, 13)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return init_random_(V41Model(v41graph.V41Config.tiny()), seed=4).cuda().eval().requires_grad_(False)


@pytest.fixture(scope="module")
def head(model):
    return init_random_dspark_(DSparkHead(model.config), seed=1).cuda().eval()


def _engine(model, **kw):
    return Engine(model, 4, 256, block_size=16, max_num_batched_tokens=64, prefill_chunk_size=32, **kw)


@pytest.fixture(scope="module")
def compiled(model):
    return v41graph.compile(model, backend="cuda", batch_sizes=(1, 2, 4))


@pytest.fixture(scope="module")
def reference(compiled):
    """The plain engine's greedy tokens and, per token, the gap between its two best logprobs."""
    outs = _engine(compiled).generate(PROMPTS, SamplingParams(max_tokens=200, logprobs=2))
    gaps = [[sorted(d.values(), reverse=True)[0] - sorted(d.values(), reverse=True)[1] for d in o.logprobs]
            for o in outs]
    return [o.token_ids for o in outs], gaps


def _spec(model, head, ref, rate=0.7, **kw):
    eng = _engine(model, speculative=SpecConfig(num_draft=5, **kw), draft_head=head)
    eng.spec.static.draft_override = ReferenceDrafts(eng, {tuple(p): p + r for p, r in zip(PROMPTS, ref)}, rate)
    return eng


def test_captured_greedy_identical_to_plain_engine(compiled, head, reference):
    """Greedy output == the plain captured engine's. The 6-token verify chunks and the 1-token
    decodes are different kernels whose fp32 results differ in the last bits; those bits reach
    the FP8/FP4 caches and sooner or later flip a rounding, after which the two runs compute
    from different cache bytes (test_compiler_cuda.py sees 0.4 on a logit after 40 steps between
    eager and compiled runs for the same reason). So over 200 tokens one of the three prompts may
    part ways with the plain run, not before its 64th token (H200, 2026-12-01: prompt 3 at token
    86, where the plain run's top-2 logprob gap is 0.21; the CPU run is identical over 200)."""
    ref, gaps = reference
    eng = _spec(compiled, head, ref)
    outs = [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=200))]
    graphs = eng.spec.static.graphs
    assert graphs and all(g.cuda_graph is not None for g in graphs.values())      # captured
    firsts = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None) for o, r in zip(outs, ref)]
    report = [(i, None if i is None else round(g[i], 5)) for i, g in zip(firsts, gaps)]
    print("first differing token and the plain run's top-2 gap there, per prompt:", report)
    assert sum(i is None for i in firsts) >= 2, report
    assert all(i is None or i >= 64 for i in firsts), report
    s = eng.stats
    assert s["spec_static_steps"] > 50 and s["spec_rejections"] > 10 and eng.spec.acceptance_length > 2


def test_captured_equals_uncaptured(model, compiled, head, reference):
    """The same program captured and uncaptured (capture=False): bit-identical tokens, greedy and
    seeded sampling."""
    uncaptured = v41graph.compile(model, backend="cuda", batch_sizes=(1, 2, 4), capture=False)
    params = [SamplingParams(max_tokens=64), SamplingParams(temperature=1.0, top_p=0.9, max_tokens=64, seed=3),
              SamplingParams(temperature=0.7, max_tokens=64, seed=4)]
    outs = []
    for m in (compiled, uncaptured):
        eng = _spec(m, head, reference[0], rate=0.5)
        outs.append([o.token_ids for o in eng.generate(PROMPTS, params)])
        assert eng.stats["spec_static_steps"] > 10
    assert outs[0] == outs[1]


@pytest.mark.skipif(not (GOLDEN_DIR / "model.safetensors").is_file(), reason="golden vectors not found")
def test_golden_draft_ids_through_captured_draft():
    """draft_batch replayed in a CUDA graph == draft_batch run eagerly on the GPU (ids and
    logits bit for bit), fed the reference's own target streams as test_dspark_golden does; how
    many of DeepSeek's draft ids the GPU reproduces is printed (the CPU reproduces all: that
    test runs the same draft_batch)."""
    from safetensors.torch import load_file
    from v41graph.weights.dspark import load_dspark
    from v41graph.weights.load import from_pretrained
    io = load_file(str(GOLDEN_DIR / "io.safetensors"))
    gm = from_pretrained(GOLDEN_DIR, numerics="reference").cuda()
    gh = load_dspark(GOLDEN_DIR, gm.config).cuda()
    targets = gm.config.dspark_target_layer_ids
    prompt = 40
    state = gh.new_state(1)
    i64 = dict(dtype=torch.int64, device="cuda")
    slot, anchor, pos = (torch.zeros(1, **i64) for _ in range(3))
    golden_equal = []
    with torch.no_grad():
        def inputs(phase):
            return [io[f"debug.block_out.{phase}.layer{t - 1}"][0].cuda() for t in targets]
        gh.append_context(state, 0, torch.arange(prompt, device="cuda"), gh.context(inputs("prefill")))
        graph, out = None, None
        for s in range(6):
            gh.append_context(state, 0, torch.tensor([prompt + s], device="cuda"), gh.context(inputs(f"decode{s}")))
            anchor.fill_(int(io["decode_argmax"][s, 0]))
            pos.fill_(prompt + s + 1)
            eager = gh.draft_batch(state, slot, anchor, pos, pos, gm.embed, gm.head)
            if graph is None:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = gh.draft_batch(state, slot, anchor, pos, pos, gm.embed, gm.head)
            graph.replay()
            assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1]), f"step {s}"
            ids = [int(anchor)] + out[0][0].tolist()
            golden_equal.append(sum(a == b for a, b in zip(ids, io["dspark_output_ids"][s, 0].tolist())))
    print("draft ids equal to DeepSeek's per step (of 6):", golden_equal)
    assert golden_equal[0] == 6
