"""The rank spawner (zerocompile/tools/spawn.py): what a rank gets in its environment, what comes
back from it, and that no rank outlives the call, however it ends."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerocompile.tools import spawn

GRACE_BOUND = spawn.GRACE_AFTER_A_FAILURE + 30  # seconds: the grace, and starting the processes


def _report_environment(rank: int, names: list[str]) -> dict:
    maps = Path("/proc/self/maps").read_text()
    return {
        "variables": {name: os.environ.get(name) for name in names},
        "mapped": sorted({line.split()[-1] for line in maps.splitlines() if "malloc" in line.split()[-1]}),
    }


def _fail_on_rank_1(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    time.sleep(3600)  # as a rank may wait for good for a peer that died (a collective's timeout is long)


def _sleep(rank: int) -> None:
    time.sleep(3600)


def _crash(rank: int) -> None:
    import ctypes

    ctypes.string_at(0)  # reads address 0: a segmentation fault, as a crash inside a C++ library


def test_a_rank_that_crashes_prints_its_python_stack(capfd: pytest.CaptureFixture) -> None:
    with pytest.raises(spawn.RanksFailed, match=r"died of SIGSEGV \(signal 11, exit status -11\)"):
        spawn.spawn_ranks(_crash, 1, preload=None, timeout=120)
    printed = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in printed, printed[-2000:]
    assert 'in _crash' in printed, printed[-2000:]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_each_rank_gets_its_variables_and_the_parent_keeps_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZC_SPAWN_TEST_INHERITED", "from the parent")
    before = dict(os.environ)
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"]
    names += ["ZC_SPAWN_TEST_INHERITED", "ZC_SPAWN_TEST_EXTRA"]
    reports = spawn.spawn_ranks(
        _report_environment, 2, (names,), env={"ZC_SPAWN_TEST_EXTRA": "given"}, preload=None, timeout=120
    )
    assert dict(os.environ) == before
    seen = [report["variables"] for report in reports]
    port = seen[0]["MASTER_PORT"]
    assert port.isdigit() and seen[1]["MASTER_PORT"] == port
    for rank, variables in enumerate(seen):
        assert variables == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": "lo",
            "ZC_SPAWN_TEST_INHERITED": "from the parent", "ZC_SPAWN_TEST_EXTRA": "given",
        }  # fmt: skip


def test_auto_preloads_tcmalloc_where_installed_and_system_preloads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        tcmalloc = spawn.find_allocator("tcmalloc")
    except SystemExit:
        pytest.skip("tcmalloc is not installed here (apt-get install libtcmalloc-minimal4)")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert spawn.find_allocator("auto") == tcmalloc and "tcmalloc" in tcmalloc
    (auto,) = spawn.spawn_ranks(_report_environment, 1, (["LD_PRELOAD"],), preload=tcmalloc, timeout=120)
    assert auto == {"variables": {"LD_PRELOAD": tcmalloc}, "mapped": [os.path.realpath(tcmalloc)]}, "not on tcmalloc"
    assert "LD_PRELOAD" not in os.environ
    system = spawn.find_allocator("system")
    assert system is None
    (nothing,) = spawn.spawn_ranks(_report_environment, 1, (["LD_PRELOAD"],), preload=system, timeout=120)
    assert nothing == {"variables": {"LD_PRELOAD": None}, "mapped": []}


def test_a_users_preload_stays_first() -> None:
    environment = spawn.child_environment({"LD_PRELOAD": "/opt/libmine.so"}, "/usr/lib/libtcmalloc.so.4")
    assert environment["LD_PRELOAD"] == "/opt/libmine.so:/usr/lib/libtcmalloc.so.4"


def test_a_named_allocator_that_is_not_installed_names_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spawn, "_library_directories", lambda: [])
    with pytest.raises(SystemExit, match=r"jemalloc: libjemalloc.so.2 is not installed .*apt-get install libjemalloc2"):
        spawn.find_allocator("jemalloc")
    assert spawn.find_allocator("auto") is None, "auto falls back to the C library's malloc"


def test_a_failing_rank_reports_its_traceback_and_no_rank_is_left() -> None:
    pids: list[int] = []
    started = time.monotonic()
    with pytest.raises(spawn.RanksFailed) as failed:
        spawn.spawn_ranks(_fail_on_rank_1, 2, timeout=120, watch=lambda seen: pids[:] or pids.extend(seen))
    assert time.monotonic() - started < GRACE_BOUND
    assert str(failed.value).startswith("rank 1 failed"), str(failed.value)
    assert 'raise ValueError("rank 1 fails on purpose")' in failed.value.failures[1]
    assert "still running when the others had failed, killed" in failed.value.failures[0]
    assert len(pids) == 2 and not any(map(_alive, pids)), pids


def test_a_timeout_kills_every_rank() -> None:
    pids: list[int] = []
    with pytest.raises(TimeoutError, match="ranks still running after 20 s"):
        spawn.spawn_ranks(_sleep, 2, timeout=20, watch=lambda seen: pids[:] or pids.extend(seen))
    assert len(pids) == 2 and not any(map(_alive, pids)), pids


def test_a_function_of_main_is_refused_before_any_rank_runs_it() -> None:
    def local(rank: int) -> None: ...

    local.__module__ = "__main__"
    with pytest.raises(ValueError, match="defined in __main__"):
        spawn.spawn_ranks(local, 1, timeout=60)


def test_train_says_which_malloc_its_ranks_run_on_and_leaks_no_semaphore(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "zerocompile.tools.cli", "train", "--ranks", "2", "--steps", "2"]
    command += ["--compiler", "eager", "--batch-size", "4", "--sample-bytes", "0", "--out", str(tmp_path)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    first_line = result.stdout.splitlines()[0]
    assert first_line == spawn.allocator_line(spawn.find_allocator("auto")), result.stdout
    if spawn.find_allocator("auto") is not None:
        named = r"ranks preload /\S+/lib(tc|je)malloc\S* \(--allocator system to use the C library's malloc\)"
        assert re.fullmatch(named, first_line), first_line
    assert "leaked semaphore" not in result.stderr and "resource_tracker" not in result.stderr, result.stderr


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet (e.g. where PID 1 never reaps)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_ranks_die_with_a_killed_parent() -> None:
    driver = (
        "import sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_spawn\n"
        "from zerocompile.tools import spawn\n"
        "spawn.spawn_ranks(test_spawn._sleep, 2, timeout=600, watch=lambda pids: print(*pids, flush=True) or time.sleep(0.5))\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
    finally:
        parent.kill()  # SIGKILL: no finally block of the spawner runs
        parent.wait()
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(map(_gone, pids)), f"ranks {pids} outlived their killed parent"
