"""When a rank dies of a signal, its peers' error names it, the signal and where it was
(zerocompile/rank_deaths.py, zerocompile/death_watcher.py, the guard's CollectiveFailedError).

The description is tested on hand-written faulthandler reports and job directories; the watcher
as the process it is, fed through a pipe; the whole path on spawned gloo ranks, one of which dies
mid-step inside a compiled graph of a SIGSEGV, SIGABRT or SIGKILL.
"""

from __future__ import annotations

import ast
import ctypes
import faulthandler
import gc
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocompile as zc
from models import Linears
from ranks import run_on_ranks
from zerocompile import death_watcher, rank_deaths
from zerocompile.rank_deaths import Frame, RankDeaths, crashing_frames, describe_deaths_in
from zerocompile.tools import spawn

PG_TIMEOUT = timedelta(seconds=60)

# ------------------------------------------------------------------------------ a death mid-step

# Set in a rank by its job: which rank dies at which step, and how.
_DEATH: dict = {}
_STEP = [0]


@torch.library.custom_op("zc_test_rank_deaths::maybe_die", mutates_args=())
def maybe_die(x: torch.Tensor) -> torch.Tensor:
    """An op of the compiled graph: the identity, but on the chosen rank at the chosen step it dies."""
    if _DEATH.get("rank") == dist.get_rank() and _STEP[0] == _DEATH["step"]:
        if _DEATH["how"] == "SIGSEGV":
            ctypes.string_at(0)  # reads address 0, as a kernel with a bad pointer
        elif _DEATH["how"] == "SIGABRT":
            os.abort()  # as a failed C++ assertion or std::terminate
        else:
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer
    return x.clone()


@maybe_die.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _line_of(text: str, function=maybe_die._init_fn) -> int:
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


class DyingModel(Linears):
    def __init__(self) -> None:
        super().__init__(body=(16, 16), head=(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(maybe_die(x)))).square().mean()


def _train_until_a_peer_dies(rank: int, world_size: int, dying: int, how: str) -> dict:
    """Stage 3 on gloo, compiled: rank `dying` dies at step 3; the others report their error."""
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    torch.manual_seed(0)
    compiled = torch.compile(zc.shard(DyingModel(), stage=3), backend="zero", options={"compiler": "eager"})
    _DEATH.update(rank=dying, step=3, how=how)
    for step in range(1, 6):
        _STEP[0] = step
        started = time.monotonic()
        try:
            compiled(torch.randn(4, 16)).backward()
        except Exception as error:
            return {
                "type": type(error).__name__, "message": str(error), "seconds": time.monotonic() - started,
                "directory": str(rank_deaths.RANK_DEATHS.directory),
            }  # fmt: skip
    return {"type": None}


def _a_rank_dies(world_size: int, dying: int, how: str) -> tuple[dict, list[int]]:
    """Each rank's outcome of `_train_until_a_peer_dies`, by rank, and the ranks' pids. Not
    `spawn_ranks`, which keeps only the failures: the survivors' results are the point here."""
    port = spawn.free_loopback_port()
    children = [
        spawn.Child(spawn.child_environment(spawn.loopback_rank_environment(rank, world_size, port)))
        for rank in range(world_size)
    ]
    try:
        for rank, child in enumerate(children):
            child.submit(_train_until_a_peer_dies, (rank, world_size, dying, how))
            child.stop()
        outcomes = spawn.collect(children, timeout=600, grace=60)
    finally:
        for child in children:
            child.reap(within=10)
    for kind, value in outcomes.values():
        if kind == spawn.RETURNED and value["type"] is not None:
            # A crashed job leaves its directory (see rank_deaths): this one is the test's to remove.
            for path in Path(value["directory"]).glob("*"):
                path.unlink()
            Path(value["directory"]).rmdir()
            break
    return outcomes, [child.process.pid for child in children]


def _survivor(outcomes: dict, rank: int) -> dict:
    kind, value = outcomes[rank]
    assert kind == spawn.RETURNED, value
    assert value["type"] == "CollectiveFailedError", value
    # Failed on the closed connection, not at the process group's timeout.
    assert value["seconds"] < PG_TIMEOUT.total_seconds() / 2, value
    return value


