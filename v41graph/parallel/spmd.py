"""The SPMD runtime: every rank runs the same model calls; rank 0 decides them.

Rank 0 runs the front end as in one process (an `Engine` or a `Session` over its share of the
model: request queue, scheduling, sampling). Its `StepRunner` knows the model is parallel and,
in `call_model` (the one place a step reaches the model), first broadcasts the step to the other
ranks. Those run `follow(model)`: receive each step, rebuild the same tensors on their device
and call their own share of the model with their own caches, until rank 0 says stop. Under
tensor-parallel attention every rank then holds the same (all-gathered) logits; only rank 0
samples.

    with spmd.job(ParallelConfig(tp=2, ep=2)) as state:        # torchrun --nproc-per-node 2 ...
        model = load_parallel_model(path, state)
        outs = spmd.run(model, lambda: Engine(model, 8, 256).generate(prompts, params))
        # rank 0: generate()'s outputs; every other rank: None (it followed rank 0's steps)

The wire, per message (rank 0 -> all):
  * a fixed-size int64 header on a gloo "control" group: the message kind, the runner, the
    decode flag, the metadata's static_key, and the dtype and shape of every tensor of the step
    (input ids, positions, each AttentionMetadata field, a decoder-replay tensor), all known on
    the host, so rank 0 reads nothing back from its device;
  * for a step, one flat int64 tensor with those tensors' values, on the model's process group
    (the device with NCCL: no host round trip on either side).
  Two collectives a step, no pickling; the rare messages (a new runner's cache geometry, a
  failure's text) go as objects. Followers wait for the next header without a time limit (a
  server may idle for hours; a rank 0 that dies closes its connections, which ends the wait
  at once); everything else runs under the process group's timeout (`init_parallel(timeout_s=)`).

Runners: every StepRunner rank 0 builds over a parallel model announces itself ("hello": its
cache slots, blocks and block size, the cache tensors' shapes, the model config and layout);
each follower allocates the same caches for it and checks its own model matches, and rank 0's
constructor raises ValueError naming the follower and the difference if not (config, layout,
numerics, dtype, a compiled model's decode buckets). A follower keeps a runner's caches until
rank 0 stops it. A compiled model's decode warm-up (`StepRunner.spmd.warmup(max_blocks)`, what
`serve --compile` runs) is one more message: every rank compiles and captures its buckets
together, since the warm-up steps run the model's collectives.

Scope: tensor-parallel attention (every rank runs the same batch). A data-parallel-attention
model runs too, but as a replicated batch: every rank runs rank 0's sequences (correct, equal
token counts by construction, no data-parallel speed-up). Rank 0 spreading requests over the dp
ranks (each with its own sequences, steps padded to equal token counts, logits gathered for
sampling) is not built; speculative decoding refuses a parallel model.

Failures: a request the Engine rejects never reaches a broadcast (validation happens before
scheduling), and a step's inputs are checked (shapes, dtypes) on rank 0 before it is sent. An
exception inside a broadcast step (a collective failing because a rank died or timed out, a
model error) breaks the job: rank 0 raises `ParallelJobError` then and on every later step, the
server stops, and the process exits non-zero (`job()` tears the process group down without the
barrier `shutdown()` would wait on). An exception on rank 0 outside a step (in `run`'s lead
function) is sent to the followers as a failure: they raise ParallelJobError naming it. A
follower that fails raises (and exits); rank 0 then fails in its next collective, within the
timeout.

At world size 1 the model has no ParallelState (`V41Model(parallel=...)` drops it), StepRunner
has no leader, and nothing here runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import signal
import sys
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from v41graph.model.kv_cache import ModelCaches
from v41graph.model.metadata import AttentionMetadata
from v41graph.model.model import check_step_inputs
from v41graph.runtime.batch import eager_model, run_model

from .config import ParallelConfig
from .state import DEFAULT_TIMEOUT_S, ParallelState, init_parallel, shutdown

__all__ = ["ParallelJobError", "StepLeader", "abort", "follow", "job", "leader_for", "parse_layout",
           "run", "serve"]

log = logging.getLogger("v41graph.parallel")

T = TypeVar("T")

# Followers wait for rank 0's next message this long (a process group needs some timeout): in
# effect forever, see the module docstring.
IDLE_TIMEOUT = datetime.timedelta(days=3650)

# message kinds (header[0])
HELLO, STEP, STOP, FAIL, WARMUP = 1, 2, 3, 4, 5
_KIND_NAMES = {HELLO: "hello", STEP: "step", STOP: "stop", FAIL: "fail", WARMUP: "warmup"}

# The tensors of a step, in payload order. Each has a header entry (dtype code, ndim, d0, d1).
_META_FIELDS = tuple(f.name for f in AttentionMetadata.tensor_fields())
_STEP_TENSORS = ("input_ids", "positions", *_META_FIELDS, "decoder_replay")
_DTYPES = {torch.int32: 1, torch.int64: 2}            # 0 = absent
_DTYPE_OF = {code: dtype for dtype, code in _DTYPES.items()}
# header: kind, runner id, decode, static_key + 1 (0 = None), replay is an int, that int, then
# four per tensor
_FIXED = 6
HEADER_LEN = _FIXED + 4 * len(_STEP_TENSORS)


class ParallelJobError(RuntimeError):
    """The ranks of a parallel job can no longer run steps together (a rank died, timed out,
    failed in a step, or rank 0 sent a failure). The job has to end."""


def state_of(model) -> ParallelState | None:
    """The ParallelState of a (compiled) model of several ranks, None at world size 1."""
    return getattr(eager_model(model), "parallel", None)


# ---------------------------------------------------------------------------------- the wire
class _Channel:
    """The message transport of this process's job (one per process group, made on first use
    on every rank: creating the control group is a collective)."""

    def __init__(self):
        self.world = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.nccl = dist.get_backend() == "nccl"

    def send_header(self, values: list[int]) -> None:
        dist.broadcast(torch.tensor(values, dtype=torch.int64), 0, group=self.control)

    def recv_header(self) -> list[int]:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.control)
        return header.tolist()

    def send_object(self, obj) -> None:
        dist.broadcast_object_list([obj], 0, group=self.control)

    def recv_object(self):
        box = [None]
        dist.broadcast_object_list(box, 0, group=self.control)
        return box[0]

    def gather_objects(self, obj) -> list:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def payload_device(self, model_device: torch.device) -> torch.device:
        """Where a step's payload travels: with the model's collectives (its GPU under NCCL,
        the host under gloo)."""
        return model_device if self.nccl else torch.device("cpu")

    def broadcast_payload(self, flat: torch.Tensor) -> torch.Tensor:
        dist.broadcast(flat, 0, group=self.world)
        return flat


_channel_: _Channel | None = None


def _channel() -> _Channel:
    global _channel_
    if not dist.is_initialized():
        raise RuntimeError("the SPMD runtime needs the process group of init_parallel (torchrun)")
    if _channel_ is None or _channel_.world is not dist.group.WORLD:    # first use, or a new job
        _channel_ = _Channel()
    return _channel_


def _step_header(runner_id: int, ids, positions, meta: AttentionMetadata, decode: bool,
                 decoder_replay) -> tuple[list[int], list[torch.Tensor]]:
    """(header, tensors in payload order) of a step: shapes and flags from the host only."""
    replay_tensor = decoder_replay if isinstance(decoder_replay, torch.Tensor) else None
    replay_int = None if decoder_replay is None or replay_tensor is not None else int(decoder_replay)
    key = meta.static_key
    header = [STEP, runner_id, int(decode), 0 if key is None else key + 1,
              int(replay_int is not None), replay_int or 0]
    tensors = [ids, positions, *(getattr(meta, f) for f in _META_FIELDS), replay_tensor]
    sent = []
    for name, t in zip(_STEP_TENSORS, tensors):
        if t is None:
            header += [0, 0, 0, 0]
            continue
        if t.dtype not in _DTYPES or t.dim() > 2:
            raise ValueError(f"{name}: a step tensor must be int32/int64 with at most 2 dims, "
                             f"got {t.dtype} {list(t.shape)}")
        shape = list(t.shape) + [0] * (2 - t.dim())
        header += [_DTYPES[t.dtype], t.dim(), *shape]
        sent.append(t)
    return header, sent


def _step_from(header: list[int], flat: torch.Tensor, device) -> dict:
    """The step a header and its payload describe, as call arguments on `device`."""
    flat = flat.to(device)
    values, at = {}, 0
    for i, name in enumerate(_STEP_TENSORS):
        code, ndim, d0, d1 = header[_FIXED + 4 * i:_FIXED + 4 * i + 4]
        if code == 0:
            values[name] = None
            continue
        shape = [d0, d1][:ndim]
        n = 1
        for d in shape:
            n *= d
        values[name] = flat[at:at + n].view(shape).to(_DTYPE_OF[code])
        at += n
    key = header[3] - 1 if header[3] else None
    meta = AttentionMetadata(**{f: values[f] for f in _META_FIELDS}, static_key=key)
    replay = header[5] if header[4] else values["decoder_replay"]
    return dict(ids=values["input_ids"], positions=values["positions"], meta=meta,
                decode=bool(header[2]), decoder_replay=replay)


def _describe_runner(runner, runner_id: int) -> dict:
    """What a follower needs to allocate a runner's caches and check its model against rank 0's."""
    base = eager_model(runner.model)
    return dict(runner=runner_id, num_slots=runner.caches.num_slots, num_blocks=runner.num_blocks,
                block_size=runner.block_size,
                caches=[(tuple(t.shape), str(t.dtype)) for t in runner.caches.tensors()],
                config=dataclasses.asdict(runner.config), layout=base.parallel.config,
                numerics=base.numerics, dtype=str(base.compute_dtype),
                decode_buckets=_decode_buckets(runner.model))


def _decode_buckets(model):
    """A compiled model's decode batch sizes (a decode step is padded to one: its collectives'
    shapes), None for an eager model."""
    sizes = getattr(model, "batch_sizes", None)
    return None if sizes is None else tuple(sizes)


def _check_against(info: dict, model, rank: int) -> str | None:
    """Why this rank's model cannot follow rank 0's runner `info` (None: it can)."""
    base = eager_model(model)
    mine = dataclasses.asdict(base.config)
    diff = [k for k in sorted(set(mine) | set(info["config"])) if mine.get(k) != info["config"].get(k)]
    if diff:
        k = diff[0]
        return (f"rank {rank}'s model config differs from rank 0's in {', '.join(diff[:5])} "
                f"({k}: {mine.get(k)!r} here, {info['config'].get(k)!r} on rank 0)")
    if base.parallel.config != info["layout"]:
        return f"rank {rank}'s layout is {base.parallel.config}, rank 0's is {info['layout']}"
    here = {"numerics": base.numerics, "dtype": str(base.compute_dtype), "decode_buckets": _decode_buckets(model)}
    for what, value in here.items():
        if value != info[what]:
            return f"rank {rank}'s model {what} is {value}, rank 0's is {info[what]}"
    return None


# ---------------------------------------------------------------------------------- rank 0
class StepLeader:
    """Rank 0's end of the wire (one per process): announces runners, broadcasts steps, stops
    the followers. `broken` holds why the job cannot go on, once it cannot."""

    def __init__(self, state: ParallelState):
        self.state = state
        self.channel = _channel()
        self.broken: str | None = None
        self.stopped = False
        self._next_runner = 0
        self.steps = 0

    def _usable(self) -> None:
        if self.broken is not None:
            raise ParallelJobError(f"the parallel job is broken ({self.broken}); it cannot run more steps")
        if self.stopped:
            raise ParallelJobError("the followers were stopped (spmd.run ended): this job runs no more steps")

    def _fail(self, what: str, e: BaseException) -> ParallelJobError:
        self.broken = f"{what} failed: {type(e).__name__}: {e}"
        log.error("rank 0: %s", self.broken)
        return ParallelJobError(f"rank 0 of {self.state.config.describe()}: {self.broken}; the ranks are "
                                "out of step and the job has to end (a rank that died, failed or timed "
                                "out says why in its own log)")

    def hello(self, runner) -> int:
        """Announce a new runner; every follower allocates its caches. Raises ValueError naming
        a follower whose model does not match rank 0's."""
        self._usable()
        runner_id = self._next_runner
        self._next_runner += 1
        try:
            self.channel.send_header([HELLO, runner_id] + [0] * (HEADER_LEN - 2))
            self.channel.send_object(_describe_runner(runner, runner_id))
            problems = [p for p in self.channel.gather_objects(None) if p is not None]
        except Exception as e:   # noqa: BLE001  (a rank went away: the job is over)
            raise self._fail("announcing a step runner", e) from e
        if problems:
            raise ValueError("the ranks' models do not match: " + "; ".join(problems))
        return runner_id

    def step(self, runner, runner_id: int, ids, positions, meta, decode: bool, decoder_replay=None):
        """Broadcast one step, then run it here; the logits of rank 0's model call."""
        self._usable()
        check_step_inputs(ids, positions, meta)     # bad inputs fail here, before any rank runs
        header, tensors = _step_header(runner_id, ids, positions, meta, decode, decoder_replay)
        try:
            self.channel.send_header(header)
            flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])
            self.channel.broadcast_payload(flat.to(self.channel.payload_device(runner.device)))
            logits = run_model(runner.model, runner.caches, ids, positions, meta, decode=decode,
                               decoder_replay=decoder_replay)
        except Exception as e:   # noqa: BLE001  (the other ranks are mid-step: the job is over)
            raise self._fail(f"step {self.steps}", e) from e
        self.steps += 1
        return logits

    def warmup(self, runner, runner_id: int, max_blocks: int) -> None:
        """Every rank compiles (and on CUDA captures) its compiled model's decode buckets for
        this runner's caches, together: the warm-up steps run the model's collectives."""
        self._usable()
        try:
            self.channel.send_header([WARMUP, runner_id, max_blocks] + [0] * (HEADER_LEN - 3))
            runner.model.warmup(runner.caches, max_blocks)
        except Exception as e:   # noqa: BLE001
            raise self._fail("the decode warm-up", e) from e

    def stop(self, failure: str | None = None) -> None:
        """Tell the followers to leave `follow` (with `failure`: to raise ParallelJobError
        naming it). Nothing is sent once the job is broken or stopped."""
        if self.broken is not None or self.stopped:
            return
        self.stopped = True
        try:
            if failure is None:
                self.channel.send_header([STOP] + [0] * (HEADER_LEN - 1))
            else:
                self.channel.send_header([FAIL] + [0] * (HEADER_LEN - 1))
                self.channel.send_object(failure)
        except Exception as e:   # noqa: BLE001
            raise self._fail("stopping the followers", e) from e


