"""The `v41graph` command line: compile-and-dump, inspect a dump, serve a checkpoint over HTTP.

    v41graph dump --config tiny --out DIR [--disable P1 ...] [--quiet]
    v41graph inspect DIR [--graph N] [--summary] [--pass NAME] [--diff A B] [--stage S]
                         [--streams] [--fused] [--timeline OUT.png [--layer N]] [--dot OUT.dot] [--svg OUT.svg]
                         [--profile OUT.json [--device D] [--profile-steps N]] [--quiet]
    v41graph serve CHECKPOINT [--host 127.0.0.1] [--port 8000] [--max-batch-size 8] ...   (v41graph/serving)

Also runs as `python -m v41graph.tools.cli ...`. Run `v41graph <command> --help` for every option.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from v41graph.compiler.dump import ALIASES, Entry
from v41graph.tools.profiling import MODEL_FILE

CONFIGS = ("tiny",)

STAGE_HELP = ("A stage is an index into the graph's stage list (0 = input, k = after the k-th pass), "
              f"'input', 'final', a pass name or alias {'/'.join(ALIASES)} (the graph after that pass; "
              "for an alias, after its first pass) or '<pass>.before'.")


_log = logging.getLogger("v41graph.tools.cli")
# MODEL_FILE: what `v41graph dump` built, so `inspect --profile` can build it again
MODEL_SCHEMA = Entry({"config": str, "seed": int, "disable": [str], "prompt_len": int}, {"enable": [str]})


def _progress(msg: str) -> None:
    _log.info("%s", msg)


def _random_model(config: str, seed: int):
    import torch

    from v41graph.model.config import V41Config
    from v41graph.model.model import V41Model, init_random_

    if config not in CONFIGS:
        raise ValueError(f"unknown config {config!r}; choices: {', '.join(CONFIGS)}")
    torch.manual_seed(seed)
    return init_random_(V41Model(getattr(V41Config, config)()), seed=seed).eval().requires_grad_(False)


def _pass_list(enable):
    """compile()'s `passes` for the default passes plus the opt-in ones named in `enable`."""
    from v41graph.passes.pass_manager import DEFAULT_PASSES
    return (*DEFAULT_PASSES, *enable) if enable else None


def run_dump(out, config: str = "tiny", disable=(), seed: int = 0, prompt_len: int = 12,
             progress=_progress, enable=()):
    """Build `config` with random weights, compile it with dump_dir=out, run one prefill (graph
    0) and one decode step (graph 1) so both graphs are dumped. Returns the compiled model.
    The dump traces the two on their own (share_decode_graph=True: bucket 1 static), not as
    compile()'s default one shared symbolic graph: each graph then shows its own concrete
    shapes, and the decode graph is the one a bucket-1 capture runs."""
    import torch

    from v41graph.compiler.compiled_model import compile as v41compile
    from v41graph.runtime.session import Session

    model = _random_model(config, seed)
    cfg = model.config
    compiled = v41compile(model, backend="cpu", passes=_pass_list(enable), disable=tuple(disable),
                          batch_sizes=(1,), dump_dir=str(out), share_decode_graph=True)
    session = Session(compiled, max_batch_size=1, max_seq_len=prompt_len + 2, block_size=16)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    t0 = time.perf_counter()
    progress(f"compiling and running the prefill graph (graph0, {prompt_len} tokens)...")
    logits = session.prefill(prompt)
    progress(f"  done in {time.perf_counter() - t0:.1f} s; compiling and running one decode step (graph1)...")
    t0 = time.perf_counter()
    session.decode(logits.argmax(-1, keepdim=True))
    (Path(out) / MODEL_FILE).write_text(json.dumps(
        {"config": config, "seed": seed, "disable": list(disable), "enable": list(enable), "prompt_len": prompt_len},
        indent=1) + "\n")
    progress(f"  done in {time.perf_counter() - t0:.1f} s; dump written to {out}")
    return compiled


