"""Safetensors checkpoints on disk: a validating lazy reader and a streaming writer.

Format level only (no model knowledge; names.py maps the names onto V41Model, load.py loads).

Reader
  `SafetensorsFile(path)` parses and checks one file's header (JSON, dtypes, shapes, offsets
  that tile the data region, file size) without reading any tensor data; tensors are then read
  one at a time with `pread` straight into a caller's buffer (e.g. an already allocated model
  parameter), as row/column slices, or memory-mapped (copy-on-write).
  `Checkpoint.open(path)` takes a checkpoint directory (`config.json` +
  `model.safetensors.index.json` + shards, or `model.safetensors`), a single `.safetensors`
  file, or an index file, and cross-checks the index against the shards.
  The safetensors library is not used for reading: its `get_slice` cannot slice `F4` tensors
  (it reshapes the packed bytes to the logical shape) and `get_tensor` maps the whole file;
  this reader follows the same format rules (and files written here load with
  `safetensors.torch.load_file`, which the tests check).

Writer
  `CheckpointWriter(dir, entries, max_shard_bytes)` plans the shards from the list of
  (name, dtype, logical shape) up front, writes every shard's header first and then each
  tensor's bytes at its final offset with `pwrite`, in any order and in pieces if wanted, so a
  generator can stream a checkpoint far larger than memory. Shards are written as `*.partial`
  and renamed when complete; the index (`model.safetensors.index.json`) is written last.

dtypes: safetensors names as in the official checkpoint. `F4` is `float4_e2m1fn_x2`: the header
holds the LOGICAL shape [.., n]; the data (and the torch tensor) is [.., n/2] bytes, element 2j
in the low nibble. `F8_E4M3` = `float8_e4m3fn`, `F8_E8M0` = `float8_e8m0fnu` (power-of-two
scales 2^(byte-127)).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
DEFAULT_MAX_SHARD_BYTES = 4 * 1024 ** 3
_MAX_HEADER_BYTES = 256 * 1024 ** 2
_IO_CHUNK = 256 * 1024 ** 2          # bytes per pread/pwrite call (Linux caps one call at ~2 GiB)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as is. `path` is the file at fault (or the checkpoint
    directory), `problems` the individual findings when there are several."""

    def __init__(self, message: str, path: str | Path | None = None, problems: Sequence[str] = ()):
        super().__init__(message)
        self.path = Path(path) if path is not None else None
        self.problems = list(problems)


# ----------------------------------------------------------------------------- dtypes
def _dt(name: str):
    return getattr(torch, name, None)


# safetensors dtype -> (torch dtype or None where this torch lacks it, bytes per element;
# F4 is special-cased: half a byte per logical element)
ST_DTYPES: dict[str, tuple] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
    "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1), "F8_E4M3": (_dt("float8_e4m3fn"), 1),
    "F8_E5M2": (_dt("float8_e5m2"), 1), "F8_E8M0": (_dt("float8_e8m0fnu"), 1),
    "F4": (_dt("float4_e2m1fn_x2"), 1),
}
TORCH_TO_ST = {t: name for name, (t, _) in ST_DTYPES.items() if t is not None}


def torch_dtype_of(st_dtype: str) -> torch.dtype:
    """The torch dtype a tensor of this safetensors dtype is read as (uint8 for 1-byte formats
    this torch build lacks)."""
    t = ST_DTYPES[st_dtype][0]
    return t if t is not None else torch.uint8