class _RunnerLink:
    """A StepRunner's handle on the leader (StepRunner.spmd)."""

    def __init__(self, leader: StepLeader, runner):
        self.leader, self.runner = leader, runner
        self.runner_id = leader.hello(runner)

    def call_model(self, ids, positions, meta, *, decode: bool, decoder_replay=None):
        return self.leader.step(self.runner, self.runner_id, ids, positions, meta, decode, decoder_replay)

    def warmup(self, max_blocks: int) -> None:
        """CompiledModel.warmup on every rank (the runner's model must be a CompiledModel, and
        so must the model each follower follows with, built with the same batch sizes)."""
        if not hasattr(self.runner.model, "warmup"):
            raise ValueError("warmup: the runner's model is not a compiled model (v41graph.compile)")
        self.leader.warmup(self.runner, self.runner_id, max_blocks)


_leader_: StepLeader | None = None


def _leader(state: ParallelState) -> StepLeader:
    global _leader_
    if _leader_ is None or _leader_.channel is not _channel() or _leader_.stopped:
        _leader_ = StepLeader(state)
    return _leader_


def leader_for(runner) -> _RunnerLink:
    """The link a StepRunner over a model of several ranks makes its model calls through (rank
    0 only: every other rank follows)."""
    state = state_of(runner.model)
    if state.rank != 0:
        raise ValueError(f"rank {state.rank} of {state.config.describe()}: only rank 0 runs a Session or "
                         "Engine; the other ranks run v41graph.parallel.spmd.follow(model) (or spmd.run), "
                         "which makes the model calls rank 0 broadcasts")
    return _RunnerLink(_leader(state), runner)


