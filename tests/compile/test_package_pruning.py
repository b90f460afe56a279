"""Compiled packages no start has used for ``UNUSED_DAYS`` are removed
(specdec.compile.aot.mark_used / prune_unused): a cache does not grow with
every code, torch or model version it has seen."""

import os
import time

from specdec.compile import aot

DAY = 86400


def package_root(parent, name, used_days_ago=None, built_days_ago=0.0):
    """A package directory; ``used_days_ago``: its mark's age (None: no mark, as an older specdec left it)."""
    root = parent / name
    root.mkdir(parents=True)
    (root / "step-w1-c256-packed.pt2").write_bytes(b"pt2")
    if used_days_ago is not None:
        mark = root / aot.USED_MARK
        mark.touch()
        os.utime(mark, (time.time() - used_days_ago * DAY,) * 2)
    os.utime(root, (time.time() - built_days_ago * DAY,) * 2)
    return root


def test_directories_unused_for_long_are_removed_and_the_rest_kept(tmp_path):
    parent = tmp_path / "specdec-aot"
    recent = package_root(parent, "recent", used_days_ago=1, built_days_ago=60)
    stale = package_root(parent, "stale", used_days_ago=30, built_days_ago=60)
    unmarked_old = package_root(parent, "unmarked-old", built_days_ago=20)
    unmarked_new = package_root(parent, "unmarked-new", built_days_ago=2)
    (parent / "stray-file").write_text("not a package directory")
    removed = aot.prune_unused(parent)
    assert sorted(p.name for p in removed) == ["stale", "unmarked-old"]
    assert recent.is_dir() and unmarked_new.is_dir() and (parent / "stray-file").exists()
    assert not stale.exists() and not unmarked_old.exists()
    assert aot.prune_unused(tmp_path / "missing") == []


def test_a_start_marks_what_it_uses_and_prunes_once(tmp_path, monkeypatch):
    monkeypatch.setattr(aot, "_pruned", set())
    parent = tmp_path / "specdec-aot"
    stale = package_root(parent, "stale", used_days_ago=30)
    used = parent / "in-use"
    aot.mark_used(used)
    assert (used / aot.USED_MARK).stat().st_mtime > time.time() - 60
    assert not stale.exists()
    again = package_root(parent, "stale-again", used_days_ago=30)
    aot.mark_used(parent / "other")              # the same cache: pruned once per process
    assert again.exists() and (parent / "other" / aot.USED_MARK).exists()
