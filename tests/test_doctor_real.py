"""``rankwise doctor`` against the real machine: real sockets for the port probes, the CLI
as a subprocess (healthy here: exit 0, nothing alarming), and the findings a failing
``init_process_group`` carries. Every child has a hard timeout."""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator

import _procs
import pytest
from _error_cases import finish, run_script

from rankwise.doctor import NetProbes, PortState
from rankwise.store import TCPStore
from rankwise.testing import free_port

#: variables of an enclosing job or of this machine's setup that would change the verdict
_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
             "RANKWISE_TOKEN", "RANKWISE_TOKEN_FILE", "GROUP_WORLD_SIZE", "OMP_NUM_THREADS")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARS}
    env.update(extra)
    return env


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A port held by a program that accepts and never speaks (not a rankwise store)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield int(sock.getsockname()[1])
    sock.close()


@pytest.fixture
def junk_listener() -> Iterator[int]:
    """A port held by a program that greets with its own protocol (an SSH-like banner)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    stop = threading.Event()

    def serve() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n" + b"x" * 64)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield int(sock.getsockname()[1])
    stop.set()
    thread.join(5)
    sock.close()


def _doctor(*args: str, env: dict[str, str], timeout: float = 120) -> tuple[int, str]:
    proc = run_script("import sys; from rankwise.cli import main; "
                      "sys.exit(main(['doctor', *sys.argv[1:]]))", *args, env=env)
    ((rc, out, err),) = finish([proc], timeout)
    return rc, out + err


def test_probe_tells_who_holds_a_port(monkeypatch: pytest.MonkeyPatch, silent_listener: int,
                                      junk_listener: int) -> None:
    monkeypatch.delenv("RANKWISE_TOKEN", raising=False)
    monkeypatch.delenv("RANKWISE_TOKEN_FILE", raising=False)
    net = NetProbes(connect_timeout=0.5)
    store = TCPStore("127.0.0.1", 0, is_master=True, world_size=None)
    guarded = TCPStore("127.0.0.1", 0, is_master=True, world_size=None, token=b"other")
    try:
        assert net.probe("127.0.0.1", store.port)[0] is PortState.RANKWISE_STORE
        assert net.probe("127.0.0.1", guarded.port)[0] is PortState.TOKEN_DIFFERS
        assert net.probe("127.0.0.1", silent_listener)[0] is PortState.OTHER_PROGRAM
        assert net.probe("127.0.0.1", junk_listener)[0] is PortState.OTHER_PROGRAM
        assert net.probe("127.0.0.1", free_port())[0] is PortState.REFUSED
        err = net.bind_error("127.0.0.1", store.port)
        assert err is not None and err.errno == errno.EADDRINUSE
        assert net.bind_error("127.0.0.1", 0) is None
        assert net.is_local("127.0.0.1") and not net.is_local("192.0.2.1")  # TEST-NET-1
        store.set("still", "served")  # the probes did not disturb the store
        assert store.get("still") == b"served"
    finally:
        guarded.close()
        store.close()


@pytest.mark.procs
def test_cli_healthy_machine_exit_0() -> None:
    rc, out = _doctor(env=_clean_env())
    assert rc == 0, out
    assert out.startswith("rankwise doctor: no problems found")
    assert "error" not in out and "warning" not in out


@pytest.mark.procs
def test_cli_reports_a_taken_port_as_json(silent_listener: int) -> None:
    rc, out = _doctor("--json", "--master-addr", "127.0.0.1", "--master-port",
                      str(silent_listener), env=_clean_env())
    assert rc == 1, out
    report = json.loads(out)
    assert report["ok"] is False
    (port,) = [f for f in report["findings"] if f["check"] == "port"]
    assert port["severity"] == "error" and "in use by another program" in port["what"]
    assert f"sport = :{silent_listener}" in port["fix"]


@pytest.mark.procs
def test_cli_options_seed_faults() -> None:
    rc, out = _doctor("-n", "4", "--num-workers", "64", env=_clean_env(
        NCCL_SOCKET_IFNAME="nosuchif0"))
    assert rc == 1, out
    assert "NCCL_SOCKET_IFNAME selects no interface" in out
    assert "num_workers=64 on 4 rank(s): 260 busy processes" in out


_INIT = """
import sys, rankwise as dist
try:
    dist.init_process_group("tcp", timeout=float(sys.argv[1]))
except dist.DistError as exc:
    import traceback; traceback.print_exception(exc)
    sys.exit(3)
"""


def _init_failure(env: dict[str, str], timeout: float = 2.0) -> str:
    start = time.monotonic()
    ((rc, out, err),) = finish([run_script(_INIT, str(timeout), env=env)], 60)
    assert rc == 3, out + err
    assert time.monotonic() - start < timeout + 30  # the doctor's probes are bounded
    return err


@pytest.mark.procs
def test_init_failure_names_the_program_on_the_port(silent_listener: int) -> None:
    err = _init_failure(_clean_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT=str(silent_listener)))
    assert "DistNetworkError: cannot start the rankwise store" in err
    assert "rankwise doctor, on this init failure: 1 problem(s) found" in err
    assert f"MASTER_PORT {silent_listener} is in use by another program" in err


@pytest.mark.procs
def test_init_failure_says_nothing_listens() -> None:
    port = free_port()
    err = _init_failure(_clean_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT=str(port)))
    assert f"nothing listens on 127.0.0.1:{port}" in err


@pytest.mark.procs
def test_init_failure_doctor_can_be_turned_off(silent_listener: int) -> None:
    err = _init_failure(_clean_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT=str(silent_listener), RANKWISE_DOCTOR="0"))
    assert "cannot start the rankwise store" in err and "rankwise doctor" not in err


@pytest.mark.procs
def test_console_script_lists_doctor() -> None:
    out = _procs.run([sys.executable, "-m", "rankwise", "--help"], timeout=60, cwd=None,
                     env=_clean_env(PYTHONPATH=os.pathsep.join(sys.path))).stdout
    assert "doctor" in out


def test_init_hook_probes_with_the_jobs_own_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # a token given as token= (not in the environment): the hook's probe of the store must
    # prove it, or the store would report a stranger failing the token check to the job
    from rankwise.doctor.hook import init_findings

    store = TCPStore("127.0.0.1", 0, is_master=True, world_size=None, token=b"k")
    try:
        for name in _JOB_VARS:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(store.port))
        assert init_findings(hosting=False, token=b"k") == []
        (f,) = init_findings(hosting=False, token=b"wrong")
        assert "refuses this environment's token" in f.what
        # the server counts a failure after answering: poll (bounded) for the wrong one,
        # then the count shows the right probe was not counted
        deadline = time.monotonic() + 20
        while not store.auth_failures() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.auth_failures().startswith("1 connection(s) failed the token check")
    finally:
        store.close()