# ---------------------------------------------------------------------------------- ranks > 0
def follow(model) -> int:
    """Run the steps rank 0 broadcasts on this rank's share of the model until rank 0 stops;
    returns the number of steps run. Raises ParallelJobError if rank 0 fails or goes away, or
    if a step fails here (then rank 0's next collective fails too)."""
    state = state_of(model)
    if state is None:
        raise ValueError("follow(model): the model is not parallel (build it with a ParallelState "
                         "of world size > 1: shard_model / load_parallel_model)")
    if state.rank == 0:
        raise ValueError("follow(model) runs on ranks > 0; rank 0 runs the Engine / Session (see spmd.run)")
    channel = _channel()
    device = eager_model(model).embed.weight.device
    config = eager_model(model).config
    runners: dict[int, ModelCaches] = {}
    steps = 0
    where = f"rank {state.rank} of {state.config.describe()}"
    while True:
        try:
            header = channel.recv_header()
        except Exception as e:   # noqa: BLE001  (rank 0 closed its connections)
            raise ParallelJobError(f"{where}: lost rank 0 while waiting for its next step "
                                   f"(after {steps} steps): {type(e).__name__}: {e}") from e
        kind = header[0]
        try:
            if kind == STOP:
                return steps
            if kind == FAIL:
                raise ParallelJobError(f"{where}: rank 0 failed: {channel.recv_object()}")
            if kind == HELLO:
                info = channel.recv_object()
                problem = _check_against(info, model, state.rank)
                if problem is None:
                    caches = ModelCaches.allocate(config, info["num_slots"], info["num_blocks"],
                                                  info["block_size"], device)
                    layout = [(tuple(t.shape), str(t.dtype)) for t in caches.tensors()]
                    if layout != [tuple(c) for c in info["caches"]]:
                        problem = f"rank {state.rank}'s caches differ from rank 0's for the same geometry"
                    else:
                        runners[info["runner"]] = caches
                channel.gather_objects(problem)
                continue
            if kind == WARMUP:
                if not hasattr(model, "warmup"):
                    raise ParallelJobError(f"{where}: rank 0 warms up compiled decode buckets but this "
                                           "rank follows with an uncompiled model")
                model.warmup(runners[header[1]], header[2])
                continue
            if kind != STEP:
                raise ParallelJobError(f"{where}: unknown message kind {kind} from rank 0")
            flat = torch.empty(sum(_numel(header, i) for i in range(len(_STEP_TENSORS))), dtype=torch.int64,
                               device=channel.payload_device(device))
            flat = channel.broadcast_payload(flat)
            step = _step_from(header, flat, device)
            caches = runners.get(header[1])
            if caches is None:
                raise ParallelJobError(f"{where}: a step of runner {header[1]}, which this rank never set up")
            run_model(model, caches, **step)
            steps += 1
        except ParallelJobError:
            raise
        except Exception as e:   # noqa: BLE001  (this rank cannot go on: end the job)
            log.exception("%s: %s message %d failed", where, _KIND_NAMES.get(kind, kind), steps)
            raise ParallelJobError(f"{where}: {_KIND_NAMES.get(kind, kind)} message failed after {steps} "
                                   f"steps: {type(e).__name__}: {e}") from e


