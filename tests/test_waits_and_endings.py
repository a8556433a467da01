"""Regressions of issue 12 (process side): every wait bounded, every ending noticed at once.

2. rank_zero_first's followers raise DistTimeout (with the who-is-where report) at the group
   timeout when rank 0 hangs inside the block, instead of waiting forever.
4. An idle connection to a rank's data listener does not stall init; a worker that ends
   before joining is reported to the other ranks at once, by the launcher.
5. The launcher's store requires a per-job token by default (handed over in the
   environment), and the store bounds the total size of what it holds.
6. The async worker thread drops each job's closure when the job ends and is joined at
   destroy.
7. destroy racing an answer to "where are you?" never raises; a SIGKILLed launcher
   takes every process of its job with it, grandchildren included.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import _procs
import pytest
from launch_scripts.helpers import (
    ROOT,
    SCRIPTS,
    env,
    launcher_cmd,
    marked_processes,
    read_lines_until,
)

import rankwise
from rankwise.launch.watchdog import RUN_DIR_PREFIX, remove_run_dir
from rankwise.testing import run_ranks

FAULT = str(SCRIPTS / "fault_worker.py")


# --- 2: rank_zero_first is bounded ------------------------------------------------------------

def _rzf_hang(rank: int, world_size: int) -> dict[str, Any]:
    import rankwise as dist

    start = time.monotonic()
    try:
        with dist.rank_zero_first():
            if rank == 0:
                # "deadlocked" inside the block: past the followers' 3 s timeout with 4 s
                # to spare (were it shorter than their wait, they would end without an
                # error and the test would fail, not pass)
                threading.Event().wait(7.0)
    except dist.DistTimeout as exc:
        return {"raised": "DistTimeout", "after": time.monotonic() - start,
                "message": str(exc), "report": exc.report}
    return {"raised": None, "after": time.monotonic() - start}


@pytest.mark.slow
@pytest.mark.procs
def test_rank_zero_first_followers_time_out_with_report() -> None:
    res = run_ranks(_rzf_hang, 2, timeout=60, init_kwargs={"timeout": 3.0})
    follower = res[1].value
    assert follower is not None, res[1].traceback
    assert follower["raised"] == "DistTimeout", follower
    assert follower["after"] < 10.0, follower
    assert "rank_zero_first" in follower["message"]
    assert "rank 0" in follower["message"]
    assert follower["report"], "no who-is-where report"


# --- 4: init ----------------------------------------------------------------------------------

class _IntrudingStore:
    """A store that, the moment rank 0 publishes its data address, has a stranger open a
    connection there that never says a word (before any honest rank can connect)."""

    def __init__(self) -> None:
        from rankwise.store import HashStore

        self.inner = HashStore()
        self.idle: list[socket.socket] = []

    def set(self, key: str, value: bytes | str) -> None:
        self.inner.set(key, value)
        if key == "mesh/addr/0":
            from rankwise.transport.crowding import parse

            text = value.decode() if isinstance(value, bytes) else value
            host, _, port = parse(text)[0].rpartition(":")  # "host:port cpus"
            self.idle.append(socket.create_connection((host, int(port))))

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def wait(self, keys: list[str], timeout: float) -> None:
        self.inner.wait(keys, timeout)


class _ClosedUnderUs:
    """A listener that ``connect()`` closes while the accepting thread is between two
    calls on it: CI saw ``settimeout`` fail with EBADF there, and that error, recorded
    after every peer had connected, failed an init that had succeeded."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop

    def settimeout(self, seconds: float) -> None:
        self._stop.set()  # connect() is done with it ...
        raise OSError(9, "Bad file descriptor")  # ... and closed it

    def accept(self) -> Any:
        raise AssertionError("not reached")


def test_listener_closed_by_a_finished_connect_is_no_error() -> None:
    from rankwise.transport.mesh import Mesh

    mesh = Mesh(0, 2, _IntrudingStore(), b"job", None, "127.0.0.1", 20.0)
    mesh._accept_all(_ClosedUnderUs(mesh._stop), time.monotonic() + 10.0)  # type: ignore[arg-type]
    assert mesh._errors == []


