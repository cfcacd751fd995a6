"""scripts/bench.py and scripts/plot_bench.py run end to end (tiny config, eager, CPU), and the
roofline floor counts what it says it counts."""
import json
from pathlib import Path

import pytest

import v41graph
from v41graph.model.model import V41Model
from script_loader import load_script


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    """One eager tiny run of scripts/bench.py (decode at batch 1 and 2, one prefill)."""
    out = tmp_path_factory.mktemp("bench")
    bench = load_script("bench")
    assert bench.main(["--config", "tiny", "--device", "cpu", "--batches", "1,2", "--contexts", "40",
                       "--prefill", "16", "--variants", "eager", "--steps", "1", "--warmup", "1",
                       "--profile-cpu", "--out", str(out)]) == 0
    return out / "bench.json"


def test_bench_smoke_run(bench_json):
    rows = json.loads(bench_json.read_text())["rows"]
    assert [(r["kind"], r["batch"]) for r in rows] == [("decode", 1), ("decode", 2), ("prefill", 1)]
    assert all(r["step_ms"] > 0 for r in rows)


def test_bench_writes_a_chrome_trace_of_the_largest_step(bench_json):
    rows = json.loads(bench_json.read_text())["rows"]
    assert [r["profile"] is not None for r in rows if r["kind"] == "decode"] == [False, True]
    trace = Path(rows[1]["profile"]["chrome_trace"])
    assert trace == bench_json.parent / "trace_eager_b2_ctx40.json"
    names = [e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert [names.count(f"v41graph.step{i}") for i in range(4)] == [1, 1, 1, 0]     # 3 profiled steps
    # one sparse attention per layer and step (the eager model's custom op)
    assert names.count("v41graph::sparse_attention") == 3 * v41graph.V41Config.tiny().num_hidden_layers


def test_plot_bench_draws_the_run(bench_json, tmp_path):
    pytest.importorskip("matplotlib", reason="scripts/plot_bench.py needs matplotlib (the [viz] extra)")
    assert load_script("plot_bench").main([str(bench_json), str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_floor_bytes_counts_experts_rows_and_caches():
    bench = load_script("bench")
    cfg = v41graph.V41Config.tiny()
    model = V41Model(cfg)
    routed = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                 if ".experts." in n and ".shared_experts." not in n)
    # one more sequence adds its cache reads, its embedding/Engram rows and more expected experts
    f1, f2 = bench.floor_bytes(model, 1, 64), bench.floor_bytes(model, 2, 64)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    expert_delta = routed * ((1 - (1 - k / e) ** 2) - k / e)
    per_seq = f2 - f1 - expert_delta
    assert per_seq > 0
    # a huge batch reads every expert once: the floor grows linearly in the batch from there
    big = [bench.floor_bytes(model, b, 64) for b in (1000, 1001, 1002)]
    assert abs((big[2] - big[1]) - (big[1] - big[0])) <= 1
    # a longer context adds index-key reads only (window and top-k global rows are bounded)
    assert bench.floor_bytes(model, 1, 4096) > bench.floor_bytes(model, 1, 64)


def test_a_failing_variant_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    bench = load_script("bench")
    real = bench.run_variant

    def run_variant(model, variant, *args):
        if variant == "v41graph":
            raise RuntimeError("capture failed")
        return real(model, variant, *args)
    monkeypatch.setattr(bench, "run_variant", run_variant)
    assert bench.main(["--config", "tiny", "--device", "cpu", "--batches", "1", "--contexts", "40",
                       "--prefill", "0", "--variants", "v41graph,eager", "--steps", "1",
                       "--warmup", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [(r["kind"], r["variant"]) for r in rows] == [("error", "v41graph"), ("decode", "eager")]
    assert rows[0]["error"] == "RuntimeError: capture failed"


def test_bench_released_weights_run_the_released_ops(tmp_path):
    """--weights released builds the checkpoint-format model in numerics="released" (the FP8 /
    MXFP4 bytes as parameters) and runs it; the floor counts those bytes."""
    bench = load_script("bench")
    model = bench.build_model("tiny", "cpu", "released")
    linears = [m for m in model.modules() if isinstance(m, v41graph.model.layers.Linear) and m.fmt != "dense"]
    assert linears and {m.numerics for m in linears} == {"released"}
    dense = bench.build_model("tiny", "cpu", "dense")
    assert bench.floor_bytes(model, 1, 40) < bench.floor_bytes(dense, 1, 40)     # 1-byte / half-byte weights
    assert bench.main(["--config", "tiny", "--weights", "released", "--device", "cpu", "--batches", "1",
                       "--contexts", "40", "--prefill", "0", "--variants", "eager", "--steps", "1",
                       "--warmup", "1", "--no-profile", "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "bench.json").read_text())
    assert run["weights"] == "released" and run["weight_bytes"] == sum(
        p.numel() * p.element_size() for p in model.parameters())


def test_offline_sass_finds_the_innermost_mma_loop():
    """scripts/offline_sass.py's loop finder on a hand-written listing: an outer loop around an
    inner K loop with the MMAs and a second inner loop without them; the K loop's body is
    returned, branch included (no Triton needed)."""
    sass = "\n".join(f"        /*{addr:04x}*/                   {text} ;" for addr, text in [
        (0x00, "MOV R1, R2"),
        (0x10, "LDS R4, [R1]"),          # outer loop starts here
        (0x20, "HMMA.16816.F32.BF16 R8, R4, R6, R8"),   # inner K loop: 0x20-0x40
        (0x30, "IADD3 R1, R1, 0x1, RZ"),
        (0x40, "@!P0 BRA 0x20"),
        (0x50, "FMUL R9, R9, R9"),       # epilogue loop without MMAs: 0x50-0x70
        (0x60, "FADD R9, R9, R9"),
        (0x70, "@P1 BRA 0x50"),
        (0x80, "@P2 BRA 0x10"),          # the outer loop's branch
        (0x90, "EXIT"),
    ])
    loop = load_script("offline_sass").hottest_loop(sass)
    assert loop == ["HMMA.16816.F32.BF16 R8, R4, R6, R8", "IADD3 R1, R1, 0x1, RZ", "@!P0 BRA 0x20"]


def test_profile_diff_lines_up_two_stored_profiles(capsys, tmp_path):
    """scripts/profile_diff.py on the twenty-ninth session's two H100 profiles (docs/): each
    kernel's time per call recomputed here from the raw rows, largest kernels first; a file
    with two profiled variants per row refused without --variant, and files that are not
    bench.py results refused by name."""
    profile_diff = load_script("profile_diff")
    docs = Path(__file__).resolve().parents[1] / "docs"
    old_path, new_path = docs / "bench_rank_h100_s29_profile.json", docs / "bench_rank_h100_s29_mhc.json"

    def sinkhorn_us(path, batch):
        [row] = [r for r in json.loads(path.read_text())["rows"]
                 if r["variant"] == "v41graph" and r["batch"] == batch and r.get("profile")]
        [k] = [k for k in row["profile"]["top_kernels"] if k["name"] == "_mhc_sinkhorn_kernel"]
        return 1000 * k["ms_per_step"] / k["calls_per_step"]

    assert profile_diff.main([str(old_path), str(new_path), "--variant", "v41graph", "--top", "8"]) == 0
    blocks = capsys.readouterr().out.split("\n\n")
    assert [b.splitlines()[0].split(":")[0] for b in blocks] == ["decode ctx 4096 batch 1", "decode ctx 4096 batch 64"]
    for block, batch in zip(blocks, (1, 64)):
        [line] = [ln for ln in block.splitlines() if ln.endswith(" _mhc_sinkhorn_kernel")]
        assert line.split()[-3:-1] == [f"{sinkhorn_us(old_path, batch):.1f}", f"{sinkhorn_us(new_path, batch):.1f}"]
        largest = [max(float(ln.split()[0]), float(ln.split()[1])) for ln in block.splitlines()[2:]]
        assert len(largest) == 8 and largest == sorted(largest, reverse=True)
    with pytest.raises(SystemExit, match="name one with --variant"):
        profile_diff.main([str(new_path), str(new_path)])
    with pytest.raises(SystemExit, match=r"cannot read .*test_bench_script\.py as JSON"):
        profile_diff.main([__file__, str(new_path)])
    not_bench = tmp_path / "other.json"
    not_bench.write_text('{"results": []}')
    with pytest.raises(SystemExit, match=r"other\.json is not a scripts/bench\.py result \(no 'rows' list\)"):
        profile_diff.main([str(not_bench), str(new_path)])
