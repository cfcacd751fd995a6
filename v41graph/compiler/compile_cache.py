"""A persistent compile cache: a second process loads the compiled graphs instead of tracing.

    compiled = v41graph.compile(model, compile_cache="/var/cache/v41graph")   # or $V41GRAPH_COMPILE_CACHE

Where compile time goes (H200, issue 24): Dynamo + AOT tracing is 60+ s per graph, our passes a
few seconds, Inductor segments ~2 s per distinct segment. This cache keeps, per graph, what is
needed to call it again without tracing: the final (post-pass, lowered) graph as FX Python code,
the calling convention Dynamo used (which placeholder is which parameter, buffer, cache tensor or
input, as source expressions over the call's arguments) and the checks Dynamo's guards made; the
Inductor segments' generated code is kept separately (keyed by segment code + input metadata);
Triton's and Inductor's own caches are pointed under the cache directory when the user did not
set them, so a warm start also skips the Triton JIT.

Why this route, not torch's own. `torch.compiler.save_cache_artifacts` (mega-cache) and
`torch._inductor.standalone_compile(...).save()` store Inductor's FX-graph / AOTAutograd cache
entries: they do not apply to a custom backend's output, and they need the cache key pickled,
which fails on torch 2.11 for graphs with symbolic sizes (pytorch#164682). Dynamo's precompile
(`aot_compile`) needs a serializable backend output, which ours (an FX graph run by our executor,
calling compiled Inductor segments) is only through code of our own. So we serialize ourselves,
with public or long-stable pieces only: FX code generation (`Graph.python_code` plus the import
block GraphModule pickling writes), Dynamo's graph-input sources (`node.meta["grapharg"]`),
`torch.compile(options={"guard_filter_fn": ...})` to see the guards Dynamo built,
`ShapeEnv.produce_guards_expression` / `evaluate_guards_expression` (what Inductor's own cache
uses) for the symbolic-shape guards, and Inductor's generated module (`CompiledFxGraph.source_code`,
loaded by `PyCodeCache`) for segments.

A graph is stored only when its calling convention is verified on its first call: evaluating the
recorded sources on the call's arguments gives exactly the tensors AOT handed to the graph, and
every leaf of the value the compiled function returned is one of the graph's outputs (so AOT's
runtime wrappers did nothing we would skip: no dedup, synthetic bases, effect tokens, output
aliases, mutations applied outside the graph). Otherwise it is not stored, with the reason logged.

A warm call checks, before running a stored graph, what Dynamo's guards checked: every input
tensor's dtype, device, static sizes / strides, symbolic sizes consistent and the shape guards;
the constant / type / length guards Dynamo made on the arguments and on the model (model ones
once per entry and model object); grad mode and deterministic-algorithms state. Guards on object
identity (ID_MATCH) cannot carry over processes; what they protect (the code, the globals) is in
the cache key instead. Any mismatch falls back to tracing, with the reason in `CompileCache.events`
and the log. A corrupted or unreadable entry is reported the same way and never raised.

Layout: <dir>/<key>/{key.json, <kind>-<digest>.pt}, <dir>/segments-<env>/<digest>.py,
<dir>/triton, <dir>/inductor. <key> hashes the model config, torch/triton/python versions,
the pass list with every pass's uuid, the lowering, the bucket set, the platform (device name
and capability on CUDA) and the source of the code that is traced or lowers (v41graph.model,
v41graph.compiler, v41graph.custom_ops).
"""
from __future__ import annotations

import builtins
import dataclasses
import functools
import hashlib
import json
import logging
import marshal
import os
import platform as _platform
import sys
import time
import types
import weakref
from pathlib import Path

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

_log = logging.getLogger(__name__)

FORMAT = 1      # bump when what an entry holds changes: old entries then miss
ENV_VAR = "V41GRAPH_COMPILE_CACHE"
# the packages whose source decides what a trace or a lowering produces
SOURCE_PACKAGES = ("v41graph.model", "v41graph.compiler", "v41graph.custom_ops")


# the CompiledModel functions whose graphs are stored (CachedFunction.kind)
KINDS = ("decode", "decode_shared", "prefill")


class NotCacheable(Exception):
    """A graph this cache cannot store (the reason is the message)."""


def resolve_dir(compile_cache) -> Path | None:
    """The cache directory: the argument, else $V41GRAPH_COMPILE_CACHE, else None (off).
    compile_cache=False switches it off even when the variable is set."""
    if compile_cache is False:
        return None
    if compile_cache is None:
        compile_cache = os.environ.get(ENV_VAR) or None
    if compile_cache is None:
        return None
    if not isinstance(compile_cache, (str, os.PathLike)):
        raise TypeError(f"compile_cache must be a directory path, None or False, got {type(compile_cache).__name__}")
    if not str(compile_cache).strip():
        raise ValueError("compile_cache is an empty path; pass a directory, or None / False to switch it off")
    path = Path(compile_cache).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"compile_cache {str(path)!r} exists and is not a directory")
    return path


