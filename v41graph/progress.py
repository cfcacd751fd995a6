"""Progress of the long steps (tracing, CUDA-graph capture, checkpoint loading): every step is
logged through `logging` (logger names under "v41graph", INFO), and a tqdm bar is drawn on a
terminal, as vLLM does ("Capturing CUDA graphs: 100%|...| 4/4").

Bars are drawn only when stderr is a terminal and the process is not quiet (`set_quiet(True)`,
what the command lines' `--quiet` calls); a caller's explicit True/False wins. tqdm is a core
dependency (small, pure Python, no dependencies of its own), so there is one code path.
"""
from __future__ import annotations

import logging
import sys

from tqdm.auto import tqdm

__all__ = ["bar", "bars_enabled", "set_quiet", "is_quiet", "configure_logging"]

_QUIET = False


def set_quiet(quiet: bool = True) -> None:
    """No bars and no INFO log lines from the command lines (errors still print)."""
    global _QUIET
    _QUIET = bool(quiet)


def is_quiet() -> bool:
    return _QUIET


def bars_enabled(show: bool | None = None) -> bool:
    """show=None: on a terminal unless quiet; True/False: as told."""
    if show is not None:
        return bool(show)
    return not _QUIET and sys.stderr.isatty()


def bar(iterable=None, *, desc: str, total=None, unit: str = "it", show: bool | None = None, **kwargs):
    """A tqdm bar on stderr (disabled, but still counting, when bars are off)."""
    return tqdm(iterable, desc=desc, total=total, unit=unit, disable=not bars_enabled(show),
                file=sys.stderr, dynamic_ncols=True, **kwargs)


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record, not as it was when the handler was made
    (a test harness or a redirecting caller swaps it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def configure_logging(quiet: bool = False) -> None:
    """For the command lines: v41graph's INFO lines on stderr as `[v41graph] message`, none
    with quiet (warnings still). Does nothing if the application configured logging itself."""
    set_quiet(quiet)
    log = logging.getLogger("v41graph")
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    passes = logging.getLogger("v41graph.passes")   # a line per pass and graph: TORCH_LOGS asks for those
    if passes.level == logging.NOTSET:
        passes.setLevel(logging.WARNING)
    if not log.handlers and not logging.getLogger().handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[v41graph] %(message)s"))
        log.addHandler(handler)