def test_a_rank_dying_of_sigsegv_is_named_with_the_signal_and_its_frame() -> None:
    outcomes, pids = _a_rank_dies(2, dying=1, how="SIGSEGV")
    message = _survivor(outcomes, 0)["message"]
    first_line = message.splitlines()[0]
    assert first_line.startswith(f"rank 1 of 2 (pid {pids[1]}) died of SIGSEGV (signal 11) while in: "), message
    # The innermost frame is ctypes' own; the one the user can act on follows it.
    line = _line_of("ctypes.string_at(0)")
    assert f'called from File "{__file__}", line {line} in maybe_die: `ctypes.string_at(0)' in first_line, message
    assert "a collective in the forward of the zero-compiled graph" in message, message  # the advice follows
    kind, died = outcomes[1]
    assert kind == spawn.DIED and died.startswith("died of SIGSEGV (signal 11, exit status -11)"), died


def test_a_rank_killed_by_sigkill_is_named_as_gone_without_a_report() -> None:
    outcomes, pids = _a_rank_dies(2, dying=1, how="SIGKILL")
    message = _survivor(outcomes, 0)["message"]
    assert message.startswith(
        f"rank 1 of 2 (pid {pids[1]}) is gone without a fatal-error report: killed by a signal that cannot "
        "be caught (SIGKILL"
    ), message
    assert outcomes[1] == (spawn.DIED, "died of SIGKILL (signal 9, exit status -9) without a result (its process closed its pipe)")


def test_every_survivor_of_four_names_the_rank_that_aborted() -> None:
    outcomes, pids = _a_rank_dies(4, dying=2, how="SIGABRT")
    line = _line_of("os.abort()")
    for rank in (0, 1, 3):
        first_line = _survivor(outcomes, rank)["message"].splitlines()[0]
        assert first_line.startswith(f"rank 2 of 4 (pid {pids[2]}) died of SIGABRT (signal 6) while in: "), first_line
        assert f'line {line} in maybe_die: `os.abort()' in first_line, first_line


# ------------------------------------------------------------------------------ while a model lives


def _watch_over_a_models_life(rank: int, world_size: int) -> dict:
    deaths = rank_deaths.RANK_DEATHS
    report = {"watching at first": deaths.watching}
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    lone = zc.shard(nn.Linear(4, 4), stage=3, group=alone)
    report["watching a one-rank group"] = deaths.watching
    del lone
    gc.collect()
    for enabled in (True, False):
        faulthandler.enable() if enabled else faulthandler.disable()
        first, second = zc.shard(nn.Linear(4, 4), stage=3), zc.shard(nn.Linear(4, 4), stage=3)
        watcher, directory = deaths.watcher, deaths.directory
        seen = {"watching": deaths.watching, "record": (directory / f"rank-{rank}.json").is_file()}
        del first
        gc.collect()
        seen["watching with one model left"] = deaths.watching and deaths.watcher is watcher
        del second
        gc.collect()
        seen["watcher status"] = watcher.wait(timeout=60)
        seen["faulthandler"] = faulthandler.is_enabled()
        dist.barrier()  # every rank has let go of its model and removed its own record
        seen["files left"] = sorted(path.name for path in directory.glob("*"))
        seen["directory left"] = directory.exists()
        report[f"faulthandler enabled before: {enabled}"] = seen
    faulthandler.enable()  # as the spawned rank had it
    return report


def test_the_watch_lives_with_the_sharded_models_and_gives_faulthandler_back() -> None:
    for report in run_on_ranks(2, _watch_over_a_models_life, timeout=300, fresh=True):
        assert report["watching at first"] is False
        assert report["watching a one-rank group"] is False
        for enabled in (True, False):
            assert report[f"faulthandler enabled before: {enabled}"] == {
                "watching": True, "record": True, "watching with one model left": True, "watcher status": 0,
                "faulthandler": enabled, "files left": [], "directory left": False,
            }, enabled  # fmt: skip


@pytest.mark.fast
def test_start_and_stop_in_one_process_restore_faulthandler_and_leave_nothing(tmp_path: Path) -> None:
    was = faulthandler.is_enabled()
    try:
        for enabled in (True, False):
            faulthandler.enable() if enabled else faulthandler.disable()
            deaths = RankDeaths()
            deaths.start(tmp_path / "job", rank=3)
            assert deaths.watching and faulthandler.is_enabled()
            record = json.loads((tmp_path / "job" / "rank-3.json").read_text())
            assert record["pid"] == os.getpid() and record["start"] is not None
            deaths.stop()
            assert deaths.watcher.wait(timeout=60) == 0
            assert faulthandler.is_enabled() is enabled
            assert not (tmp_path / "job").exists()
    finally:
        faulthandler.enable() if was else faulthandler.disable()


