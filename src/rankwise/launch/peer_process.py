"""Does a process of this job hold the client end of a TCP connection? (Linux ``/proc``)

The launcher's store answers an unauthenticated knock differently depending on who
knocked: a stranger must not be able to end an authenticated job, but the job's own
worker knocking with a foreign protocol (a torch-only script's ``TCPStore`` client) is a
job that can never form, and ending it at once beats 30 minutes of retries. A process is
"of this job" when its environment carries the job's marker (``RANKWISE_JOB_MARKER``,
the watchdog's test); a process that could fake that could already read the token from
the workers' environments, so this trusts no one the token did not already trust.

The connection is found by its two ports in ``/proc/net/tcp{,6}`` (client port and the
store's port), its socket inode in the marked processes' ``/proc/<pid>/fd``. Anywhere
``/proc`` is missing or unreadable the answer is False: the caller then treats the knock
as a stranger's, the safe side.
"""

from __future__ import annotations

import os

from .watchdog import marked_processes

__all__ = ["connection_inodes", "job_holds_connection"]

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def connection_inodes(client_port: int, server_port: int) -> set[int]:
    """Socket inodes of local TCP sockets bound to ``client_port`` and connected to
    ``server_port`` (the client end of the connection, when the client is local)."""
    inodes: set[int] = set()
    for table in _TABLES:
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10:
                continue
            local, remote, inode = fields[1], fields[2], fields[9]
            if _port(local) == client_port and _port(remote) == server_port and inode != "0":
                inodes.add(int(inode))
    return inodes


def job_holds_connection(marker: str, client_port: int, server_port: int) -> bool:
    """True if a process marked with ``marker`` holds the client end of that connection."""
    inodes = connection_inodes(client_port, server_port)
    if not inodes:
        return False
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for pid in marked_processes(marker):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return True
            except OSError:
                continue
    return False


def _port(address: str) -> int:
    """The port of a ``/proc/net/tcp`` address (``HEXIP:HEXPORT``); -1 if malformed."""
    try:
        return int(address.rsplit(":", 1)[1], 16)
    except (IndexError, ValueError):
        return -1
