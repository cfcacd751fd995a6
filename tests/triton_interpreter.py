"""Running a test script under Triton's CPU interpreter (TRITON_INTERPRET=1), which must be set
before Triton is imported, hence a subprocess: what the interpreter tests share."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# Put first in every script. Triton 3.6's interpreter turns a runtime loop bound into an int
# with int(ndarray of one element), which numpy >= 2.4 refuses; take the element instead.
PREAMBLE = textwrap.dedent("""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as ti
    _patch = ti._patch_lang
    def _patch_lang(fn):
        scope = _patch(fn)
        tl.core.tensor.__index__ = lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])
        return scope
    ti._patch_lang = _patch_lang

    # The interpreter's float downcasts truncate (fp32 -> bf16 with no rounding mode) or round
    # half up and drop the mantissa carry (fp32 -> E4M3: 127 becomes 64); a GPU rounds to nearest
    # even, as torch's casts do, so those casts go through torch (round toward zero kept as is).
    import torch as _torch
    _convert_float = ti._convert_float
    _AS_TORCH = {"fp32": (_torch.float32, np.float32), "fp16": (_torch.float16, np.float16),
                 "bf16": (_torch.bfloat16, np.int16), "fp8e4nv": (_torch.float8_e4m3fn, np.uint8)}
    _BITS = {1: _torch.uint8, 2: _torch.int16, 4: _torch.int32}
    def _convert_float_rtne(data, src_type, dst_type, rounding_mode):
        src, dst = _AS_TORCH.get(src_type.name), _AS_TORCH.get(dst_type.name)
        if src is None or dst is None or rounding_mode == ti._ir.ROUNDING_MODE.RTZ:
            return _convert_float(data, src_type, dst_type, rounding_mode)
        t = _torch.from_numpy(np.ascontiguousarray(data).view(src[1])).view(src[0])
        return t.to(dst[0]).view(_BITS[dst[0].itemsize]).numpy()
    ti._convert_float = _convert_float_rtne

    # It multiplies bf16 tiles as their raw 16-bit patterns (integers); widen them to fp32 first
    # (exact), as it already does for FP8 tiles (to fp16).
    _create_dot = ti.InterpreterBuilder.create_dot
    def _create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(t):
            if t.dtype != tl.bfloat16:
                return t
            return ti.TensorHandle(_convert_float_rtne(t.data, tl.bfloat16, tl.float32, None).view(np.float32),
                                   tl.float32)
        return _create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)
    ti.InterpreterBuilder.create_dot = _create_dot_bf16

    # Triton 3.9's interpreter splats a compare's scalar (int1) as int32, so `vector_mask & scalar`
    # becomes an int32 mask its loads refuse ("mask has unsupported dtype"); keep it boolean.
    _create_splat = ti.InterpreterBuilder.create_splat
    def _create_splat_keep_bool(self, ret_ty, arg):
        out = _create_splat(self, ret_ty, arg)
        if np.asarray(arg.data).dtype == np.bool_ and out.data.dtype != np.bool_:
            return ti.TensorHandle(out.data.astype(np.bool_), tl.int1)
        return out
    ti.InterpreterBuilder.create_splat = _create_splat_keep_bool
""")


def run_interpreted(script: str, tmp_path, *args: str) -> list[str]:
    """PREAMBLE + script (dedented) run in a fresh Python under the interpreter, with this
    process's import path and the tests folder on it; asserts it exits 0 and returns its
    stdout lines."""
    path = tmp_path / "interpreted.py"
    path.write_text(PREAMBLE + textwrap.dedent(script))
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([tests_dir] + sys.path))
    proc = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()