# ----------------------------------------------------------------------------- the key
def _tuple_code(expressions, filename: str):
    """One compiled expression that evaluates every expression into a tuple (guards and graph
    inputs are read thousands at a time: one eval instead of one per expression)."""
    return compile("(" + "".join(f"({e}),\n" for e in expressions) + ")", filename, "eval")


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


@functools.lru_cache(maxsize=None)
def source_hash(packages=SOURCE_PACKAGES) -> str:
    """Hash of every .py file of `packages` (path and bytes), read once per process (the code
    this process runs was imported by then)."""
    import importlib
    h = hashlib.sha256()
    for name in packages:
        module = importlib.import_module(name)
        for root in getattr(module, "__path__", [os.path.dirname(module.__file__)]):
            for path in sorted(Path(root).rglob("*.py")):
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def environment(device: torch.device) -> dict:
    """What a compiled artifact depends on besides our code: versions and the device."""
    env = {"torch": torch.__version__, "python": _platform.python_version(), "device": device.type}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["device_name"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
    return env


def config_dict(config) -> dict:
    if dataclasses.is_dataclass(config):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {"repr": repr(config)}


def cache_key(config, pass_uuid: str, lowering: str, buckets, platform: str, device: torch.device,
              share_decode_graph) -> dict:
    """Every part of the key, readable (written to key.json); its digest names the folder."""
    return {"format": FORMAT, "config": config_dict(config), "passes": pass_uuid, "lowering": lowering,
            "buckets": list(buckets), "share_decode_graph": share_decode_graph, "platform": platform,
            "env": environment(device), "source": source_hash()}


def _inductor_default_cache_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())


def point_tool_caches(root: Path) -> dict:
    """Triton's and Inductor's caches under `root` when the user set none (a warm start then
    also skips the Triton JIT of our kernels and Inductor's, and finds Inductor's autotuning
    results). Returns what was set.

    Inductor writes its default directory into TORCHINDUCTOR_CACHE_DIR the first time anything
    asks for it (importing v41graph does), so that value counts as unset: without this rule
    Inductor's cache stayed in /tmp, where a restarted machine loses it."""
    set_now = {}
    inductor_default = _inductor_default_cache_dir()
    for var, sub in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        value = os.environ.get(var)
        if not value or (var == "TORCHINDUCTOR_CACHE_DIR" and os.path.abspath(value) == inductor_default):
            os.environ[var] = str(root / sub)
            set_now[var] = os.environ[var]
    return set_now


# ----------------------------------------------------------------------------- graph code
def _import_block(gm_globals: dict) -> str:
    # The import block GraphModule pickling writes (torch.fx.graph_module.reduce_graph_module):
    # stable since torch 1.x, and it knows FX's own builtins (inf, nan, device, ...).
    from torch.fx.graph_module import _format_import_block
    from torch.package import sys_importer
    return _format_import_block(gm_globals, sys_importer)


def serialize_module(gm: torch.nn.Module) -> dict:
    """A lowered graph as data: its forward as Python code, the tensors it reads (get_attr),
    and its submodules: Inductor segments by their artifact's digest, plain graphs recursively."""
    from .inductor_segments import InductorSegment
    if isinstance(gm, InductorSegment):
        digest = getattr(gm, "artifact_digest", None)
        if digest is None:
            raise NotCacheable("an Inductor segment whose compiled code was not kept (see segment store)")
        return {"inductor": digest}
    if not isinstance(gm, fx.GraphModule):
        raise NotCacheable(f"a submodule of type {type(gm).__name__}")
    code = gm.graph.python_code(root_module="self")
    constants, submodules = {}, {}
    for node in gm.graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        if "." in node.target:
            raise NotCacheable(f"a nested attribute {node.target!r}")
        value = getattr(gm, node.target)
        if node.op == "call_module" or isinstance(value, torch.nn.Module):
            submodules[node.target] = serialize_module(value)
        elif isinstance(value, torch.Tensor):
            constants[node.target] = value.detach()
        else:
            raise NotCacheable(f"attribute {node.target!r} of type {type(value).__name__}")
    text = _import_block(code.globals) + "\n" + code.src
    # The bytecode too: compiling a 40-layer graph's code again costs ~0.3 s per graph, loading
    # it ~1 ms (marshal's format is the Python version's, which is part of the key).
    return {"code": text, "bytecode": marshal.dumps(compile(text, _CODE_NAME, "exec")),
            "constants": constants, "submodules": submodules}


_CODE_NAME = "<v41graph compile cache>"