def physical_shape(st_dtype: str, shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of the stored data: F4 packs two elements per byte along the last dim."""
    shape = tuple(int(s) for s in shape)
    if st_dtype == "F4":
        if not shape or shape[-1] % 2:
            raise ValueError(f"F4 tensor needs an even last dimension, got {list(shape)}")
        return shape[:-1] + (shape[-1] // 2,)
    return shape


def nbytes_of(st_dtype: str, shape: Sequence[int]) -> int:
    return math.prod(physical_shape(st_dtype, shape)) * ST_DTYPES[st_dtype][1]


def logical_shape_of(t: torch.Tensor, st_dtype: str) -> tuple[int, ...]:
    """Logical (header) shape of a physical tensor."""
    shape = tuple(t.shape)
    return shape[:-1] + (shape[-1] * 2,) if st_dtype == "F4" else shape


def as_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor's memory (no copy; writable)."""
    if not t.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    done, n = 0, len(buf)
    while done < n:
        got = os.preadv(fd, [buf[done:min(n, done + _IO_CHUNK)]], offset + done)
        if got <= 0:
            raise CheckpointError(f"{path}: unexpected end of file at byte {offset + done} "
                                  f"(file truncated after it was opened?)", path)
        done += got


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    done, n = 0, len(buf)
    while done < n:
        done += os.pwrite(fd, buf[done:min(n, done + _IO_CHUNK)], offset + done)


# ----------------------------------------------------------------------------- reader
@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str                  # safetensors dtype name
    shape: tuple[int, ...]      # logical shape as in the header
    file: Path
    start: int                  # absolute byte offset of the data in `file`
    nbytes: int

    @property
    def physical_shape(self) -> tuple[int, ...]:
        return physical_shape(self.dtype, self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype_of(self.dtype)


class SafetensorsFile:
    """One safetensors file: header parsed and validated at open, tensors read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: truncated or not a safetensors file "
                                          f"({size} bytes, no 8-byte header length)", self.path)
                n = int.from_bytes(head, "little")
                if n > size - 8 or n > _MAX_HEADER_BYTES:
                    raise CheckpointError(
                        f"{self.path}: corrupt or truncated safetensors file: header length {n} "
                        f"but the file has {size} bytes", self.path)
                raw = f.read(n)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot read ({exc})", self.path) from exc
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not valid JSON: {exc})",
                                  self.path) from exc
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)", self.path)
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.size = size
        self.tensors: dict[str, TensorInfo] = {}
        spans = []
        for name, e in header.items():
            try:
                dtype, shape, (b, end) = e["dtype"], e["shape"], e["data_offsets"]
                if dtype not in ST_DTYPES:
                    raise ValueError(f"unknown dtype {dtype!r}")
                if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
                    raise ValueError(f"bad shape {shape!r}")
                if not (isinstance(b, int) and isinstance(end, int) and 0 <= b <= end):
                    raise ValueError(f"bad data_offsets {[b, end]}")
                need = nbytes_of(dtype, shape)
                if end - b != need:
                    raise ValueError(f"data_offsets span {end - b} bytes but {dtype} {shape} "
                                     f"needs {need}")
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{self.path}: corrupt safetensors header entry {name!r} "
                                      f"({exc})", self.path) from exc
            self.tensors[name] = TensorInfo(name, dtype, tuple(shape), self.path,
                                            self.data_start + b, end - b)
            spans.append((b, end, name))
        spans.sort()
        pos = 0
        for b, end, name in spans:
            if b != pos:
                raise CheckpointError(f"{self.path}: corrupt safetensors header: tensor {name!r} "
                                      f"starts at data byte {b}, expected {pos} (gap or overlap)",
                                      self.path)
            pos = end
        expected = self.data_start + pos
        if size < expected:
            raise CheckpointError(f"{self.path}: truncated: the header describes {expected} bytes, "
                                  f"the file has {size}", self.path)
        if size > expected:
            raise CheckpointError(f"{self.path}: corrupt: {size - expected} unexpected bytes after "
                                  f"the last tensor (header describes {expected} bytes)", self.path)
        self._fd: int | None = None

    # -------------------------------------------------------------- access
    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def _handle(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def read_into(self, name: str, out: torch.Tensor, byte_offset: int = 0) -> torch.Tensor:
        """Fill the contiguous CPU tensor `out` with out.nbytes bytes of tensor `name`, starting
        byte_offset bytes into its data. No intermediate copy."""
        info = self.tensors[name]
        buf = as_bytes(out)
        if byte_offset + len(buf) > info.nbytes:
            raise ValueError(f"{self.path}: read of {len(buf)} bytes at {byte_offset} overruns "
                             f"{name} ({info.nbytes} bytes)")
        _pread_into(self._handle(), buf, info.start + byte_offset, self.path)
        return out

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name` (physical shape, torch dtype of its safetensors dtype), or the slice
        [start, stop) of dimension `dim` given in LOGICAL elements (for F4's last dim: even)."""
        info = self.tensors[name]
        pshape = list(info.physical_shape)
        dtype = info.torch_dtype
        if dim is None:
            out = torch.empty(pshape, dtype=dtype) if out is None else out
            return self.read_into(name, out)
        dim = dim % len(pshape)
        if info.dtype == "F4" and dim == len(pshape) - 1:
            if start % 2 or (stop is not None and stop % 2):
                raise ValueError(f"{name}: F4 slice bounds must be even, got [{start}, {stop})")
            start, stop = start // 2, (None if stop is None else stop // 2)
        stop = pshape[dim] if stop is None else stop
        if not 0 <= start <= stop <= pshape[dim]:
            raise ValueError(f"{name}: slice [{start}, {stop}) out of range for dim {dim} of {pshape}")
        local = list(pshape)
        local[dim] = stop - start
        out = torch.empty(local, dtype=dtype) if out is None else out
        if all(s == 1 for s in pshape[:dim]) or dim == 0:
            # rows of the outermost split dim are contiguous on disk
            inner = math.prod(pshape[dim + 1:]) * ST_DTYPES[info.dtype][1]
            return self.read_into(name, out, byte_offset=start * inner)
        view = self._memmap(info)
        item = ST_DTYPES[info.dtype][1] if dim == len(pshape) - 1 else 1
        index = tuple([slice(None)] * dim + [slice(start * item, stop * item)])
        out_bytes = as_bytes(out)
        np.copyto(np.frombuffer(out_bytes, dtype=np.uint8).reshape(view[index].shape), view[index])
        del view
        return out

    def _memmap(self, info: TensorInfo, writable_copy: bool = False) -> np.ndarray:
        itemsize = ST_DTYPES[info.dtype][1]
        shape = list(info.physical_shape)
        byte_shape = shape[:-1] + [shape[-1] * itemsize] if shape else [itemsize]
        if info.nbytes == 0:
            return np.zeros(byte_shape, dtype=np.uint8)
        return np.memmap(self.path, dtype=np.uint8, mode="c" if writable_copy else "r",
                         offset=info.start, shape=tuple(byte_shape))

    def memmap(self, name: str) -> torch.Tensor:
        """Tensor `name` memory-mapped from the file (copy-on-write: writes stay private, the
        file is never modified). Pages are read on first touch and can be dropped by the OS."""
        info = self.tensors[name]
        arr = self._memmap(info, writable_copy=True)
        t = torch.from_numpy(arr)
        if info.torch_dtype != torch.uint8 or ST_DTYPES[info.dtype][1] != 1:
            t = t.view(info.torch_dtype)
        return t.view(info.physical_shape)


class Checkpoint:
    """A checkpoint on disk: its config.json, index (if sharded) and shard files, validated."""

    def __init__(self, root: Path, files: dict[str, SafetensorsFile], index_path: Path | None,
                 weight_map: dict[str, str]):
        self.root, self.files, self.index_path = root, files, index_path
        self.weight_map = weight_map                      # tensor name -> file name
        self.tensors: dict[str, TensorInfo] = {n: files[f].info(n) for n, f in weight_map.items()}

    @property
    def config_path(self) -> Path:
        return self.root / CONFIG_NAME

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.tensors.values())

    @property
    def largest_shard_bytes(self) -> int:
        return max((f.size for f in self.files.values()), default=0)

    def file_of(self, name: str) -> SafetensorsFile:
        return self.files[self.weight_map[name]]

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def read(self, name: str, *args, **kwargs) -> torch.Tensor:
        return self.file_of(name).read(name, *args, **kwargs)

    def read_into(self, name: str, out: torch.Tensor, byte_offset: int = 0) -> torch.Tensor:
        return self.file_of(name).read_into(name, out, byte_offset)

    def memmap(self, name: str) -> torch.Tensor:
        return self.file_of(name).memmap(name)

    def names_in_file_order(self) -> list[str]:
        """Tensor names grouped by file and sorted by offset (sequential reads)."""
        return sorted(self.tensors, key=lambda n: (self.weight_map[n], self.tensors[n].start))

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -------------------------------------------------------------- open
    @classmethod
    def open(cls, path: str | Path) -> "Checkpoint":
        path = Path(path)
        if path.is_dir():
            if (path / INDEX_NAME).is_file():
                return cls._open_index(path / INDEX_NAME)
            if (path / SINGLE_NAME).is_file():
                return cls._open_single(path / SINGLE_NAME)
            found = sorted(p.name for p in path.glob("*.safetensors"))
            raise CheckpointError(f"{path}: no {INDEX_NAME} or {SINGLE_NAME} in this directory"
                                  + (f" (found {', '.join(found)})" if found else ""), path)
        if path.is_file():
            if path.name.endswith(".json"):
                return cls._open_index(path)
            return cls._open_single(path)
        raise CheckpointError(f"{path}: no such checkpoint directory or file", path)

    @classmethod
    def _open_single(cls, file: Path) -> "Checkpoint":
        f = SafetensorsFile(file)
        return cls(file.parent, {file.name: f}, None, {n: file.name for n in f.keys()})

    @classmethod
    def _open_index(cls, index: Path) -> "Checkpoint":
        root = index.parent
        try:
            raw = json.loads(index.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{index}: malformed index file ({exc})", index) from exc
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                               for k, v in wm.items()):
            raise CheckpointError(f"{index}: malformed index file (no 'weight_map' object of "
                                  f"tensor name -> shard file name)", index)
        names = sorted(set(wm.values()))
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard file(s) listed in the index do not exist in "
                                  f"{root}: {', '.join(missing)}", index, missing)
        files = {n: SafetensorsFile(root / n) for n in names}
        problems = []
        for tensor, fname in wm.items():
            if tensor not in files[fname]:
                problems.append(f"{tensor}: listed under {fname} but that file does not contain it")
        for fname, f in files.items():
            for tensor in f.keys():
                if tensor not in wm:
                    problems.append(f"{tensor}: stored in {fname} but not listed in the index")
                elif wm[tensor] != fname:
                    problems.append(f"{tensor}: stored in {fname} but the index says {wm[tensor]}")
        if problems:
            raise CheckpointError(f"{index}: the index does not match the shard files "
                                  f"({len(problems)} problems):\n  " + "\n  ".join(problems),
                                  index, problems)
        return cls(root, files, index, dict(wm))