def test_idle_connection_to_data_listener_does_not_stall_init() -> None:
    from rankwise.transport.mesh import Mesh

    store = _IntrudingStore()
    results: dict[int, Any] = {}

    def connect(rank: int) -> None:
        try:
            mesh = Mesh(rank, 2, store, b"job", b"s3cret", "127.0.0.1", 20.0)
            results[rank] = mesh.connect()
        except BaseException as exc:  # noqa: BLE001
            results[rank] = exc

    start = time.monotonic()
    threads = [threading.Thread(target=connect, args=(r,)) for r in (0, 1)]
    threads[0].start()
    store.inner.wait(["mesh/addr/0"], timedelta(seconds=10))
    threads[1].start()
    for t in threads:
        t.join(30)
    took = time.monotonic() - start
    try:
        for r in (0, 1):
            assert isinstance(results[r], dict), results[r]
        assert took < 10.0, f"init took {took:.1f}s"
    finally:
        for s in store.idle:
            s.close()
        for r in (0, 1):
            if isinstance(results.get(r), dict):
                for sock in results[r].values():
                    sock.close()


def _run_fault(tmp_path: Path, n: int, kind: str, place: str, rank: int,
               timeout: float = 60.0, hard: float = 60.0,
               extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = env()
    e.update(FAULT_RANK=str(rank), FAULT_KIND=kind, FAULT_PLACE=place,
             FAULT_TIMEOUT=str(timeout), FAULT_OUT=str(tmp_path))
    e.update(extra_env or {})
    return _procs.run(launcher_cmd("-n", str(n), "--grace", "3", FAULT), env=e, timeout=hard,
                      cwd=ROOT)


def _result(tmp_path: Path, rank: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((tmp_path / f"result_{rank}.json").read_text())
    return data


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["exit0", "exit3"])
@pytest.mark.procs
def test_rank_ending_before_init_is_reported_at_once(tmp_path: Path, kind: str) -> None:
    start = time.monotonic()
    res = _run_fault(tmp_path, 2, kind, "init", 1, timeout=60.0, hard=50.0)
    took = time.monotonic() - start
    assert res.returncode != 0, res.stderr
    survivor = _result(tmp_path, 0)
    assert survivor["type"] == "RendezvousError", survivor
    assert "rank 1" in survivor["message"]
    assert ("exit code 0" if kind == "exit0" else "exit code 3") in survivor["message"], survivor
    assert survivor["elapsed"] < 15.0
    assert took < 40.0


# --- 5: the launcher's store is authenticated, and bounded ------------------------------------

@pytest.mark.procs
def test_launcher_hands_workers_a_token_by_environment(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, sys, json\n"
        "from datetime import timedelta\n"
        "from rankwise.store import TCPStore\n"
        "from rankwise.errors import AuthError\n"
        "tok = os.environ.pop('RANKWISE_TOKEN', '')  # a stranger: no token\n"
        "try:\n"
        "    TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']),\n"
        "             is_master=False, token=None, timeout=timedelta(seconds=5))\n"
        "    verdict = 'accepted'\n"
        "except AuthError:\n"
        "    verdict = 'refused'\n"
        "cmd = open('/proc/%d/cmdline' % os.getppid(), 'rb').read().decode()\n"
        f"open({str(tmp_path / 'out.json')!r}, 'w').write(json.dumps(\n"
        "    {'len': len(tok), 'verdict': verdict, 'in_cmdline': bool(tok) and tok in cmd}))\n")
    res = _procs.run(launcher_cmd("-n", "1", str(probe)), env=env(), timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["len"] >= 32, out
    assert out["verdict"] == "refused", out
    assert not out["in_cmdline"]


def test_token_from_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwise.wire.auth import resolve_token

    path = tmp_path / "tok"
    path.write_text("from-a-file\n")
    monkeypatch.delenv("RANKWISE_TOKEN", raising=False)
    monkeypatch.setenv("RANKWISE_TOKEN_FILE", str(path))
    assert resolve_token(None) == b"from-a-file"


def test_store_bounds_its_total_size() -> None:
    from rankwise.store import TCPStore, TCPStoreServer
    from rankwise.store.protocol import DEFAULT_LIMITS, Limits

    assert DEFAULT_LIMITS.max_total_bytes <= 256 << 20
    limits = Limits(max_value_bytes=1 << 20, max_total_bytes=3 << 20)
    with TCPStoreServer("127.0.0.1", 0, limits=limits) as server:
        client = TCPStore("127.0.0.1", server.port, is_master=False,
                          timeout=timedelta(seconds=10))
        blob = b"x" * (1 << 20)
        client.set("a", blob)
        client.set("b", blob)
        client.set("a", blob)  # replacing a value does not count twice
        with pytest.raises(rankwise.StoreError, match="total"):
            for i in range(3):
                client.set(f"c{i}", blob)
        client.delete_key("b")
        client.set("d", blob)  # room again after a delete
        client.close()


# --- 6: the async worker ----------------------------------------------------------------------

def test_async_worker_drops_closures_and_is_joined() -> None:
    from rankwise.core import work as _work

    class Payload:
        pass

    payload = Payload()
    ref = weakref.ref(payload)

    def job(p: Payload = payload) -> None:
        assert p is not None

    work = _work.run_async("test job", job)
    del job, payload
    work.wait(10)
    gc.collect()
    assert ref() is None, "the worker still holds the finished job's closure"
    thread = _work._workers[None]._thread if None in _work._workers else None
    assert thread is not None
    _work.stop_worker()
    assert not thread.is_alive(), "stop_worker returned with the worker thread alive"


# --- 7: destroy vs an answer in flight; launcher SIGKILL --------------------------------------

def test_settle_never_joins_an_unstarted_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwise.checks.where import WhereService
    from rankwise.wire.frames import Frame

    class FakeTransport:
        def send(self, *args: Any) -> None:
            pass

    class FakeComm:
        rank = 0
        transport = FakeTransport()

        def report_provider(self) -> dict[str, Any]:
            return {"rank": 0}

    service = WhereService(FakeComm())  # type: ignore[arg-type]
    about_to_start = threading.Event()
    let_start = threading.Event()
    real_start = threading.Thread.start

    def slow_start(self: threading.Thread) -> None:
        if self.name == "rankwise-here":
            about_to_start.set()
            let_start.wait(0.5)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    frame = Frame(*([0] * 13), src=1)._replace(tag=7)
    answering = threading.Thread(target=service.answer, args=(frame,))
    real_start(answering)
    assert about_to_start.wait(5)
    errors: list[BaseException] = []

    def settle() -> None:
        try:
            service.settle(2.0)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    settler = threading.Thread(target=settle)
    real_start(settler)
    settler.join(5)
    let_start.set()
    answering.join(5)
    assert not errors, errors


@pytest.mark.slow
@pytest.mark.procs
def test_sigkilled_launcher_takes_grandchildren_along(tmp_path: Path) -> None:
    marker = f"{os.getpid()}-{time.monotonic_ns()}"
    e = env()
    e.update(FAULT_RANK="1", FAULT_KIND="grandchild", FAULT_PLACE="init", FAULT_TIMEOUT="60",
             FAULT_MARKER=marker, TMPDIR=str(tmp_path))  # the launcher's run dir lands here
    proc = _procs.start(launcher_cmd("-n", "2", "--no-prefix", FAULT), env=e, cwd=ROOT)
    try:
        read_lines_until(proc, lambda s: "grandchild started" in s, 1, timeout=40)
        assert len(marked_processes(marker)) >= 3  # two workers and a grandchild at least
        assert _run_dirs(tmp_path)  # the launcher's scratch directory exists while it runs
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while (marked_processes(marker) or _run_dirs(tmp_path)) and time.monotonic() < deadline:
            threading.Event().wait(0.1)
        left = marked_processes(marker)
        assert not left, f"processes of the job survived the launcher: {left}"
        assert not _run_dirs(tmp_path), "the killed launcher's run directory was left behind"
    finally:
        for pid in marked_processes(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if proc.poll() is None:
            proc.kill()


def _run_dirs(where: Path) -> list[Path]:
    return list(where.glob(f"{RUN_DIR_PREFIX}*"))


def test_watchdog_removes_only_run_dirs(tmp_path: Path) -> None:
    """A wrong argument must never cost a user's directory."""
    mine = tmp_path / "results"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    assert not remove_run_dir(str(mine)) and (mine / "keep.txt").exists()
    link = tmp_path / f"{RUN_DIR_PREFIX}link"
    link.symlink_to(mine)
    assert not remove_run_dir(str(link)) and (mine / "keep.txt").exists()
    run = tmp_path / f"{RUN_DIR_PREFIX}abc"
    (run / "attempt_0").mkdir(parents=True)
    assert remove_run_dir(str(run)) and not run.exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