class LoadedGraph(torch.nn.Module):
    """A graph loaded from the cache: its forward is the stored code. check_only: only see that
    the code compiles and the segments it calls are stored (without loading their kernels)."""

    def __init__(self, data: dict, segments: "SegmentStore", check_only: bool = False):
        super().__init__()
        for name, sub in data["submodules"].items():
            if "inductor" in sub:
                if check_only:
                    if not segments.has(sub["inductor"]):
                        raise LookupError(f"Inductor segment {sub['inductor']} is missing from {segments.root}")
                    continue
                segment = segments.load(sub["inductor"])
                if segment is None:
                    raise LookupError(f"Inductor segment {sub['inductor']} is missing from {segments.root}")
                setattr(self, name, segment)
            else:
                setattr(self, name, LoadedGraph(sub, segments, check_only))
        for name, tensor in data["constants"].items():
            setattr(self, name, tensor)
        namespace: dict = {"__builtins__": builtins}
        try:
            code = marshal.loads(data["bytecode"])
        except (KeyError, ValueError, EOFError, TypeError):   # no or unreadable bytecode: the text
            code = compile(data["code"], _CODE_NAME, "exec")
        exec(code, namespace)
        self.forward = types.MethodType(namespace["forward"], self)


# ----------------------------------------------------------------------------- segments
class SegmentStore:
    """Inductor segments' compiled code on disk, keyed by our own segment key (the segment's
    code and its inputs' sizes, strides, dtypes and devices: inductor_segments.segment_key),
    without Inductor's FX-graph cache key (whose pickling fails with symbolic sizes on torch
    2.11, pytorch#164682). What is kept is Inductor's generated Python module (its Triton / C++
    kernels inside as source, compiled at load through Triton's / Inductor's own caches) and the
    inputs whose alignment the wrapper checks."""

    def __init__(self, root: Path, env: dict):
        self.root = root / f"segments-{_digest(env)}"
        self.loaded = 0
        self.stored = 0
        self._callables: dict = {}     # digest -> loaded callable (the layers repeat segments)

    def digest(self, key: tuple) -> str:
        return hashlib.sha256(repr(key).encode()).hexdigest()[:24]

    def has(self, digest: str) -> bool:
        return digest in self._callables or (self.root / f"{digest}.pt").exists()

    def load(self, digest: str):
        """The compiled segment for `digest`, or None when not stored or unreadable (logged)."""
        from .inductor_segments import InductorSegment, load_generated_code
        call = self._callables.get(digest)
        if call is None:
            path = self.root / f"{digest}.pt"
            if not path.exists():
                return None
            try:
                data = torch.load(path, weights_only=True)
                call = load_generated_code(data["source"], data["inputs_to_check"])
            except Exception as exc:   # a corrupt file: compile again
                _log.warning("compile cache: Inductor segment %s unreadable (%s: %s); compiling it again",
                             path, type(exc).__name__, exc)
                return None
            self._callables[digest] = call
            self.loaded += 1
        # graph_module None: the segment's FX graph is not kept (only its compiled code runs)
        segment = InductorSegment(call, None)
        segment.artifact_digest = digest
        return segment

    def store(self, digest: str, generated) -> bool:
        """Keep a segment Inductor just compiled, as inductor_segments.generated_code gives it
        ((source, inputs_to_check), or None: not kept, logged). True when kept."""
        if generated is None:
            _log.info("compile cache: segment %s not kept (no generated source, or constants)", digest)
            return False
        source, inputs_to_check = generated
        _atomic_save({"source": source, "inputs_to_check": [int(i) for i in inputs_to_check]},
                     self.root / f"{digest}.pt")
        self.stored += 1
        return True


