"""Running a test script under Triton's CPU interpreter (TRITON_INTERPRET=1), which must be set
before Triton is imported, hence a subprocess: what the interpreter tests share."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# Put first in every script: triton 3.6's interpreter turns a runtime loop bound into an int
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
