"""A fork server for rank processes that would otherwise each import torch again.

Why: a test that starts its ranks as fresh interpreters wrapped in ``python -c "import
torch; ...; runpy.run_path(script)"`` (the diagnosis catalogue's torch-gloo cases) paid
torch's import in every rank: ~2.3 CPU-s each, 2-4 ranks per case, ~78 s of the
catalogue's wall time on a 2-core machine. Here one server process imports the modules
once; each rank is a fork of it that then runs the same ``-c`` code at the top level of
the interpreter, so an uncaught exception goes through ``sys.excepthook`` and the exit
through ``threading``'s shutdown and ``atexit`` exactly as in ``python -c`` (rankwise
itself is not imported before the fork: it reads its environment at import).

- Server: ``python _zygote.py SOCKET MODULE...`` imports the modules, prints ``ready``
  and forks one child per connection. The request carries the ``-c`` code, argv, env and
  cwd; the child's stdin/stdout/stderr come with it (``SCM_RIGHTS``). The child starts its
  own session (as ``start_new_session=True``), so killing its process group kills what it
  started. The server tells the client the child's pid, and its exit status (``-N`` for
  signal N, as ``Popen.returncode``) when it ends. It ends itself when its parent (the
  test process) is gone, killing its children first.
- Client: ``Zygote(...)`` starts the server; ``start(code, argv, env, cwd)`` returns a
  ``Forked`` with the ``Popen`` methods the tests use (``pid``, ``returncode``, ``poll``,
  ``wait``, ``communicate`` with a timeout, ``kill``); ``close()`` ends the server.
"""

from __future__ import annotations

import array
import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

_FDS = 3  #: stdin, stdout, stderr
_REPLY = 30.0  #: seconds the server may take to fork and name the child


def _recv_request(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    data = b""
    fds: list[int] = []
    while not data.endswith(b"\n"):
        msg, anc, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(_FDS * 4))
        if not msg:
            raise EOFError("client went away")
        data += msg
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(raw[:len(raw) - len(raw) % got.itemsize])
                fds += list(got)
    return json.loads(data), fds


def _kill_children(children: dict[int, socket.socket]) -> None:
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


def _remove(path: str) -> None:
    """The server's socket and the temporary folder it alone lives in."""
    for remove, what in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
        try:
            remove(what)
        except OSError:
            pass


def _serve(path: str) -> tuple[dict[str, object], list[int]]:
    """Accept requests until one is to be run here: returns (in the forked child only)."""
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while True:
        if os.getppid() != parent:  # the test process is gone (killed: no close())
            _kill_children(children)
            _remove(path)
            os._exit(0)
        ready, _, _ = select.select([server], [], [], 0.02)
        if ready:
            conn, _ = server.accept()
            try:
                request, fds = _recv_request(conn)
            except (OSError, EOFError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                for other in children.values():
                    other.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(f"{pid}\n".encode())
            except OSError:
                pass
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()


def _become(request: dict[str, object], fds: list[int]) -> str:
    """In the forked child: become the requested process; returns its ``-c`` code."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    if request.get("cwd"):
        os.chdir(str(request["cwd"]))
    argv = request["argv"]
    assert isinstance(argv, list)
    sys.argv = ["-c", *argv]
    sys.path[0] = ""  # as ``python -c`` has it
    if "numpy.random" in sys.modules:  # (``random`` reseeds itself after a fork)
        sys.modules["numpy.random"].seed()
    return str(request["code"])


# --- the client (the test process) ----------------------------------------------------------



class Forked:
    """A process forked by the zygote, with the ``Popen`` methods the tests use."""

    def __init__(self, conn: socket.socket, pid: int, out: int, err: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._chunks: dict[int, list[bytes]] = {out: [], err: []}
        self._readers = [threading.Thread(target=self._read, args=(fd,), daemon=True)
                         for fd in (out, err)]
        self._ended = threading.Event()
        self._waiter = threading.Thread(target=self._wait_status, daemon=True)
        self._out, self._err = out, err
        for t in [*self._readers, self._waiter]:
            t.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb", buffering=0) as f:
            while True:
                data = f.read(1 << 16)
                if not data:
                    return
                self._chunks[fd].append(data)

    def _wait_status(self) -> None:
        data = b""
        try:
            while not data.endswith(b"\n"):
                more = self._conn.recv(64)
                if not more:
                    break
                data += more
        except OSError:
            pass
        self._conn.close()
        try:
            self.returncode = int(data)
        except ValueError:  # the server died: the child's status is lost
            self.returncode = -int(signal.SIGKILL)
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(["zygote", str(self.pid)], timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end and for EOF on stdout and stderr; their text."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait(timeout)
        for t in self._readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():  # a grandchild holds the pipe open
                raise subprocess.TimeoutExpired(["zygote", str(self.pid)], timeout or 0.0)
        return tuple(b"".join(self._chunks[fd]).decode(errors="replace")  # type: ignore[return-value]
                     for fd in (self._out, self._err))

    def kill(self) -> None:
        """SIGKILL the child's whole session (it leads its own process group)."""
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass


class Zygote:
    """The server process, with ``modules`` imported once; ``start`` forks a process."""

    def __init__(self, modules: list[str], env: dict[str, str], timeout: float = 120.0) -> None:
        self._owner = os.getpid()
        self._dir = tempfile.mkdtemp(prefix="rankwise-zygote-")
        self.path = os.path.join(self._dir, "sock")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path,
                                      *modules], env={**env, "PYTHONUNBUFFERED": "1"},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     start_new_session=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        atexit.register(self.close)  # also when the module that started it never closes it
        if line.strip() != b"ready":
            self.close()
            raise RuntimeError(f"the zygote did not start within {timeout}s: {line!r}")

    def start(self, code: str, argv: list[str], env: dict[str, str],
              cwd: str | None = None) -> Forked:
        """Fork a process running ``python -c code *argv`` with ``env`` (stdout and stderr
        piped, stdin from /dev/null)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(_REPLY)  # a wedged server fails the test, never hangs it
        try:
            conn.connect(self.path)
            request = json.dumps({"code": code, "argv": argv, "env": env,
                                  "cwd": cwd}).encode() + b"\n"
            conn.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      array.array("i", [null, out_w, err_w]))])
            data = b""
            while not data.endswith(b"\n"):
                more = conn.recv(64)
                if not more:
                    raise RuntimeError("the zygote closed the connection before forking")
                data += more
        except BaseException:
            conn.close()
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        conn.settimeout(None)  # from here the child's end: bounded by ``Forked.wait``
        return Forked(conn, int(data), out_r, err_r)

    def close(self) -> None:
        """End the server (its children are the tests' to kill: they are in sessions of
        their own), and remove its socket. Idempotent."""
        if self.proc.returncode is not None or os.getpid() != self._owner:
            return  # closed, or a fork of the test process (its atexit runs this too)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        _remove(self.path)


if __name__ == "__main__":
    for _name in sys.argv[2:]:
        __import__(_name)
    _code = _become(*_serve(sys.argv[1]))
    exec(compile(_code, "<string>", "exec"), {"__name__": "__main__",  # noqa: S102
                                              "__builtins__": __builtins__})
    sys.exit(0)