def _atomic_save(data, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(data, tmp)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- guards
# Guard kinds whose check carries over processes, by Dynamo's guard-type names
_VALUE_GUARDS = ("CONSTANT_MATCH", "EQUALS_MATCH")
_TYPE_GUARDS = ("TYPE_MATCH",)
_LENGTH_GUARDS = ("SEQUENCE_LENGTH", "DICT_LENGTH", "LENGTH_CHECK")
_EMPTY_GUARDS = ("EMPTY_NN_MODULE_HOOKS_DICT",)
_KEYS_GUARDS = ("DICT_KEYS_MATCH", "MAPPING_KEYS_CHECK")


def _encode_value(v):
    """A guard's expected value as stored data: plain values as they are, dtypes and devices by
    name; None when it cannot be compared across processes."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return ("value", v)
    if isinstance(v, (torch.dtype, torch.device)):
        return ("str", str(v))
    if isinstance(v, tuple) and all(x is None or isinstance(x, (bool, int, float, str)) for x in v):
        return ("value", list(v))
    return None


def _matches(encoded, value) -> bool:
    kind, expected = encoded
    if kind == "str":
        return isinstance(value, (torch.dtype, torch.device)) and str(value) == expected
    if isinstance(expected, list):
        return isinstance(value, tuple) and list(value) == expected
    return type(value) is type(expected) and value == expected


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def guards_from_entries(entries) -> tuple[list, dict]:
    """Dynamo's guards (guard_filter_fn entries) as stored checks: (kind, source name, expected)
    with kind value / type / length / empty, plus counts of the guards left unchecked by type."""
    checks, unchecked = [], {}
    for e in entries:
        gtype, name = getattr(e, "guard_type", ""), getattr(e, "name", "")
        has_value, value = getattr(e, "has_value", False), getattr(e, "value", None)
        check = None
        if getattr(e, "is_global", False) or not name:
            check = None       # code and globals: covered by the key's source hash and versions
        elif gtype in _VALUE_GUARDS and has_value and _encode_value(value) is not None:
            check = ("value", name, _encode_value(value))
        elif gtype in _TYPE_GUARDS and has_value:
            check = ("type", name, _type_name(type(value)))
        elif gtype in _LENGTH_GUARDS and has_value and hasattr(value, "__len__"):
            check = ("length", name, len(value))
        elif gtype in _EMPTY_GUARDS:
            check = ("length", name, 0)
        elif gtype in _KEYS_GUARDS and has_value and hasattr(value, "keys") \
                and all(_encode_value(k) is not None for k in value.keys()):
            check = ("keys", name, [repr(k) for k in value.keys()])
        if check is None:
            unchecked[gtype] = unchecked.get(gtype, 0) + 1
        elif check not in checks:
            checks.append(check)
    return checks, unchecked


class _Checks:
    """Compiled guard checks over one namespace (the call's arguments by name). `passed`: the
    models these checks passed for (model checks run once per model object)."""

    _shared: dict = {}

    @classmethod
    def of(cls, checks: list) -> "_Checks":
        """One object per distinct check list in this process: the graphs of one model repeat
        the same ~15k model checks, compiled (and passed) once."""
        key = hashlib.sha256(repr(checks).encode()).hexdigest()
        if key not in cls._shared:
            cls._shared[key] = cls(checks)
        return cls._shared[key]

    def __init__(self, checks: list):
        self.passed = weakref.WeakSet()
        self.checks = checks
        names = [c[1] for c in checks]
        self._values = _tuple_code(names, "<v41graph guards>") \
            if names else None

    def failure(self, scope: dict) -> str | None:
        if self._values is None:
            return None
        try:
            values = eval(self._values, {"__builtins__": builtins, "dict": dict, "type": type}, scope)
        except Exception as exc:
            return f"a guard could not be evaluated ({type(exc).__name__}: {exc})"
        for (kind, name, expected), value in zip(self.checks, values):
            if kind == "value" and not _matches(expected, value):
                return f"{name} is {value!r}, the trace had {expected[1]!r}"
            if kind == "type" and _type_name(type(value)) != expected:
                return f"{name} is a {_type_name(type(value))}, the trace had a {expected}"
            if kind == "length" and len(value) != expected:
                return f"len({name}) is {len(value)}, the trace had {expected}"
            if kind == "keys" and [repr(k) for k in value.keys()] != expected:
                return f"{name} has keys {[repr(k) for k in value.keys()]}, the trace had {expected}"
        return None


# ----------------------------------------------------------------------------- entries
def _tensor_meta(val) -> dict:
    def dim(d):
        return int(d) if isinstance(d, int) or not hasattr(d, "node") else (
            int(d) if d.node.expr.is_number else str(d.node.expr))
    if isinstance(val, torch.Tensor):
        return {"kind": "tensor", "dtype": str(val.dtype), "device": str(val.device),
                "shape": [dim(d) for d in val.shape], "stride": [dim(s) for s in val.stride()],
                "offset": dim(val.storage_offset())}
    if isinstance(val, torch.SymInt):
        return {"kind": "int", "symbol": dim(val)}
    if isinstance(val, int):
        return {"kind": "int", "symbol": int(val)}
    raise NotCacheable(f"a graph input of type {type(val).__name__}")


def _device_matches(want: torch.device, device: torch.device) -> bool:
    return want.type == device.type and (want.index is None or want.index == device.index)


@dataclasses.dataclass
class Entry:
    """One stored graph: how to call it, what to check first, and the graph itself."""
    kind: str
    signature: str
    sources: list
    inputs: list                 # _tensor_meta of each graph input
    shape_guards: str | None     # ShapeEnv.produce_guards_expression over the non-model inputs
    arg_checks: list             # Dynamo guards on the call's arguments (checked every call)
    model_checks: list           # Dynamo guards on the model (checked once per model object)
    state: dict                  # grad mode, deterministic algorithms
    out_spec: str                # pytree spec of the returned value
    out_index: list              # graph output index of each leaf
    graph: dict                  # serialize_module of the final graph
    unchecked: dict = dataclasses.field(default_factory=dict)
    digest: str = ""

    def to_data(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_data(cls, data: dict) -> "Entry":
        return cls(**data)


class LoadedEntry:
    """An Entry made callable: compiled source extraction, guard checks, the loaded graph."""

    def __init__(self, entry: Entry, segments: SegmentStore | None, graph=None):
        self.entry = entry
        # graph: a live callable (a graph stamped in this process) instead of the stored code
        self.graph = graph if graph is not None else LoadedGraph(entry.graph, segments)
        self._extract = _tuple_code(entry.sources, "<v41graph graph inputs>")
        self._arg_checks = _Checks(entry.arg_checks)
        self._model_checks = _Checks.of(entry.model_checks)
        self._inputs_ok = weakref.WeakSet()     # models whose tensors passed this entry's checks
        # inputs read from the model (parameters, buffers): checked once per model object
        self._is_model = [s.startswith("L['self']") for s in entry.sources]
        self._shape_guards = compile(entry.shape_guards, "<v41graph shape guards>", "eval") \
            if entry.shape_guards else None
        self._guard_positions = [i for i, m in enumerate(self._is_model) if not m]
        self._spec = pytree.treespec_loads(entry.out_spec)
        # parsed once, not at every call's checks
        self._devices = [torch.device(m["device"]) if m["kind"] == "tensor" else None for m in entry.inputs]
        if self._shape_guards is not None:
            from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
            self._shape_globals = dict(SYMPY_INTERP)
        self.hits = 0

    def args(self, scope: dict) -> list:
        return list(eval(self._extract, {"__builtins__": builtins}, {"L": scope}))

    def failure(self, scope: dict, args: list) -> str | None:
        """Why this entry does not fit the call (None: it fits)."""
        e = self.entry
        state = _state()
        if state != e.state:
            return f"global state {state} differs from the trace's {e.state}"
        why = self._arg_checks.failure(scope)
        if why:
            return why
        model = scope["self"]
        if model not in self._model_checks.passed:
            why = self._model_checks.failure(scope)
            if why:
                return why
            self._model_checks.passed.add(model)
        first = model not in self._inputs_ok      # the model's tensors: once per entry and model
        symbols: dict = {}
        for i, (value, meta, source) in enumerate(zip(args, e.inputs, e.sources)):
            if self._is_model[i] and not first:
                continue
            why = _input_failure(value, meta, self._devices[i], symbols)
            if why:
                return f"{source}: {why}"
        if self._shape_guards is not None:
            values = {f"t{j}": args[i] for j, i in enumerate(self._guard_positions)}
            if not eval(self._shape_guards, self._shape_globals, {"L": values}):
                return f"the trace's shape guards fail ({e.shape_guards[:200]})"
        if first:
            self._inputs_ok.add(model)
        return None

    def __call__(self, args: list):
        outs = self.graph(*args)
        self.hits += 1
        leaves = [outs[i] for i in self.entry.out_index]
        return pytree.tree_unflatten(leaves, self._spec)


def _input_failure(value, meta: dict, device: torch.device | None, symbols: dict) -> str | None:
    if meta["kind"] == "int":
        if not isinstance(value, int):
            return f"expected an int, got {type(value).__name__}"
        return _bind(meta["symbol"], value, symbols)
    if not isinstance(value, torch.Tensor):
        return f"expected a tensor, got {type(value).__name__}"
    if str(value.dtype) != meta["dtype"]:
        return f"dtype {value.dtype}, the trace had {meta['dtype']}"
    if not _device_matches(device, value.device):
        return f"device {value.device}, the trace had {meta['device']}"
    if value.dim() != len(meta["shape"]):
        return f"{value.dim()} dimensions, the trace had {len(meta['shape'])}"
    for what, got, want in (("size", value.shape, meta["shape"]), ("stride", value.stride(), meta["stride"]),
                            ("storage offset", [value.storage_offset()], [meta["offset"]])):
        for g, w in zip(got, want):
            why = _bind(w, int(g), symbols)
            if why:
                return f"{what} {tuple(got)}: {why}"
    return None


def _bind(want, got: int, symbols: dict) -> str | None:
    """A static size must be equal; a symbol (a plain name such as s0) must have one value across
    the inputs; expressions (2*s0) are left to the shape guards."""
    if isinstance(want, int):
        return None if got == want else f"{got} where the trace had {want}"
    if want.isidentifier():
        if symbols.setdefault(want, got) != got:
            return f"{want} = {got} here but {symbols[want]} in another input"
    return None


def _state() -> dict:
    return {"grad": torch.is_grad_enabled(), "deterministic": torch.are_deterministic_algorithms_enabled()}


# ----------------------------------------------------------------------------- recording
class GraphRecord:
    """What the backend saw of one graph while a traced call ran: filled by CompileCache's
    backend hooks, turned into an Entry after the call (Recorder.finish)."""

    def __init__(self):
        self.sources = None
        self.inputs = None
        self.shape_guards = None
        self.gm = None
        self.first_args = None
        self.first_outs = None
        self.called = False
        self.refused = None       # why it cannot be stored, once known


class CompileCache:
    """The cache of one CompiledModel: its key's folder, the entries loaded from it, the
    segment store, and the recording of graphs traced by calls that missed."""

    def __init__(self, root: Path | None):
        """root None: nothing on disk, only the graphs stamped in this process (`resident`)."""
        self.root = root
        self.events: list[str] = []       # misses, refusals, unreadable entries: readable reasons
        self._current: GraphRecord | None = None
        self._active = False          # inside a cached function's call (begin .. finish)
        self.stamping = False         # the call traces the layers to stamp (begin(stamping=True))
        self._guards: list = []
        self.saved = 0
        self.load_s = 0.0
        self.key: dict = {}
        # entries of graphs stamped in this process, with their live graphs (kept across
        # set_key: a pass-list change passes their graphs again, CompiledModel.set_passes)
        self.resident: list[LoadedEntry] = []
        self.tool_caches = point_tool_caches(root) if root is not None else {}

    def set_key(self, key: dict) -> None:
        """Use the folder of `key` (at construction, and when the pass list changes)."""
        self.key = key
        self._loaded: dict[str, list[LoadedEntry]] = {}
        if self.root is None:
            self.dir, self.segments = None, None
            return
        self.dir = self.root / _digest(key)
        # segments outlive a pass-list change (their key is their own code), not an edit of ours
        self.segments = SegmentStore(self.root, {"env": key["env"], "source": key["source"]})

    def note(self, msg: str, level=logging.INFO) -> None:
        self.events.append(msg)
        _log.log(level, "compile cache: %s", msg)

    # --------------------------------------------------------------- entries
    def entries(self, kind: str) -> list[LoadedEntry]:
        """The stored entries of `kind` (loaded on first use; unreadable ones reported, skipped)."""
        if kind in self._loaded:
            return self._loaded[kind]
        t0 = time.perf_counter()
        found = []
        for path in sorted(self.dir.glob(f"{kind}-*.pt")) if self.dir is not None and self.dir.is_dir() else ():
            try:
                data = torch.load(path, weights_only=True)
                if data.get("format") != FORMAT:
                    raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
                found.append(LoadedEntry(Entry.from_data(data["entry"]), self.segments))
            except Exception as exc:
                self.note(f"entry {path.name} unreadable ({type(exc).__name__}: {str(exc)[:200]}); "
                          f"it will be traced again", logging.WARNING)
        self._loaded[kind] = found
        self.load_s += time.perf_counter() - t0
        return found

    def lookup(self, kind: str, signature: str, scope: dict):
        """(entry, args) of the first stored entry that fits the call, or (None, reasons). The
        entries of `kind` are tried first, then the other kinds': Dynamo, too, runs any graph of
        V41Model.forward whose guards pass (a prefill may run the shared decode graph), and a
        warm process must not trace what the cold one reused."""
        reasons = []
        others = [k for k in KINDS if k != kind]
        for loaded in self.resident + self.entries(kind) + [e for k in others for e in self.entries(k)]:
            if loaded.entry.signature != signature:
                reasons.append(f"{loaded.entry.digest}: call {signature}, stored {loaded.entry.signature}")
                continue
            try:
                args = loaded.args(scope)
            except Exception as exc:
                reasons.append(f"{loaded.entry.digest}: inputs not found ({type(exc).__name__}: {exc})")
                continue
            why = loaded.failure(scope, args)
            if why is None:
                return loaded, args
            reasons.append(f"{loaded.entry.digest}: {why}")
        return None, reasons

    # --------------------------------------------------------------- recording (cold path)
    def begin(self, stamping: bool = False) -> None:
        """A cached function's call starts: the backend hooks record what it traces (a graph
        traced outside such a call, e.g. CompiledModel.encode's, is not recorded: nothing would
        store it, and its record would keep the call's tensors alive). stamping: the call
        traces the layers to stamp; the backend keeps the post-AOT graph and stops there."""
        self._current, self._guards, self._active, self.stamping = None, [], True, stamping

    def abandon(self) -> None:
        """The call raised: forget what it recorded."""
        self._current, self._guards, self._active, self.stamping = None, [], False, False

    def take_stamping_trace(self):
        """After a stamping call: (its record, with the post-AOT graph as `gm`, and Dynamo's
        guards), or (None, None) when the call traced nothing (Dynamo served it)."""
        record, guards = self._current, self._guards
        self.abandon()
        if record is None or record.gm is None:
            return None, None
        return record, guards

    def add_stamped(self, kind: str, signature: str, record: "GraphRecord", guards, sources: list,
                    gm: fx.GraphModule, graph, map_checks, streams: int = 0) -> "LoadedEntry":
        """The entry of a graph stamped from `record` (its inputs named by `sources`; `gm` the
        final graph, `graph` what runs it): kept in this process, and stored when the cache has
        a directory, as a traced graph's entry is (a warm start cannot tell them apart). The
        call's value is the graph's first output (the logits), or with `streams` > 0 (a call
        with return_streams) (logits, [the other outputs]), as V41Model.forward returns them.
        map_checks(checks) turns the traced layers' guard checks into the whole model's."""
        if record.refused:
            raise NotCacheable(record.refused)
        vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        if not isinstance(outputs, (list, tuple)) or len(outputs) != 1 + streams:
            raise NotCacheable(f"a stamped graph must have {1 + streams} outputs (the logits and {streams} streams)")
        leaf = torch.empty(0)
        spec = pytree.tree_flatten((leaf, [leaf] * streams) if streams else leaf)[1]
        checks, unchecked = guards_from_entries(guards or [])
        checks = map_checks(checks)
        if not guards:
            unchecked["guard_filter_fn not called"] = 1
        entry = Entry(kind=kind, signature=signature, sources=list(sources),
                      inputs=[_tensor_meta(v) for v in vals], shape_guards=record.shape_guards,
                      arg_checks=[c for c in checks if not c[1].startswith("self")],
                      model_checks=[c for c in checks if c[1].startswith("self")],
                      state=_state(), out_spec=pytree.treespec_dumps(spec),
                      out_index=list(range(1 + streams)), graph={}, unchecked=unchecked)
        entry.digest = _digest([entry.signature, entry.sources, entry.inputs, entry.shape_guards])[:12]
        loaded = LoadedEntry(entry, None, graph=graph)
        self.resident.append(loaded)
        if self.dir is not None:
            try:
                entry.graph = serialize_module(gm)
                LoadedGraph(entry.graph, self.segments, check_only=True)
            except Exception as exc:
                self.note(f"stamped {kind} graph not stored: {type(exc).__name__}: {str(exc)[:200]}", logging.WARNING)
            else:
                self._store(kind, entry)
        return loaded

    @property
    def traced(self) -> bool:
        """Whether the call since begin() traced a graph."""
        return self._current is not None

    def guard_filter(self, entries) -> list[bool]:
        """torch.compile's guard_filter_fn: keeps every guard, notes them for the entry."""
        self._guards = list(entries)
        return [True] * len(entries)

    def dynamo_graph(self, gm: fx.GraphModule) -> None:
        """Backend hook, before AOT: the graph inputs' sources."""
        if not self._active:
            return
        record = self._current = GraphRecord()
        sources = []
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            arg = node.meta.get("grapharg")
            source = getattr(arg, "source", None)
            if source is None:
                record.refused = f"graph input {node.name} has no source"
                return
            sources.append(source.name() if callable(source.name) else source.name)
        if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
            record.refused = "the Dynamo graph owns parameters (AOT lifts them: another calling convention)"
        record.sources = sources

    def aot_graph(self, gm: fx.GraphModule, keep: bool = False) -> None:
        """Backend hook, the post-AOT graph before our passes: input metadata, shape guards;
        keep: the graph itself too (a stamping trace's)."""
        record = self._current
        if record is None or record.refused:
            return
        if keep:
            record.gm = gm
        vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        if len(vals) != len(record.sources):
            record.refused = (f"AOT changed the calling convention ({len(record.sources)} Dynamo inputs, "
                              f"{len(vals)} graph inputs)")
            return
        try:
            record.inputs = [_tensor_meta(v) for v in vals]
            from torch._guards import detect_fake_mode
            fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
            shape_env = getattr(fake_mode, "shape_env", None)
            outside = [v for v, s in zip(vals, record.sources) if not s.startswith("L['self']")]
            if shape_env is not None:
                record.shape_guards = shape_env.produce_guards_expression(outside)
        except NotCacheable as exc:
            record.refused = str(exc)
        except Exception as exc:
            record.refused = f"shape guards could not be produced ({type(exc).__name__}: {exc})"

    def graph_ready(self, gm: fx.GraphModule, fn):
        """Backend hook, the final graph: keep it, and wrap fn to see its first call."""
        record = self._current
        if record is None or not self._active:
            return fn
        record.gm = gm

        def first_call(*args):
            outs = fn(*args)
            if not record.called:
                record.called = True
                record.first_args, record.first_outs = list(args), outs
            return outs
        return first_call

    def finish(self, kind: str, signature: str, scope: dict, result) -> None:
        """After a call that may have traced: store the graph it traced, if any and if it can."""
        record, guards = self._current, self._guards
        self._current, self._guards, self._active = None, [], False
        if record is None or self.dir is None:
            return          # Dynamo's own in-process cache served the call, or nothing to store in
        try:
            entry = self._entry(record, kind, signature, scope, result, guards)
        except NotCacheable as exc:
            self.note(f"{kind} graph not stored: {exc}", logging.WARNING)
            return
        finally:   # the graph's wrapper keeps the record: drop what it saw of the first call
            record.first_args = record.first_outs = record.gm = None
        self._store(kind, entry)

    def _store(self, kind: str, entry: Entry) -> None:
        data = {"format": FORMAT, "entry": entry.to_data()}
        path = self.dir / f"{kind}-{entry.digest}.pt"
        try:
            if not (self.dir / "key.json").exists():
                self.dir.mkdir(parents=True, exist_ok=True)
                (self.dir / "key.json").write_text(json.dumps(self.key, indent=1, sort_keys=True, default=str))
            _atomic_save(data, path)
        except Exception as exc:   # a full disk, no permission: the run goes on uncached
            self.note(f"{kind} graph not stored: writing {path} failed ({type(exc).__name__}: {exc})",
                      logging.WARNING)
            return
        self.saved += 1
        self.note(f"stored the {kind} graph as {path.name}")

    def _entry(self, record: GraphRecord, kind, signature, scope, result, guards) -> Entry:
        if record.refused:
            raise NotCacheable(record.refused)
        if record.first_args is None or record.gm is None:
            raise NotCacheable("the traced graph did not run in this call")
        # The calling convention, verified: the sources give what AOT handed to the graph.
        expr = _tuple_code(record.sources, "<sources>")
        try:
            found = list(eval(expr, {"__builtins__": builtins}, {"L": scope}))
        except Exception as exc:
            raise NotCacheable(f"a graph input's source does not evaluate ({type(exc).__name__}: {exc})")
        for source, mine, given in zip(record.sources, found, record.first_args):
            if not _same_input(mine, given):
                raise NotCacheable(f"{source} is not the tensor the graph was called with")
        leaves, spec = pytree.tree_flatten(result)
        outs = list(record.first_outs) if isinstance(record.first_outs, (list, tuple)) else [record.first_outs]
        index = []
        for leaf in leaves:
            at = [i for i, o in enumerate(outs) if o is leaf]
            if not at:
                raise NotCacheable("the returned value is not made of the graph's outputs "
                                   "(AOT or Dynamo changed it after the graph)")
            index.append(at[0])
        if sorted(set(index)) != list(range(len(outs))):
            raise NotCacheable(f"graph outputs {sorted(set(range(len(outs))) - set(index))} are not returned "
                               f"(AOT uses them after the graph: mutations or aliases)")
        try:
            spec_text = pytree.treespec_dumps(spec)
        except Exception as exc:
            raise NotCacheable(f"the returned structure cannot be stored ({type(exc).__name__})")
        checks, unchecked = guards_from_entries(guards)
        arg_checks = [c for c in checks if not c[1].startswith("self")]
        model_checks = [c for c in checks if c[1].startswith("self")]
        if not guards:
            unchecked["guard_filter_fn not called"] = 1
        entry = Entry(kind=kind, signature=signature, sources=record.sources, inputs=record.inputs,
                      shape_guards=record.shape_guards, arg_checks=arg_checks, model_checks=model_checks,
                      state=_state(), out_spec=spec_text, out_index=index,
                      graph=serialize_module(record.gm), unchecked=unchecked)
        entry.digest = _digest([entry.signature, entry.sources, entry.inputs, entry.shape_guards])[:12]
        try:   # the stored code must load again (names it imports, the segments it needs)
            LoadedGraph(entry.graph, self.segments, check_only=True)
        except Exception as exc:
            raise NotCacheable(f"the stored graph would not load ({type(exc).__name__}: {str(exc)[:200]})")
        return entry


def _same_input(mine, given) -> bool:
    if isinstance(given, torch.Tensor):
        return isinstance(mine, torch.Tensor) and (mine is given or (
            mine.data_ptr() == given.data_ptr() and mine.dtype == given.dtype and mine.shape == given.shape
            and mine.stride() == given.stride() and mine.device == given.device))
    return type(mine) is type(given) and mine == given


__all__ = ["CompileCache", "SegmentStore", "NotCacheable", "resolve_dir", "cache_key", "point_tool_caches",
           "serialize_module", "LoadedGraph", "ENV_VAR"]