def _numel(header: list[int], i: int) -> int:
    code, ndim, d0, d1 = header[_FIXED + 4 * i:_FIXED + 4 * i + 4]
    if code == 0:
        return 0
    return d0 if ndim == 1 else d0 * d1 if ndim == 2 else 1


# ---------------------------------------------------------------------------------- both
def run(model, lead: Callable[[], T]) -> T | None:
    """Run `lead()` on rank 0 (it builds Engines / Sessions over `model` and drives them) while
    every other rank follows its steps; afterwards the followers are stopped. Returns lead()'s
    result on rank 0 and None elsewhere. At world size 1 it is just lead(). If lead() raises,
    the followers get the failure (and raise ParallelJobError) and rank 0 raises it again."""
    state = state_of(model)
    if state is None:
        return lead()
    if state.rank != 0:
        follow(model)
        return None
    try:
        result = lead()
    except BaseException as e:
        if _leader_ is not None and _leader_.broken is None:
            try:
                _leader(state).stop(failure=f"{type(e).__name__}: {e}")
            except ParallelJobError:
                log.exception("rank 0: telling the followers about the failure failed")
        raise
    _leader(state).stop()
    return result


def abort() -> None:
    """Leave a failed job without waiting for the other ranks (no barrier): abort the process
    group (NCCL's communicators included). Use instead of shutdown() after an error."""
    global _channel_, _leader_
    _channel_ = _leader_ = None
    if not dist.is_initialized():
        return
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:   # noqa: BLE001  (older torch, or a backend without abort)
        dist.destroy_process_group()