def run_profile(dump_dir, out, device: str | None = None, steps: int = 3) -> dict:
    """Build the model `v41graph dump` recorded in DIR/model.json again (same config, seed and
    passes; no dump written), run a prefill and one decode step (tracing; on CUDA also the
    CUDA-graph capture), then profile `steps` decode steps and write their Chrome trace to `out`.
    On CPU the steps run the same compiled graph uncaptured. Prefill runs eagerly
    (compile_prefill=False): only the decode graph is traced."""
    import torch

    from v41graph.compiler.compiled_model import compile as v41compile
    from v41graph.runtime.session import Session
    from v41graph.tools.graph_dump import DumpError, _read_json, check_entry
    from v41graph.tools.profiling import profile_steps
    from v41graph.weights.load import place_model

    path = Path(dump_dir) / MODEL_FILE
    if not path.is_file():
        raise DumpError(f"{path}: missing; --profile builds the model that `v41graph dump` recorded there "
                        f"again (a dump from compile(dump_dir=...) in a program has none: profile that "
                        f"program with v41graph.tools.profiling.profile_steps)")
    meta = _read_json(path)
    check_entry(meta, MODEL_SCHEMA, str(path))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here")
    model = place_model(_random_model(meta["config"], meta["seed"]), device, engram_device=device)
    compiled = v41compile(model, backend="auto", passes=_pass_list(meta.get("enable", ())),
                          disable=tuple(meta["disable"]), batch_sizes=(1,), compile_prefill=False)
    prompt_len = meta["prompt_len"]
    session = Session(compiled, max_batch_size=1, max_seq_len=prompt_len + steps + 4, block_size=16)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len),
                           generator=torch.Generator().manual_seed(meta["seed"])).to(device)
    tokens = [session.prefill(prompt).argmax(-1, keepdim=True)]

    def step():
        tokens.append(session.decode(tokens[-1]).argmax(-1, keepdim=True))
    _progress(f"profiling {steps} decode steps of the {meta['config']} model on {device} "
              f"(after one step that traces{' and captures' if compiled.platform == 'cuda' else ''})...")
    profile_steps(step, device, steps, trace=out)
    captured = any(g.cuda_graph is not None for g in compiled._decode.values())
    return {"path": str(out), "steps": steps, "device": device, "captured": captured}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="v41graph", description="v41graph: compile DeepSeek-V4.1 with "
                                 "graph dumps, and inspect what every pass did.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{dump,inspect,serve}")

    d = sub.add_parser("dump", help="build a model with random weights, compile it and write a dump",
                       description="Build the model with random weights, compile it with every pass "
                       "(minus --disable) and dump_dir=OUT, and run one prefill and one decode step, so "
                       "OUT/graph0 (prefill) and OUT/graph1 (decode) are written. CPU; ~1 min for tiny.")
    d.add_argument("--config", default="tiny", choices=CONFIGS, help="model size (default: tiny)")
    d.add_argument("--out", required=True, metavar="DIR", help="dump directory to write (created if needed)")
    d.add_argument("--disable", nargs="+", default=[], metavar="PASS",
                   help=f"passes to switch off, by name or alias ({', '.join(ALIASES)}), e.g. --disable P1 P6")
    d.add_argument("--enable", nargs="+", default=[], metavar="PASS",
                   help="opt-in passes to add to the defaults, e.g. --enable P9 (the mHC predictor's side stream)")
    d.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt (default 0)")
    d.add_argument("--prompt-len", type=int, default=12, help="prefill prompt length (default 12)")
    d.add_argument("--quiet", action="store_true", help="no progress lines or bars (errors still print)")

    i = sub.add_parser("inspect", help="read a dump: summary, per-pass changes, diffs, streams, pictures",
                       description="Read a dump directory. Without options prints the per-pass summary. "
                       "Options combine; their outputs print in the order listed here. " + STAGE_HELP,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    i.add_argument("dir", metavar="DIR", help="dump directory (from `v41graph dump` or compile(dump_dir=))")
    i.add_argument("--graph", type=int, default=None, metavar="N",
                   help="which compiled graph (graph<N>/; with `v41graph dump`, 0 = prefill, 1 = decode; "
                        "the summary names each graph); default: graph 0, and every graph for the summary")
    i.add_argument("--summary", action="store_true",
                   help="Markdown table per graph (only graph N with --graph N): matched count, node counts, "
                        "added/removed/moved nodes, fused ops and time of every pass")
    i.add_argument("--pass", dest="pass_name", metavar="NAME",
                   help=f"one pass (name or {'/'.join(ALIASES)}; for an alias, its first pass): its record "
                        "(matched count, nodes added, removed, moved to side streams, fused ops) and the diff "
                        "of the graph before and after it")
    i.add_argument("--diff", nargs=2, metavar=("A", "B"),
                   help="unified diff between stages A and B (an unlabelled node counts as on the main "
                        "stream, so only real changes and moves to side streams differ)")
    i.add_argument("--stage", metavar="S", help="print the readable graph of stage S")
    i.add_argument("--streams", action="store_true",
                   help="final graph's streams: nodes per stream, fork/join regions, event record -> wait pairs")
    i.add_argument("--fused", action="store_true", help="every fused op and the node names it replaced")
    i.add_argument("--timeline", metavar="OUT.png",
                   help="draw the stream timeline (one lane per stream, nodes in execution order, event "
                        "arrows record -> wait) as a PNG; needs matplotlib (pip install 'v41graph[viz]')")
    i.add_argument("--layer", type=int, metavar="N",
                   help="restrict --timeline / --dot / --svg to block N (module path layers.N) and its side regions")
    i.add_argument("--dot", metavar="OUT.dot", help="write Graphviz DOT text of the final graph (no extra packages)")
    i.add_argument("--svg", metavar="OUT.svg",
                   help="render the Graphviz picture as SVG (needs pydot and a Graphviz dot: pip install 'v41graph[viz]')")
    i.add_argument("--profile", metavar="OUT.json",
                   help="build the dumped model again (DIR/model.json, written by `v41graph dump`), run decode "
                        "steps (captured on CUDA, the uncaptured graph on CPU) under torch.profiler and write "
                        "their Chrome/Perfetto trace")
    i.add_argument("--device", help="device for --profile (default: cuda if available, else cpu)")
    i.add_argument("--profile-steps", type=int, default=3, metavar="N", help="decode steps --profile records")
    i.add_argument("--quiet", action="store_true", help="no progress lines or bars (errors still print)")

    s = sub.add_parser("serve", help="serve a checkpoint over HTTP (OpenAI-compatible API)",
                       description="Load CHECKPOINT and serve /v1/completions, /v1/chat/completions "
                       "(streaming and not), /v1/models and /health with FastAPI + uvicorn; needs "
                       "pip install 'v41graph[serve]'.")
    from v41graph.serving.options import add_serve_arguments
    add_serve_arguments(s)
    return ap


def _inspect(args) -> int:
    from .graph_dump import load_dump, to_dot, write_svg

    dump = load_dump(args.dir)
    g = 0 if args.graph is None else args.graph
    dump.passes(g)                      # a clear error for a bad --graph
    summary_graphs = None if args.graph is None else [g]
    shown = False
    if args.summary:
        print(dump.summary_markdown(summary_graphs))
        shown = True
    if args.pass_name:
        r = dump.pass_record(args.pass_name, g)
        nb, na = r.get("num_nodes_before", "?"), r.get("num_nodes_after", "?")
        print(f"graph {g} pass {r['index']} {r['pass']} (uuid {r.get('uuid', '?')}): matched {r['matched_count']}, "
              f"{nb} -> {na} nodes")
        print(f"  added ({len(r.get('added', []))}): {', '.join(r.get('added', []))}")
        print(f"  removed ({len(r.get('removed', []))}): {', '.join(r.get('removed', []))}")
        if r.get("refused"):
            print(f"  refused (left alone as unsafe): {r['refused']}")
        for s, names in r.get("moved_to_stream", {}).items():
            print(f"  moved to {s} ({len(names)}): {', '.join(names)}")
        for f in r.get("fused", []):
            print(f"  fused {f['node']} = {f['target']} replaced {len(f['replaced'])}: {', '.join(f['replaced'])}")
        print(dump.diff(f"{r['pass']}.before", r["pass"], g) or "  (graph text unchanged)")
        shown = True
    if args.diff:
        print(dump.diff(args.diff[0], args.diff[1], g) or f"stages {args.diff[0]} and {args.diff[1]} are identical")
        shown = True
    if args.stage is not None:
        print(dump.stage(args.stage, g), end="")
        shown = True
    if args.streams:
        print(dump.streams_report(g), end="")
        shown = True
    if args.fused:
        print(dump.fused_report(g), end="")
        shown = True
    if args.timeline:
        info = dump.timeline(args.timeline, graph=g, layer=args.layer)
        print(f"timeline: {info['path']} ({info['nodes']} nodes, {len(info['lanes'])} lanes: "
              f"{', '.join(info['lanes'])}; {info['arrows']} event arrows)")
        shown = True
    if args.dot:
        Path(args.dot).write_text(to_dot(dump, g, args.layer))
        print(f"dot: {args.dot}")
        shown = True
    if args.svg:
        print(f"svg: {write_svg(dump, args.svg, g, args.layer)}")
        shown = True
    if args.profile:
        info = run_profile(args.dir, args.profile, args.device, args.profile_steps)
        print(f"profile: {info['path']} ({info['steps']} decode steps on {info['device']}, "
              f"{'captured' if info['captured'] else 'uncaptured'}; open in ui.perfetto.dev or chrome://tracing)")
        shown = True
    if not shown:
        print(dump.summary_markdown(summary_graphs))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from v41graph.progress import configure_logging

    from .graph_dump import DumpError, MissingDependency

    configure_logging(quiet=getattr(args, "quiet", False))

    try:
        if args.command == "dump":
            import torch
            threads = torch.get_num_threads()
            torch.set_num_threads(1)    # the tiny model's ops are far too small to gain from threads
            try:
                run_dump(args.out, args.config, args.disable, args.seed, args.prompt_len, enable=args.enable)
            finally:
                torch.set_num_threads(threads)
            return 0
        if args.command == "serve":
            if args.role != "both":      # the disaggregated roles: torchrun's launcher, not this server
                from v41graph.serving.options import disagg_role_message
                print(f"v41graph serve: {disagg_role_message(args.role)}", file=sys.stderr)
                return 2
            try:
                from v41graph.serving.server import serve_main
            except ImportError as e:
                raise MissingDependency(f"{e}; v41graph serve needs pip install 'v41graph[serve]'") from None
            return serve_main(args)
        return _inspect(args)
    except (DumpError, MissingDependency, ValueError, FileNotFoundError) as e:
        print(f"v41graph {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
