"""GraphPass.uuid() covers the code a pass runs: its own module and every module of
v41graph.passes / v41graph.custom_ops it imports from, so editing a shared helper changes the
uuid of exactly the passes that use it (caches keyed on the pass list must notice)."""
from __future__ import annotations

import inspect

import pytest

import v41graph.custom_ops.streams as streams
import v41graph.passes.base as base
import v41graph.passes.patterns as patterns
from v41graph.passes.pass_manager import PASS_CLASSES, PassManager

RMSNORM_FUSIONS = {"fuse_wkv_rmsnorm", "fuse_pool_rmsnorm", "fuse_rmsnorm"}
STREAM_PASSES = {"hoist_engram", "dual_stream", "mhc_side_stream",      # through side_stream.py
                 "overlap_collectives"}                # its barriers


def _uuids() -> dict:
    return {name: cls().uuid() for name, cls in PASS_CLASSES.items()}


def _edit(monkeypatch, module) -> None:
    """Make inspect.getsource (what uuid() reads) see `module` with one more line."""
    real = inspect.getsource

    def edited(obj):
        src = real(obj)
        return src + "\n# an edit\n" if obj is module else src
    monkeypatch.setattr(inspect, "getsource", edited)


def test_uuids_are_stable_and_distinct():
    first, again = _uuids(), _uuids()
    assert first == again
    assert len(set(first.values())) == len(first)
    assert all(len(u) == 16 for u in first.values())
    assert PassManager().uuid() == "-".join(first[n] for n in PassManager().names)


@pytest.mark.parametrize("module, users", [(patterns, RMSNORM_FUSIONS), (streams, STREAM_PASSES),
                                           (base, set(PASS_CLASSES))])
def test_editing_a_helper_changes_the_uuid_of_exactly_the_passes_using_it(monkeypatch, module, users):
    before = _uuids()
    _edit(monkeypatch, module)
    after = _uuids()
    changed = {n for n in before if before[n] != after[n]}
    assert changed == users
    monkeypatch.undo()
    assert _uuids() == before


def test_the_closure_follows_imports():
    closure = base.source_closure(PASS_CLASSES["fuse_pool_rmsnorm"].__module__)
    assert set(closure) == {"v41graph.passes.fuse_pool_rmsnorm", "v41graph.passes.patterns",
                            "v41graph.passes.base"}
    assert closure["v41graph.passes.patterns"] == inspect.getsource(patterns)
