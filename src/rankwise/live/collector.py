"""Launcher side of the live page: reads the ranks' snapshots from the store, keeps the
page's data.

Why one poller: every HTTP request reads the data this thread last gathered, so a page
refreshed 200 times a second costs the store (and the ranks) nothing more; the poller
asks the store for each rank's key every ``POLL`` seconds. Rates and heartbeat ages are
computed here, from when a rank's snapshot counter last moved on this machine's clock
(no clock agreement between hosts needed).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from ..checks.stragglers import attribute
from .publisher import PERIOD, ask_key, rank_key, stacks_key, started_key

__all__ = ["Collector", "pick_report"]

POLL = 0.25  #: seconds between two reads of the ranks' keys
STACKS_WAIT = 3.0  #: seconds a stacks request waits for the rank's answer
_SECONDARY = ("PeerFailure", "Terminated", "KeyboardInterrupt")


def pick_report(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The failure to show: a rank's own error before the ones it caused elsewhere."""
    failed = [r for r in rows if r.get("failed")]
    if not failed:
        return None
    failed.sort(key=lambda r: (str(r["failed"]).startswith(_SECONDARY), r["rank"]))
    first = failed[0]
    return {"rank": first["rank"], "text": first["failed"],
            "also": [r["rank"] for r in failed[1:]]}


def _median_waits(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Each rank's median wait per call (ms) over its default group's window: the
    page's column (the rank the others wait for has the smallest)."""
    out: dict[int, float] = {}
    for row in rows:
        groups: dict[str, Any] = (row.get("stragglers") or {}).get("groups") or {}
        group: dict[str, Any] = groups.get("0") or next(iter(groups.values()), {})
        calls = group.get("calls")
        if calls:
            waits = sorted(c[1] for c in calls)
            out[row["rank"]] = round(waits[len(waits) // 2], 2)
    return out


class Collector:
    """Polls the store for ``world_size`` ranks' snapshots (the world size is learned
    from the first snapshot when not given)."""

    def __init__(self, store: Any, world_size: int = 0, started: float | None = None) -> None:
        self._store = store
        self._store_lock = threading.Lock()
        self._lock = threading.Lock()
        self.world_size = world_size
        self.attempt = 0
        self.started = time.time() if started is None else started
        self._rows: dict[int, dict[str, Any]] = {}
        self._moved: dict[int, float] = {}  #: monotonic time the rank's counter last moved
        self._rates: dict[int, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rankwise-live-poll",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _call(self, fn: str, *args: Any) -> Any:
        with self._store_lock:
            return getattr(self._store, fn)(*args)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001, S110 - a store hiccup: try again next round
                pass
            self._stop.wait(POLL)

    def poll(self) -> None:
        """One read of every rank's key (and a look for a restarted attempt)."""
        if self._call("check", [started_key(self.attempt + 1)]):
            with self._lock:
                self.attempt += 1
                self._rows.clear()
                self._moved.clear()
                self._rates.clear()
        world = self.world_size or 1
        r = 0
        while r < max(world, self.world_size):
            key = rank_key(self.attempt, r)
            if r in self._rows or self._call("check", [key]):
                self._take(r, json.loads(self._call("get", key)))
            r += 1

    def _take(self, rank: int, snap: dict[str, Any]) -> None:
        now = time.monotonic()
        with self._lock:
            if not self.world_size:
                self.world_size = int(snap.get("world_size") or 0)
            old = self._rows.get(rank)
            if old is not None and snap.get("n") == old.get("n"):
                return
            self._moved[rank] = now
            if old is not None and snap.get("failed") and not snap.get("op"):
                was = old.get("was") or (old["state"] if old.get("op") else "")
                if was:  # where it was stuck when the failure ended its call
                    snap = {**snap, "was": was}
            if old is not None:
                dt = float(snap["mono"]) - float(old["mono"])
                if dt > 0:
                    self._rates[rank] = ((snap["calls"] - old["calls"]) / dt,
                                         (snap["bytes"] - old["bytes"]) / dt)
            self._rows[rank] = snap

    def data(self) -> dict[str, Any]:
        """What the page and its JSON endpoint show."""
        now = time.monotonic()
        with self._lock:
            rows: list[dict[str, Any]] = []
            for rank in range(self.world_size):
                snap = self._rows.get(rank)
                if snap is None:
                    rows.append({"rank": rank, "state": "not seen yet", "seen": False})
                    continue
                calls_s, bytes_s = self._rates.get(rank, (0.0, 0.0))
                age = now - self._moved[rank]
                rows.append({**snap, "seen": True, "heartbeat_age": round(age, 2),
                             "silent": age > 4 * PERIOD and not snap.get("closed"),
                             "calls_per_s": round(calls_s, 1), "bytes_per_s": round(bytes_s),
                             "stuck": bool(snap.get("op"))
                             and time.time() - float(snap.get("since", 0)) > 2 * PERIOD})
            found = attribute([r.get("stragglers") for r in rows])
            waits = _median_waits(rows)
            for row in rows:
                row["wait_ms"] = waits.get(int(row["rank"]))
            return {"world_size": self.world_size, "attempt": self.attempt,
                    "started": self.started, "now": time.time(), "ranks": rows,
                    "report": pick_report(rows),
                    "stragglers": [{**s.to_dict(), "text": str(s)} for s in found]}

    def stacks(self, rank: int, timeout: float = STACKS_WAIT) -> dict[str, Any]:
        """Ask ``rank`` for its Python stacks (through the store) and wait, bounded."""
        attempt = self.attempt
        asked = int(self._call("add", ask_key(attempt, rank), 1))
        deadline = time.monotonic() + timeout
        key = stacks_key(attempt, rank)
        while time.monotonic() < deadline:
            if self._call("check", [key]):
                answer = json.loads(self._call("get", key))
                if int(answer.get("asked", 0)) >= asked:
                    return {"rank": rank, "stacks": answer.get("stacks", ""),
                            "time": answer.get("time")}
            self._stop.wait(0.05)
        return {"rank": rank, "stacks": "", "error":
                f"rank {rank} did not answer within {timeout:g} s (it exited, or its "
                "process is frozen)"}