@contextlib.contextmanager
def job(config: ParallelConfig, backend: str | None = None, device=None, timeout_s: float = DEFAULT_TIMEOUT_S):
    """init_parallel(...) as a context: yields the ParallelState; on leaving, shutdown() (a
    barrier, then the process group destroyed) or, after an exception, abort() (no barrier: the
    other ranks may be gone) before the exception goes on."""
    global _channel_, _leader_
    state = init_parallel(config, backend=backend, device=device, timeout_s=timeout_s)
    try:
        yield state
    except BaseException:
        abort()
        raise
    _channel_ = _leader_ = None
    shutdown()


def parse_layout(text: str) -> ParallelConfig:
    """ "tp=2,ep=2" -> ParallelConfig(tp=2, ep=2) (the names of ParallelConfig's fields)."""
    names = [f.name for f in dataclasses.fields(ParallelConfig)]
    values = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in names:
            raise ValueError(f"--parallel {text!r}: {part!r} is not NAME=N with NAME one of {', '.join(names)} "
                             "(e.g. tp=2,ep=2)")
        if key in values:
            raise ValueError(f"--parallel {text!r}: {key} given twice")
        try:
            values[key] = int(value)
        except ValueError:
            raise ValueError(f"--parallel {text!r}: {key}={value!r} is not an integer") from None
    if not values:
        raise ValueError(f"--parallel {text!r}: give at least one of {', '.join(names)} (e.g. tp=2)")
    return ParallelConfig(**values)


