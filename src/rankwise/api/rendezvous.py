"""The rendezvous of ``init_process_group``: the ranks agree on world size, build and
identities through the store, and every rank leaves with the job's id, every rank's host
and (tcp) every rank's data address.

Why its own module: it is the one part of init that talks to the store round by round,
and its round trips are counted (tests/test_launch_init_round_trips.py); the rest of init
only needs "rendezvous, then connect".
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import time
from typing import Any, NamedTuple

from .._version import __version__
from ..errors import DistError, RendezvousError
from ..shmem.host import host_identity
from ..store.seen import HOLD_LIMIT, count_seen_and_hold
from ..transport.mesh import address_blob, address_keys, exited_peers
from ..wire.frames import VERSION as WIRE_VERSION

__all__ = ["Joined", "rendezvous"]


def rendezvous(store: Any, rank: int, world_size: int, timeout_s: float,
                hosting: bool = False, address: str | None = None) -> Joined:
    """Agree on world size and identities; return the job's id (shared by all ranks) and,
    when every rank gave its data ``address``, the address blob (else None)."""
    def failed(exc: RendezvousError, late_ones: bool = True) -> RendezvousError:
        # Count this process as having seen the failure. The process hosting the store
        # keeps it up (bounded) until every process has seen it too, or they would meet a
        # dead store ("connection refused", "went away") instead of this explanation.
        # ``late_ones``: also wait for processes still starting up (an error found early,
        # like a duplicate rank); after a join timeout, only for those that arrived.
        count_seen_and_hold(
            store, "error/seen",
            lambda: max(int(store.add("arrived", 0)), world_size if late_ones else 0),
            hosting, min(HOLD_LIMIT, timeout_s))
        return exc

    def fail(message: str, late_ones: bool = True) -> RendezvousError:
        try:
            if not late_ones:
                store.set("error/no-late-ones", "1")  # before the error: readers see both
            store.set("error", message)
            store.set("joined/all", "error")  # wakes every rank waiting for the others
        except DistError:
            pass
        return failed(RendezvousError(message), late_ones)

    def failed_elsewhere() -> RendezvousError:
        message = store.get("error").decode()
        return failed(RendezvousError(message), not store.check(["error/no-late-ones"]))

    me = f"{socket.gethostname()} pid {os.getpid()}"
    build = _build()
    # one round trip for the checks, one to count in (a slow link pays per round trip);
    # nothing in the first changes what another rank reads before this one counts in
    _, agreed_b, build_b, claims = store.batch([
        ("add", "arrived", 1), ("compare_set", "world_size", "", str(world_size)),
        ("compare_set", "build", "", build), ("add", f"claim/{rank}", 1)])
    agreed = agreed_b.decode()
    if agreed != str(world_size):
        raise fail(f"world sizes disagree: rank {rank} was started with world_size="
                   f"{world_size} but a rank that joined earlier said {agreed}. Start every "
                   "process with the same WORLD_SIZE")
    agreed = build_b.decode()
    if agreed != build:
        # who runs the other one: the first rank that agreed names itself (if it got there)
        who = store.get("build/by").decode() if store.check(["build/by"]) else \
            "a rank that joined earlier"
        raise fail(f"rank {rank} ({me}) runs {build}, but {who} runs {agreed}. Every "
                   "process of a job must run the same rankwise (install the same version "
                   "on every node, in every environment the job uses)")
    if int(claims) > 1:
        other = store.get(f"joined/{rank}").decode() if store.check([f"joined/{rank}"]) else "?"
        raise fail(f"two processes claim rank {rank}: {other} and {me}. Give every process "
                   "its own RANK (0..world_size-1)")
    # the address before counting in: the last to join finds every one
    addressed = [] if address is None else [("set", f"mesh/addr/{rank}", address)]
    if hosting:  # the others then count themselves in for its hold (``init_done``)
        addressed.append(("set", "hosted", str(rank)))
    *_, job_b, count = store.batch([
        ("compare_set", "build/by", "", f"rank {rank} ({me})"), ("set", f"joined/{rank}", me),
        ("set", f"host/{rank}", host_identity()),
        *addressed, ("compare_set", "job", "", secrets.token_hex(8)),
        ("add", "joined/count", 1)])
    job_hex = job_b.decode()
    # one key, set by the last rank to join: waiting costs the store O(1) per rank, and
    # only rank 0 looks for ended ranks often (it wakes the others through this key; the
    # others look every 10 s in case rank 0 itself is gone): the polling of a slow start
    # costs O(1) requests per second for the job, not O(N). Its value is the verdict:
    # "error" (see ``fail``), or "ok" followed by what every rank needs (``_verdict``).
    # The last to join knows it (its own, or an error set meanwhile): no wait there
    verdict_b: bytes | None = store.compare_set(
        "joined/all", "", _verdict(store, world_size, address is not None)) \
        if int(count) == world_size else None
    poll = 0.5 if rank == 0 else 10.0
    deadline = time.monotonic() + timeout_s
    auth_note = ""
    while verdict_b is None:
        remaining = deadline - time.monotonic()
        # the wait and the read in one round trip; if not yet: a failure, an ended peer?
        verdict_b = store.wait_get("joined/all", max(0.05, min(poll, remaining)))
        if verdict_b is not None:
            break
        if store.check(["error"]):
            raise failed_elsewhere() from None
        gone = exited_peers(store, [r for r in range(world_size) if r != rank])
        if gone:
            peer, how = min(gone.items())
            raise fail(f"rank {rank}: rank {peer} {how} before the group was formed "
                       "(it never finished init_process_group); the job cannot go on "
                       "without it") from None
        note = _auth_note(store)
        if note and not auth_note:
            sys.stderr.write(f"rankwise: rank {rank} is waiting for ranks to join, and the "
                             f"rendezvous store reports: {note}\n")
        auth_note = note or auth_note
        if remaining <= 0:
            missing = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
            joined = world_size - len(missing)
            hint = (f" Meanwhile the store reports: {auth_note} — was a missing rank "
                    "started with a different RANKWISE_TOKEN?") if auth_note else ""
            raise fail(
                f"rank {rank}: only {joined} of {world_size} ranks joined within "
                f"{timeout_s:.0f}s; missing ranks {missing}. Check that every process "
                f"was started, with WORLD_SIZE={world_size} and its own RANK, and that it "
                f"reaches MASTER_ADDR:MASTER_PORT.{hint}", late_ones=False) from None
    verdict, _, rest = verdict_b.decode().partition("\n")
    if verdict != _OK:  # "error": ``fail`` set the reason first
        raise failed_elsewhere()
    about_json, _, blob = rest.partition("\n")
    about = json.loads(about_json)
    hosts = about.get("hosts") if isinstance(about, dict) else None
    return Joined(bytes.fromhex(job_hex), blob or None,
                  [str(h) for h in hosts] if isinstance(hosts, list) else None,
                  bool(about.get("hosted", True)) if isinstance(about, dict) else True)


_OK = "ok"  #: ``joined/all`` when every rank joined without a conflict


class Joined(NamedTuple):
    """What the rendezvous hands every rank: the job's id, every rank's data address
    (the blob, when each gave one), every rank's ``host_identity()`` in rank order (the
    engine choice's first round, carried here: one round trip fewer on a slow link), and
    whether a rank hosts the store (else no rank holds it at the end of init, and the
    others need not count themselves in for that: ``init_done``)."""

    job: bytes
    blob: str | None
    hosts: list[str] | None
    hosted: bool


def _verdict(store: Any, world_size: int, addressed: bool) -> str:
    """``joined/all``'s value, set by the last rank to join: "ok", a JSON object (every
    rank's host identity, whether a rank hosts the store) and the address blob, each on
    its own line (one read)."""
    keys = [f"host/{r}" for r in range(world_size)] + ["hosted"]
    values = store.read_many(keys + (address_keys(world_size) if addressed else []))
    hosts = values[:world_size]
    blob = address_blob(values[world_size + 1:]) if addressed else None
    listed = None if any(h is None for h in hosts) else \
        [h.decode() for h in hosts if h is not None]
    about = {"hosts": listed, "hosted": values[world_size] is not None}
    return f"{_OK}\n{json.dumps(about)}\n{blob or ''}"


def _build() -> str:
    """What must be equal on every rank: the version, and the wire protocol's. Why in the
    rendezvous: ranks of different versions may word frames, flags or algorithms
    differently, which surfaces (if at all) as a protocol error at some later call;
    here it is one sentence on every rank before any connection is made."""
    return f"rankwise {__version__} (wire protocol {WIRE_VERSION})"


def _auth_note(store: Any) -> str:
    probe = getattr(store, "auth_failures", None)
    try:
        return str(probe()) if callable(probe) else ""
    except DistError:
        return ""