@pytest.mark.fast
def test_a_forked_child_that_crashes_is_not_its_ranks_death(tmp_path: Path) -> None:
    deaths = RankDeaths()
    deaths.start(tmp_path, rank=0)
    (tmp_path / "rank-1.json").write_text("{}")  # a peer's record: the directory stays for a note
    try:
        child = os.fork()
        if child == 0:
            os.kill(os.getpid(), signal.SIGSEGV)
        _, status = os.waitpid(child, 0)
        assert os.WTERMSIG(status) == signal.SIGSEGV
    finally:
        deaths.stop()
    deaths.watcher.wait(timeout=60)
    assert not (tmp_path / "death-0.json").exists(), "the forked child's crash was recorded as the rank's death"


@pytest.mark.fast
def test_a_host_where_deaths_cannot_be_recorded_warns_and_goes_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("")  # a file where the job's directory would go
    monkeypatch.setattr(rank_deaths.tempfile, "gettempdir", lambda: str(blocked))
    monkeypatch.setattr(rank_deaths.dist.distributed_c10d, "_get_default_store", lambda: dist.HashStore())
    monkeypatch.setattr(rank_deaths.dist, "get_rank", lambda: 0)
    with pytest.warns(RuntimeWarning, match=f"cannot record in {blocked}/zerocompile-ranks-[0-9a-f]+ how this rank dies"):
        rank_deaths.watch_job()
    assert not rank_deaths.RANK_DEATHS.watching


# ------------------------------------------------------------------------------ the watcher process

REPORT = """Fatal Python error: Segmentation fault

Thread 0x00007f0b41fff6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0b49255b80 (most recent call first):
  File "/tmp/torchinductor_root/ab/cabcdef.py", line 123 in call
  File "/work/train.py", line 40 in step
  File "/work/train.py", line 52 in <module>

Extension modules: torch._C, numpy._core._multiarray_umath (total: 2)
"""


def _run_watcher(tmp_path: Path, *chunks: bytes) -> tuple[dict | None, bytes]:
    """The death note the watcher wrote after reading `chunks` from its pipe, and what it copied
    to stderr."""
    read_fd, write_fd = os.pipe()
    watcher = subprocess.Popen(
        [sys.executable, "-I", "-S", str(rank_deaths.WATCHER), str(read_fd), str(tmp_path), "5", "4242", "node7"],
        pass_fds=(read_fd,), stderr=subprocess.PIPE,
    )  # fmt: skip
    os.close(read_fd)
    for chunk in chunks:
        os.write(write_fd, chunk)
        time.sleep(0.05)  # separate reads, as a report arriving in pieces
    os.close(write_fd)
    _, stderr = watcher.communicate(timeout=60)
    assert watcher.returncode == 0, stderr
    note = tmp_path / "death-5.json"
    return (json.loads(note.read_text()) if note.exists() else None), stderr


@pytest.mark.fast
def test_the_watcher_copies_the_report_to_stderr_and_writes_a_note(tmp_path: Path) -> None:
    data = REPORT.encode()
    note, stderr = _run_watcher(tmp_path, data[:10], data[10:300], data[300:])
    assert stderr == data
    assert {key: note[key] for key in ("kind", "rank", "pid", "host", "signal", "signal_number", "report")} == {
        "kind": "signal", "rank": 5, "pid": 4242, "host": "node7", "signal": "SIGSEGV", "signal_number": 11,
        "report": REPORT,
    }  # fmt: skip
    assert [path.name for path in tmp_path.iterdir()] == ["death-5.json"]  # nothing half-written left


@pytest.mark.fast
def test_the_watcher_writes_no_note_when_the_pipe_closes_without_a_report(tmp_path: Path) -> None:
    assert _run_watcher(tmp_path) == (None, b"")


@pytest.mark.fast
def test_the_watcher_records_an_exception_the_rank_left_on_and_does_not_print_the_mark(tmp_path: Path) -> None:
    text = 'Traceback (most recent call last):\n  File "/work/train.py", line 9, in <module>\nValueError: boom\n'
    mark = death_watcher.EXCEPTION_MARK + json.dumps(text).encode() + b"\n"
    note, stderr = _run_watcher(tmp_path, mark[:7], mark[7:])
    assert stderr == b""
    assert (note["kind"], note["exception"], note["signal"]) == ("exception", text, None)


