"""What every v41graph pass is: a named graph rewrite with a stable uuid and a match count.

A pass is one class in one file. `__call__(gm)` rewrites `gm.graph` in place and returns how
many places it changed (`matched_count`); the pass manager dumps the graph before and after.
`uuid()` hashes the source of the pass's module and of every module of `v41graph.passes` /
`v41graph.custom_ops` it imports from, transitively (the shared matchers in patterns.py, base.py,
the stream ops...), so caches keyed on the pass list notice an edit of any code the pass runs.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import inspect
import operator

import torch
import torch.fx as fx

STREAM_KEY = "stream"          # node.meta key: the stream a node runs on
MAIN_STREAM = "main"
SOURCE_PACKAGES = ("v41graph.passes", "v41graph.custom_ops")   # the code a pass's uuid covers


def _ours(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in SOURCE_PACKAGES)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _is_package(name: str) -> bool:
    return hasattr(importlib.import_module(name), "__path__")


@functools.lru_cache(maxsize=None)
def _imports_of(name: str, source: str) -> tuple:
    """The modules of SOURCE_PACKAGES that module `name` (with this source) imports from."""
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                if node.level else node.module
            found.append(base)
            found += [f"{base}.{a.name}" for a in node.names if _ours(f"{base}.{a.name}")
                      and _is_module(f"{base}.{a.name}")]   # `from . import patterns`
    return tuple(dict.fromkeys(m for m in found if _ours(m)))


def source_closure(*modules: str) -> dict:
    """name -> source of each of `modules` and of every module of SOURCE_PACKAGES they import
    from, transitively (read with inspect.getsource)."""
    sources, todo = {}, list(modules)
    while todo:
        name = todo.pop()
        if name in sources:
            continue
        try:
            sources[name] = inspect.getsource(importlib.import_module(name))
        except (OSError, TypeError):       # no source to read (a compiled module): its name only
            sources[name] = ""
        todo += _imports_of(name, sources[name])
    return sources


class GraphPass:
    name: str = "unnamed"

    def __init__(self):
        self.matched_count = 0
        self.refused = 0        # places the last run left alone as unsafe (set by a pass that counts them)

    def uuid(self) -> str:
        """Hash of the pass's class name and the sources of its module, its base classes'
        modules and every module of ours they import from (`source_closure`)."""
        cls = type(self)
        roots = [c.__module__ for c in cls.__mro__ if _ours(c.__module__)] or [cls.__module__]
        h = hashlib.sha256(cls.__qualname__.encode())
        for name, src in sorted(source_closure(*roots).items()):
            h.update(b"\0" + name.encode() + b"\0" + src.encode())
        return h.hexdigest()[:16]

    def __call__(self, gm: fx.GraphModule) -> int:
        self.matched_count = self.run(gm)
        gm.graph.lint()
        gm.recompile()
        return self.matched_count

    def run(self, gm: fx.GraphModule) -> int:  # pragma: no cover - interface
        raise NotImplementedError


def is_call(node: fx.Node, *targets) -> bool:
    return node.op == "call_function" and node.target in targets


def module_path(node: fx.Node) -> str:
    """The innermost nn.Module path the node was traced from ("" if unknown), e.g.
    "layers.6.attn.indexer"."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.replace("L['self'].", "").replace("L['self']", "")


def cast_dtype(node) -> "torch.dtype | None":
    """The target dtype when `node` is a plain dtype cast, else None. The graph spells a cast
    `prims.convert_element_type(x, dtype)` under Inductor's decompositions and
    `aten._to_copy(x, dtype=dtype)` without them (our backend's default, see compiler/backend.py);
    `Tensor.type_as` (torch.nn.RMSNorm's cast back) adds layout=strided and x's own device, and
    `.to(dtype)` may add memory_format=preserve_format: still a plain cast."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is torch.ops.prims.convert_element_type.default:
        return node.args[1]
    if node.target is not torch.ops.aten._to_copy.default or len(node.args) != 1 or "dtype" not in node.kwargs:
        return None
    extra = {k: v for k, v in node.kwargs.items() if k != "dtype"}
    if not set(extra) <= {"layout", "device", "memory_format"}:
        return None
    if extra.get("layout", torch.strided) not in (None, torch.strided):
        return None
    if extra.get("memory_format", torch.preserve_format) not in (None, torch.preserve_format):
        return None
    if extra.get("device") is not None:
        val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if val is None or val.device != torch.device(extra["device"]):
            return None
    return node.kwargs["dtype"]


def _write_params(node: fx.Node) -> list:
    """(position, schema argument) of each argument the node's op writes, by its schema."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    return [(pos, a) for pos, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def writes_memory(node: fx.Node) -> bool:
    """The node's op writes one of its arguments (our in-place cache writes after
    defunctionalize, copy_, add_, ...)."""
    return bool(_write_params(node))


def written_args(node: fx.Node) -> list:
    """The argument nodes a node writes, passed by keyword or position (lists flattened)."""
    out = []
    for pos, arg in _write_params(node):
        value = node.kwargs.get(arg.name, node.args[pos] if pos < len(node.args) else None)
        out += [v for v in (value if isinstance(value, (tuple, list)) else [value]) if isinstance(v, fx.Node)]
    return out


def returns_alias(node: fx.Node) -> bool:
    """The node's value may share memory with one of its inputs: a view by its op's schema
    (`view(Tensor(a) self) -> Tensor(a)`), `_unsafe_view` (a view without the annotation), a
    getitem of such a tuple."""
    if node.op != "call_function":
        return False
    if node.target in (operator.getitem, torch.ops.aten._unsafe_view.default):
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)