# ---------------------------------------------------------------------------------- serving
def serve(args) -> int:
    """`v41graph serve --parallel tp=2,... CHECKPOINT` on one rank of a torchrun job: every rank
    loads its share of the checkpoint; rank 0 serves HTTP (the Engine), the others follow.
    Returns the exit status: 0 after a clean stop (SIGINT / SIGTERM to rank 0: it stops the
    followers), 1 after a failure of the job."""
    layout = parse_layout(args.parallel)
    if layout.attention == "dp":
        raise ValueError(f"serve --parallel {args.parallel}: data-parallel attention is not served yet (rank 0 "
                         "would have to split the requests over the dp ranks and keep their steps the same "
                         "size); use a tensor-parallel layout (tp=N, ep=1 or N)")
    device = args.device
    if device is not None and torch.device(device).type == "cuda" and torch.device(device).index is None:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"    # one GPU per rank
        torch.cuda.set_device(torch.device(device))
    if args.compile_prefill and not args.compile:
        raise ValueError("--compile-prefill only applies with --compile")
    try:
        with job(layout, device=device, timeout_s=args.parallel_timeout) as state:
            from .build import load_parallel_model
            model = load_parallel_model(args.checkpoint, state, numerics=args.numerics, device=device)
            if state.rank != 0:
                if args.compile:       # the same buckets as rank 0's, warmed up when rank 0 does
                    from v41graph.serving.server import compiled_for_serving
                    model = compiled_for_serving(model, args.max_batch_size, args.compile_prefill)
                # Driven by rank 0: Ctrl-C (SIGINT to the whole process group) or torchrun's
                # SIGTERM reach rank 0, which stops the followers cleanly.
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                steps = follow(model)
                log.info("rank %d: stopped by rank 0 after %d steps", state.rank, steps)
                return 0
            return _serve_rank0(args, model, state)
    except (ParallelJobError, dist.DistError) as e:    # DistError: e.g. a rank that never joined
        rank = os.environ.get("RANK", "?")
        print(f"v41graph serve --parallel {args.parallel} (rank {rank}): error: {e}", file=sys.stderr)
        return 1


def _serve_rank0(args, model, state) -> int:
    from v41graph.serving.server import build_server

    def terminate(signum, frame):
        raise KeyboardInterrupt    # uvicorn re-raises SIGTERM after its graceful shutdown

    server, app = build_server(args, model=model)
    loop = app.state.engine_loop
    loop.on_fatal = lambda: setattr(server, "should_exit", True)
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    loop.stop(timeout=None)     # the engine thread is done before the followers are stopped
    if loop.fatal is not None:
        raise ParallelJobError(f"rank 0: serving stopped: {loop.fatal}")
    _leader(state).stop()
    return 0