# ----------------------------------------------------------------------------- progress
class Progress:
    """A one-line stderr progress counter (or a callback(done_bytes, total_bytes, name))."""

    def __init__(self, what: str, total_bytes: int, enabled, min_interval: float = 0.25):
        self.what, self.total, self.done, self.count = what, max(total_bytes, 1), 0, 0
        self.callback = enabled if callable(enabled) else None
        self.enabled = bool(enabled)
        self.t0 = self.last = time.monotonic()
        self.min_interval = min_interval

    def update(self, nbytes: int, name: str = "") -> None:
        self.done += nbytes
        self.count += 1
        if self.callback is not None:
            self.callback(self.done, self.total, name)
        elif self.enabled:
            now = time.monotonic()
            if now - self.last >= self.min_interval:
                self.last = now
                self._print(end="\r")

    def _print(self, end: str) -> None:
        dt = max(time.monotonic() - self.t0, 1e-9)
        gb = 1024 ** 3
        sys.stderr.write(f"[v41graph] {self.what}: {self.count} tensors, {self.done / gb:.2f}/"
                         f"{self.total / gb:.2f} GiB ({100 * self.done / self.total:.0f}%), "
                         f"{self.done / gb / dt:.2f} GiB/s{end}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.callback is None:
            self._print(end="\n")


def progress_default(progress, total_bytes: int):
    """progress=None: on for checkpoints of 1 GiB or more when stderr is a terminal."""
    if progress is None:
        return total_bytes >= 1024 ** 3 and sys.stderr.isatty()
    return progress


# ----------------------------------------------------------------------------- writer
@dataclass
class PlannedTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str = ""
    offset: int = 0             # absolute offset of the data in its file
    written: int = 0


def plan_shards(entries: Iterable[tuple[str, str, Sequence[int]]], max_shard_bytes: int,
                single_file: bool | None = None) -> list[list[PlannedTensor]]:
    """Greedy, in the given order: a new shard starts when the next tensor would push the
    current one past max_shard_bytes (a tensor larger than that gets a shard of its own).
    single_file=True puts everything in one shard."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    seen = set()
    for name, dtype, shape in entries:
        if name in seen:
            raise ValueError(f"tensor {name!r} listed twice")
        seen.add(name)
        if dtype not in ST_DTYPES:
            raise ValueError(f"{name}: unknown safetensors dtype {dtype!r}")
        p = PlannedTensor(name, dtype, tuple(int(s) for s in shape), nbytes_of(dtype, shape))
        if not single_file and shards[-1] and size + p.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def shard_file_names(n: int, single_file: bool | None = None) -> list[str]:
    if n == 1 and single_file is not False:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


class CheckpointWriter:
    """Streams tensors into a planned set of shards. Use as a context manager:

        with CheckpointWriter(dir, [(name, "F8_E4M3", [out, in]), ...], max_shard_bytes) as w:
            w.write(name, tensor)                  # whole tensor, or
            w.write(name, part, byte_offset=k)     # a piece (e.g. a block of table rows)

    On a clean exit every planned tensor must have been written completely; the shards are
    renamed into place and the index written. On an exception the partial files are removed.
    """

    def __init__(self, directory: str | Path, entries: Iterable[tuple[str, str, Sequence[int]]],
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, single_file: bool | None = None,
                 metadata: dict | None = None, progress=False):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        shards = plan_shards(entries, max_shard_bytes, single_file)
        self.file_names = shard_file_names(len(shards), single_file)
        self.multi = self.file_names[0] != SINGLE_NAME
        self.tensors: dict[str, PlannedTensor] = {}
        self._fds: dict[str, int] = {}
        self._remaining: dict[str, int] = {}
        meta = {"format": "pt", **(metadata or {})}
        total = 0
        try:
            for fname, shard in zip(self.file_names, shards):
                header: dict = {"__metadata__": {k: str(v) for k, v in meta.items()}}
                pos = 0
                for p in shard:
                    header[p.name] = {"dtype": p.dtype, "shape": list(p.shape),
                                      "data_offsets": [pos, pos + p.nbytes]}
                    pos += p.nbytes
                raw = json.dumps(header, separators=(",", ":")).encode()
                raw += b" " * (-len(raw) % 8)
                data_start = 8 + len(raw)
                fd = os.open(self._partial(fname), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                self._fds[fname] = fd
                _pwrite_all(fd, memoryview(len(raw).to_bytes(8, "little") + raw), 0)
                os.ftruncate(fd, data_start + pos)
                off = data_start
                for p in shard:
                    p.file, p.offset = fname, off
                    off += p.nbytes
                    self.tensors[p.name] = p
                self._remaining[fname] = pos
                total += pos
        except BaseException:
            self.abort()
            raise
        self.total_bytes = total
        self.progress = Progress("writing", total, progress)

    def _partial(self, fname: str) -> Path:
        return self.dir / (fname + ".partial")

    def write(self, name: str, tensor: torch.Tensor, byte_offset: int = 0) -> None:
        """Write the bytes of `tensor` (physical layout: F4 as [.., n/2] bytes or
        float4_e2m1fn_x2) at byte_offset within tensor `name`."""
        p = self.tensors.get(name)
        if p is None:
            raise KeyError(f"{name}: not in the planned checkpoint")
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        buf = as_bytes(t)
        if t.dtype != torch.uint8 and TORCH_TO_ST.get(t.dtype) != p.dtype:
            raise ValueError(f"{name}: {t.dtype} data does not match checkpoint dtype {p.dtype} "
                             f"(pass that dtype, or raw uint8 bytes)")
        if byte_offset < 0 or byte_offset + len(buf) > p.nbytes:
            raise ValueError(f"{name}: writing {len(buf)} bytes at {byte_offset} overruns its "
                             f"{p.nbytes} bytes ({p.dtype} {list(p.shape)})")
        fd = self._fds[p.file]
        _pwrite_all(fd, buf, p.offset + byte_offset)
        p.written += len(buf)
        self._remaining[p.file] -= len(buf)
        self.progress.update(len(buf), name)

    def close(self) -> list[Path]:
        """Check completeness, rename shards into place, write the index. Returns the files."""
        incomplete = [f"{p.name} ({p.written}/{p.nbytes} bytes)" for p in self.tensors.values()
                      if p.written != p.nbytes]
        if incomplete:
            self.abort()
            raise RuntimeError(f"{self.dir}: checkpoint incomplete, {len(incomplete)} tensors not "
                               f"fully written: " + ", ".join(incomplete[:20]))
        for fname, fd in self._fds.items():
            os.close(fd)
        self._fds.clear()
        for fname in self.file_names:
            os.replace(self._partial(fname), self.dir / fname)
        index = self.dir / INDEX_NAME
        if self.multi:
            wm = {p.name: p.file for p in self.tensors.values()}
            tmp = self.dir / (INDEX_NAME + ".partial")
            tmp.write_text(json.dumps({"metadata": {"total_size": self.total_bytes},
                                       "weight_map": dict(sorted(wm.items()))}, indent=2) + "\n")
            os.replace(tmp, index)
        elif index.exists():
            index.unlink()
        # stale shards of an earlier save into the same directory
        keep = set(self.file_names)
        for old in list(self.dir.glob("model-*-of-*.safetensors")) + [self.dir / SINGLE_NAME]:
            if old.name not in keep and old.is_file():
                old.unlink()
        self.progress.close()
        return [self.dir / f for f in self.file_names]

    def abort(self) -> None:
        for fname, fd in list(self._fds.items()):
            try:
                os.close(fd)
            except OSError:
                pass
            try:
                self._partial(fname).unlink()
            except OSError:
                pass
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False
