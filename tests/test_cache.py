"""The cache as users see it: list, clean, busy entries kept, and refusing to
load what another user could have written; loader errors explained."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opforge.builder import BuildError, check_safe_to_load, store
from opforge.builder.prebuilt import explain_load_error, load_library_file


def _entry(root: Path, name: str, complete: bool, age_days: float = 0.0) -> Path:
    d = root / f"{name}-{'ab' * 8}"
    d.mkdir(parents=True)
    (d / f"{name}.so").write_bytes(b"\0" * 1000)
    if complete:
        (d / "COMPLETE.json").write_text('{"size": 1000, "sha256": "x", "seconds": 2.5}')
    t = time.time() - age_days * 86400
    os.utime(d, (t, t))
    return d


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    r = tmp_path / "cache"
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(r))
    r.mkdir(mode=0o700)
    return r


def test_list_reports_complete_and_debris(root):
    _entry(root, "lib_a", complete=True)
    _entry(root, "lib_b", complete=False)
    (root / "ceilings").mkdir()  # not an entry
    found = {e.name: e for e in store.entries()}
    assert set(found) == {"lib_a", "lib_b"}
    assert found["lib_a"].complete and found["lib_a"].build_seconds == 2.5 and found["lib_a"].size >= 1000
    assert not found["lib_b"].complete


def test_clean_older_than_keeps_recent_and_busy(root):
    old = _entry(root, "old", complete=True, age_days=10)
    new = _entry(root, "new", complete=True, age_days=0)
    busy = _entry(root, "busy", complete=True, age_days=10)
    with open(root / f"{busy.name}.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a build in progress
        removed, kept = store.clean(older_than_days=7)
    assert [e.name for e in removed] == ["old"] and [e.name for e in kept] == ["busy"]
    assert not old.exists() and new.exists() and busy.exists()
    removed, kept = store.clean()
    assert {e.name for e in removed} == {"new", "busy"} and not kept
    assert store.entries() == []


def _exited_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_a_failed_fast_path_builds_log_is_listed_and_cleaned_once_its_starter_is_gone(root, opforge_here):
    # The log of a background build that failed after the process that started it had exited:
    # no one reads it. A log whose starter is alive (this process) is that process's to read.
    orphan = root / f"opforge_fast-build-{_exited_pid()}.log"
    orphan.write_text("error: the compiler said no\n")
    live = root / f"opforge_fast-build-{os.getpid()}.log"
    live.write_text("building\n")

    def opforge(*args: str) -> str:
        code, out, err = opforge_here(*args)
        assert code == 0, out + err
        return out

    # While a build of the fast path holds its lock, the log may be that build's own: it is kept.
    with open(root / f"opforge_fast-{'ab' * 8}.objects.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert store.failed_build_logs() == []
    listed = opforge("cache", "list")
    assert f"a failed build of the eager fast path left its log: {orphan}" in listed and live.name not in listed
    assert store.clean_failed_build_logs(older_than_days=7) == []  # written just now
    assert orphan.exists()
    cleaned = opforge("cache", "clean")
    assert f"removed {orphan.name} (the log of a failed build of the eager fast path)" in cleaned
    assert not orphan.exists() and live.exists()


def test_inline_sources_and_other_routes_are_listed_and_cleaned(root):
    from opforge.builder.inline import _write_sources

    src = _write_sources("strings_op", {"strings_op.cpp": "int x;\n"})
    t = time.time() - 30 * 86400
    os.utime(src, (t, t))
    fresh = _write_sources("fresh_op", {"fresh_op.cpp": "int y;\n"})
    cmake = root / f"cmake-user_op-{'cd' * 8}"
    cmake.mkdir()
    (cmake / "CMakeCache.txt").write_text("")
    found = {e.name: e for e in store.entries()}
    assert {"inline/strings_op", "inline/fresh_op", "cmake-user_op"} <= set(found)
    assert found["cmake-user_op"].complete and found["inline/strings_op"].complete
    removed, _ = store.clean(older_than_days=7)
    assert [e.name for e in removed] == ["inline/strings_op"]
    assert not src.exists() and fresh.exists()
    # Reusing the same strings marks the folder as used now.
    _write_sources("fresh_op", {"fresh_op.cpp": "int y;\n"})
    assert time.time() - fresh.stat().st_mtime < 60


def test_refuses_a_group_writable_cache(root):
    d = _entry(root, "lib", complete=True)
    so = d / "lib.so"
    check_safe_to_load(so)
    root.chmod(0o770)
    with pytest.raises(BuildError, match=r"writable by its group \(mode 0770\).*chmod go-w"):
        check_safe_to_load(so)
    root.chmod(0o700)
    so.chmod(0o646)
    with pytest.raises(BuildError, match="writable by others"):
        check_safe_to_load(so)


@pytest.mark.skipif(os.getuid() != 0, reason="only root can give a file to another user")
def test_refuses_a_library_owned_by_another_user(root):
    d = _entry(root, "lib", complete=True)
    os.chown(d, 65534, 65534)
    with pytest.raises(BuildError, match=r"belongs to uid 65534, not to you.*OPFORGE_CACHE_DIR"):
        check_safe_to_load(d / "lib.so")


def test_load_library_file_explains_itself(tmp_path):
    with pytest.raises(BuildError, match="no library at"):
        load_library_file(tmp_path / "missing.so")
    bogus = tmp_path / "bogus.so"
    bogus.write_bytes(b"not an ELF file")
    with pytest.raises(BuildError, match=r"could not load .*bogus\.so"):
        load_library_file(bogus)
    bogus.chmod(0o666)
    with pytest.raises(BuildError, match="refusing to load"):
        load_library_file(bogus)


def test_loader_messages_are_explained():
    p = Path("/x/libops.so")
    msg = explain_load_error(p, "libc10.so: cannot open shared object file: No such file or directory")
    assert "import torch" in msg
    msg = explain_load_error(p, "/x/libops.so: undefined symbol: _ZN3c106detail14torchCheckFailEPKcS2_jRKSs")
    assert "another torch" in msg and "_GLIBCXX_USE_CXX11_ABI" in msg and "torchCheckFail" in msg
    assert explain_load_error(p, "/x/libops.so: invalid ELF header").startswith("libops.so is not a shared library")
    assert explain_load_error(p, "something else") == ""


def test_cache_dir_that_is_a_file_is_named_with_the_fix(tmp_path, monkeypatch):
    from opforge import cli
    from opforge.builder.store import CacheDirError, cache_root

    afile = tmp_path / "not-a-dir"
    afile.write_text("")
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(afile))
    expected = f"opforge: OPFORGE_CACHE_DIR={afile} is a file, not a directory: set OPFORGE_CACHE_DIR to a directory you can write"
    with pytest.raises(CacheDirError) as info:
        cache_root()
    assert str(info.value).startswith(expected)
    with pytest.raises(SystemExit) as info:
        cli.main(["cache", "list"])
    assert str(info.value.code).startswith(expected)
    # The import builds into the cache: the same one line, not FileExistsError from deep inside pathlib.
    src = str(Path(__file__).resolve().parent.parent / "src")
    res = subprocess.run(
        [sys.executable, "-c", "import opforge"], env={**os.environ, "PYTHONPATH": src}, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 1 and "FileExistsError" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1].endswith(expected + " (or remove the file)"), res.stderr


def test_read_only_cache_dir_is_named_with_the_fix(root, monkeypatch):
    from opforge import cli
    from opforge.builder import store
    from opforge.builder.prebuilt import load_op_library

    _entry(root, "lib_a", complete=True)
    # Stands in for a directory mode 0500 even when the tests run as root, who may write anywhere.
    monkeypatch.setattr(store, "_accessible", lambda path, mode: not mode & os.W_OK)
    monkeypatch.setenv("OPFORGE_LIBRARY", "jit")
    with pytest.raises(store.CacheDirError, match=rf"OPFORGE_CACHE_DIR={root} cannot be written by you \(mode 0700\): chmod 700 {root}"):
        load_op_library()
    assert [e.name for e in store.entries()] == ["lib_a"], "listing needs no write access"
    with pytest.raises(SystemExit) as info:
        cli.main(["cache", "clean"])
    assert str(info.value.code).startswith(f"opforge: OPFORGE_CACHE_DIR={root} cannot be written by you")
    monkeypatch.setattr(store, "_accessible", lambda path, mode: False)
    with pytest.raises(SystemExit) as info:
        cli.main(["cache", "list"])
    assert str(info.value.code).startswith(f"opforge: OPFORGE_CACHE_DIR={root} cannot be read by you (mode 0700): chmod 700 {root}")


@pytest.mark.skipif(os.getuid() == 0, reason="root may write into a read-only directory")
def test_really_read_only_cache_dir(root):
    from opforge.builder.store import CacheDirError, cache_root

    root.chmod(0o500)
    try:
        with pytest.raises(CacheDirError, match=r"cannot be written by you \(mode 0500\)"):
            cache_root()
        assert cache_root(write=False) == root
    finally:
        root.chmod(0o700)


@pytest.mark.parametrize("where", ["/", "/usr", "/tmp", "/etc/", "~", "/usr/../"])
def test_cache_dir_at_a_filesystem_root_or_system_folder_is_refused(where, monkeypatch):
    from opforge import cli
    from opforge.builder.store import CacheDirError, cache_root

    monkeypatch.setenv("OPFORGE_CACHE_DIR", where)
    with pytest.raises(
        CacheDirError, match=r"OPFORGE_CACHE_DIR=.* is /\S*, a system directory or a filesystem's root: set OPFORGE_CACHE_DIR"
    ):
        cache_root()
    with pytest.raises(SystemExit) as info:
        cli.main(["cache", "list"])
    assert "a system directory or a filesystem's root" in str(info.value.code)