@pytest.mark.fast
def test_the_watcher_imports_the_standard_library_only() -> None:
    tree = ast.parse(Path(rank_deaths.WATCHER).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported


# ------------------------------------------------------------------------------ reading the notes


@pytest.mark.fast
@pytest.mark.parametrize(
    ("words", "name"),
    [("Segmentation fault", "SIGSEGV"), ("Aborted", "SIGABRT"), ("Bus error", "SIGBUS"),
     ("Floating point exception", "SIGFPE"), ("Illegal instruction", "SIGILL")],
)  # fmt: skip
def test_each_fatal_signal_faulthandler_reports_is_named(words: str, name: str) -> None:
    assert death_watcher.fatal_signal(f"Fatal Python error: {words}\n\nStack (most recent call first):\n") == name


@pytest.mark.fast
def test_the_crashing_threads_frames_are_read_innermost_first() -> None:
    assert crashing_frames(REPORT) == [
        Frame("/tmp/torchinductor_root/ab/cabcdef.py", 123, "call"),
        Frame("/work/train.py", 40, "step"),
        Frame("/work/train.py", 52, "<module>"),
    ]
    # A signal on a thread that never ran Python: no thread is the current one.
    assert crashing_frames(REPORT.replace("Current thread", "Thread")) is None
    assert crashing_frames("Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n  <no Python frame>\n") == []


def _note(pid: int, report: str = REPORT, exception: str | None = None) -> dict:
    return death_watcher.death_note(1, pid, "node7", report, exception)


def _write(directory: Path, name: str, value: dict) -> None:
    (directory / name).write_text(json.dumps(value))


def _a_line_to_point_at() -> int:
    return 42  # the line a hand-written report points at


@pytest.mark.fast
def test_a_note_is_described_with_the_innermost_frame_and_its_source(tmp_path: Path) -> None:
    line = _line_of("return 42", _a_line_to_point_at)
    report = REPORT.replace('"/tmp/torchinductor_root/ab/cabcdef.py", line 123 in call', f'"{__file__}", line {line} in _a_line_to_point_at')
    _write(tmp_path, "death-1.json", _note(777, report))
    assert describe_deaths_in(tmp_path, [0, 1], rank=0) == (
        f'rank 1 of 2 (pid 777) died of SIGSEGV (signal 11) while in: File "{__file__}", line {line} in '
        "_a_line_to_point_at: `return 42  # the line a hand-written report points at`"
    )


@pytest.mark.fast
def test_a_frame_in_an_installed_library_is_followed_by_the_users_own(tmp_path: Path) -> None:
    ctypes_file = ctypes.__file__
    report = REPORT.replace('"/tmp/torchinductor_root/ab/cabcdef.py", line 123 in call', f'"{ctypes_file}", line 1 in string_at')
    _write(tmp_path, "death-1.json", _note(777, report))
    described = describe_deaths_in(tmp_path, [0, 1], rank=0)
    assert f'while in: File "{ctypes_file}", line 1 in string_at' in described, described
    assert described.endswith(', called from File "/work/train.py", line 40 in step'), described  # no such file here: no source


@pytest.mark.fast
def test_a_rank_that_left_on_an_exception_is_described_by_it(tmp_path: Path) -> None:
    text = 'Traceback (most recent call last):\n  File "/work/train.py", line 9, in <module>\nValueError: boom\n'
    _write(tmp_path, "death-1.json", _note(777, "", text))
    assert describe_deaths_in(tmp_path, [0, 1], rank=0) == (
        'rank 1 of 2 (pid 777) exited on an uncaught Python exception, ValueError: boom, while in: File '
        '"/work/train.py", line 9 in <module>'
    )


def _record(pid: int, host: str | None = None) -> dict:
    return {"rank": 1, "pid": pid, "host": host or rank_deaths.socket.gethostname(), "start": rank_deaths.process_start_time(pid)}


@pytest.mark.fast
def test_a_rank_gone_without_a_note_is_named_as_killed_zombie_or_reaped(tmp_path: Path) -> None:
    ended = subprocess.Popen(["sleep", "0.1"])
    _write(tmp_path, "rank-1.json", _record(ended.pid))
    gone = (
        f"rank 1 of 2 (pid {ended.pid}) is gone without a fatal-error report: killed by a signal that cannot be "
        "caught (SIGKILL: the OOM killer, a launcher or a user)"
    )
    while Path(f"/proc/{ended.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    assert describe_deaths_in(tmp_path, [0, 1], rank=0, within=0.2).startswith(gone)  # exited, not yet reaped
    ended.wait()
    assert describe_deaths_in(tmp_path, [0, 1], rank=0, within=0.2).startswith(gone)


# A rank's script, ended as `ending` says, with a sharded model's finalizer as `shard()` leaves one.
_SCRIPT = """
import sys, weakref
from pathlib import Path
from zerocompile.rank_deaths import RankDeaths

class Model:
    pass

deaths, model = RankDeaths(), Model()
weakref.finalize(model, deaths.stop)  # registered first, as ProcessHooks.hold does
deaths.start(Path(sys.argv[1]), 1)
if sys.argv[2] == "raise":
    raise ValueError("boom")
"""


@pytest.mark.parametrize("ending", ["raise", "return"])
def test_a_rank_leaving_on_an_uncaught_exception_leaves_a_note_and_a_normal_end_nothing(tmp_path: Path, ending: str) -> None:
    job = tmp_path / "job"
    ended = subprocess.run([sys.executable, "-c", _SCRIPT, str(job), ending], capture_output=True, text=True, timeout=300)
    assert ended.returncode == (1 if ending == "raise" else 0), ended.stderr
    if ending == "return":
        time.sleep(1)  # a note written late would still be caught
        assert not job.exists(), list(job.iterdir())  # the finalizer ended the watch: no record left
        return
    deadline = time.monotonic() + 60  # the watcher writes once the rank is gone: wait for it
    while not (job / "death-1.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    note = json.loads((job / "death-1.json").read_text())
    assert note["kind"] == "exception" and note["exception"].endswith("ValueError: boom\n"), note
    described = describe_deaths_in(job, [0, 1], rank=0)
    assert described.startswith("rank 1 of 2 (pid ") and "exited on an uncaught Python exception, ValueError: boom, while in: " in described


# A rank dying inside the backward that Inductor compiled: AOTAutograd runs it with no hook of
# ours around it, so the survivor leaves on gloo's own error, uncaught, as a user's script does;
# what explains it is printed under the traceback as the survivor exits.
_DIES_IN_THE_BACKWARD = """
import ctypes, datetime, torch, torch.distributed as dist, zerocompile as zc
from torch import nn
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
model = zc.shard(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)), stage=3)
compiled = torch.compile(model, backend="zero")

def die_as_the_backward_starts(grad):
    ctypes.string_at(0)

for step in range(1, 6):
    loss = compiled(torch.randn(4, 16)).square().mean()
    if dist.get_rank() == 1 and step == 3:
        loss.register_hook(die_as_the_backward_starts)
    loss.backward()
print("all steps done", flush=True)
"""


def test_a_survivor_of_a_death_in_the_inductor_backward_names_the_dead_rank_as_it_exits(tmp_path: Path) -> None:
    port = spawn.free_loopback_port()
    script = tmp_path / "dies_in_the_backward.py"  # a file, so that the dead rank's line has its source
    script.write_text(_DIES_IN_THE_BACKWARD)
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=spawn.child_environment({**spawn.loopback_rank_environment(rank, 2, port), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor{rank}")}),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        for rank in range(2)
    ]  # fmt: skip
    try:
        (_out0, err0), (_out1, _err1) = [rank.communicate(timeout=600) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                os.killpg(rank.pid, signal.SIGKILL)
    assert ranks[1].returncode == -signal.SIGSEGV, _err1[-3000:]
    assert ranks[0].returncode == 1, err0[-3000:]
    # gloo's own error ("Connection closed by peer" or "reset by peer"), uncaught: not ours.
    assert "Check the logs of the remote worker" in err0 and "CollectiveFailedError" not in err0, err0[-3000:]
    explained = next((line for line in err0.splitlines() if line.startswith("zerocompile: rank 0 failed because ")), None)
    assert explained is not None, err0[-3000:]
    assert f"rank 1 of 2 (pid {ranks[1].pid}) died of SIGSEGV (signal 11) while in: " in explained, explained
    assert "die_as_the_backward_starts" in explained and "ctypes.string_at(0)" in explained, explained


@pytest.mark.fast
def test_an_earlier_attempts_note_is_not_this_ranks_death(tmp_path: Path) -> None:
    _write(tmp_path, "rank-1.json", _record(os.getpid()))  # alive: this process
    _write(tmp_path, "death-1.json", _note(os.getpid() + 1))
    described = describe_deaths_in(tmp_path, [0, 1], rank=0)
    assert described.startswith("no other rank of the group died on this host") and "rank 1 is alive here" in described


@pytest.mark.fast
def test_ranks_with_no_record_here_are_said_to_be_on_other_hosts_by_their_group_rank(tmp_path: Path) -> None:
    _write(tmp_path, "rank-6.json", _record(os.getpid(), host="elsewhere"))
    described = describe_deaths_in(tmp_path, [4, 6, 9], rank=0)
    assert f"ranks 1, 2 have no record here: on another host (a rank's death is recorded on its own host only, in {tmp_path} there)" in described
    _write(tmp_path, "death-6.json", _note(os.getpid()))
    assert describe_deaths_in(tmp_path, [4, 6, 9], rank=0).startswith(f"rank 1 of 3 (global rank 6, pid {os.getpid()}) died of SIGSEGV")
