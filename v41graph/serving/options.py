"""The `v41graph serve` command-line options (kept apart from server.py so that building the
command line imports no web packages)."""
from __future__ import annotations

__all__ = ["add_serve_arguments", "disagg_role_message"]

DISAGG_LAUNCH = ("python -m torch.distributed.run --nproc-per-node 2 -m v41graph.disagg.launch CHECKPOINT "
                 "--prompt TEXT [--prompt TEXT ...] --max-tokens N")


def disagg_role_message(role: str) -> str:
    """Why `serve --role prefill|decode` does not start a server, and what to run instead."""
    return (f"--role {role}: a prefill or decode worker is one of the two processes of a disaggregated "
            f"run, which talk over torch.distributed and start together (rank 0 prefill, rank 1 decode): "
            f"{DISAGG_LAUNCH}. The HTTP server runs the whole model in one process (--role both, the "
            f"default); an HTTP front end over the two roles is not built yet")


def add_serve_arguments(p) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="checkpoint folder (official layout, with tokenizer.json; "
                        "scripts/make_random_checkpoint.py writes one)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the folder name)")
    p.add_argument("--max-batch-size", type=int, default=8, help="concurrent sequences (default 8)")
    p.add_argument("--max-seq-len", type=int, default=1024, help="context length per request (default 1024)")
    p.add_argument("--block-size", type=int, default=16, help="cache block size in tokens (default 16)")
    p.add_argument("--num-blocks", type=int, default=None, help="cache blocks (default: every slot at max-seq-len)")
    p.add_argument("--device", default=None, help="torch device of the model (default: stay on the CPU)")
    p.add_argument("--numerics", default="fast", choices=("fast", "reference", "released"),
                   help="weight arithmetic: fast (weights dequantized once), reference (DeepSeek's "
                        "blockwise FP8 GEMMs) or released (the same on the checkpoint's FP8 / MXFP4 "
                        "bytes, Triton kernels on CUDA: no dense copy); default fast")
    p.add_argument("--compile", action="store_true",
                   help="decode steps through v41graph.compile (captured CUDA graphs on a GPU), every "
                        "bucket compiled before the server starts listening (slow start)")
    p.add_argument("--compile-prefill", action="store_true",
                   help="with --compile: prefill and mixed steps compiled too (default: eager)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="with --compile: the persistent compile cache (default $V41GRAPH_COMPILE_CACHE): "
                        "a restart loads the traced graphs from DIR instead of tracing them again")
    p.add_argument("--parallel", default=None, metavar="tp=N,dp=N,ep=N",
                   help="run as one rank of a torchrun job over this layout (e.g. tp=2,ep=2: "
                        "torchrun --nproc-per-node 2 -m v41graph.tools.cli serve --parallel tp=2,ep=2 ...): "
                        "rank 0 serves HTTP, the other ranks run its steps")
    p.add_argument("--parallel-timeout", type=float, default=120.0, metavar="S",
                   help="with --parallel: seconds a collective may wait for a rank before the job "
                        "ends with an error (default 120)")
    p.add_argument("--role", default="both", choices=("both", "prefill", "decode"),
                   help="both (default): this process serves the whole model. prefill / decode are "
                        "the two processes of a disaggregated run, which v41graph.disagg.launch "
                        "starts under torchrun (serve says how)")
    p.add_argument("--log-level", default="info",
                   help="uvicorn's log level: critical, error, warning, info, debug (default info)")
