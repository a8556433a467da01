"""The live page in-process (issue 38): publisher -> store -> collector -> HTTP server.

Thread-ranks on the memory transport publish into one in-memory store; the page's HTTP
server is real (a socket on 127.0.0.1, urllib as the client), the job is not. The real
``rankwise run -n 4`` job is in ``test_live_page_job.py``.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import rankwise
from rankwise.api.world import current
from rankwise.live.collector import Collector, pick_report
from rankwise.live.page import PAGE, render_page
from rankwise.live.publisher import LivePublisher, started_key
from rankwise.live.server import LiveServer, parse_live_address
from rankwise.store.hash import HashStore
from rankwise.testing.threads import run_threads


def _open(req: urllib.request.Request | str) -> Any:
    """urlopen on the page's own http:// address (the only scheme these tests build)."""
    return urllib.request.urlopen(req, timeout=10)  # noqa: S310


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers=headers or {})  # noqa: S310
    try:
        with _open(req) as resp:
            body = resp.read().decode()
            code = resp.status
    except urllib.error.HTTPError as exc:
        body, code = exc.read().decode(), exc.code
    return code, (json.loads(body) if body.startswith("{") else body)


@pytest.fixture
def job() -> Iterator[tuple[HashStore, Collector, LiveServer, list[LivePublisher]]]:
    """Two thread-ranks that made three all_reduces, then published; a page over them."""
    store = HashStore()
    publishers: list[LivePublisher] = []
    lock = threading.Lock()

    def body(rank: int, n: int) -> None:
        t = np.ones(256, np.float32)
        for _ in range(3):
            rankwise.all_reduce(t)
        pub = LivePublisher(current().comm, store, 0)
        pub.publish()
        with lock:
            publishers.append(pub)

    run_threads(body, 2, timeout=30)
    collector = Collector(store)
    server = LiveServer(collector, "127.0.0.1", 0, tokens=("job-secret",))
    server.start()
    yield store, collector, server, publishers
    server.close()


def test_rows_from_snapshots(job: Any) -> None:
    collector = job[1]
    collector.poll()
    data = collector.data()
    assert data["world_size"] == 2 and data["report"] is None
    rows = data["ranks"]
    assert [r["rank"] for r in rows] == [0, 1] and all(r["seen"] for r in rows)
    assert rows[0]["calls"] == 3 and rows[0]["bytes"] == 3 * 256 * 4
    assert rows[0]["recent"][0]["call"] == "all_reduce(float32 x 256, op=SUM)"
    assert rows[0]["recent"][0]["seq"] == 3 and rows[0]["recent"][0]["ms"] >= 0
    assert rows[0]["state"].startswith("running user code")
    assert not rows[0]["stuck"]


def test_token_required_and_fixed_routes(job: Any) -> None:
    _, collector, server, _ = job
    collector.poll()
    base = f"http://127.0.0.1:{server.address[1]}"
    assert _get(base + "/api/job")[0] == 401
    assert _get(base + "/")[0] == 401
    assert _get(base + "/api/job?token=wrong")[0] == 403
    assert _get(base + "/api/job", {"Authorization": "Bearer nope"})[0] == 403
    code, data = _get(base + f"/api/job?token={server.token}")
    assert code == 200 and len(data["ranks"]) == 2
    assert _get(base + "/api/job", {"Authorization": "Bearer job-secret"})[0] == 200
    code, page = _get(server.url)
    assert code == 200 and "<table>" in page and page.startswith(PAGE[:200])
    assert '"world_size": 2' in page  # the first data is in the page: no wait for a poll
    assert _get(base + f"/etc/passwd?token={server.token}")[0] == 404
    assert _get(base + f"/api/stacks?rank=7&token={server.token}")[0] == 400
    assert _get(base + f"/api/stacks?rank=-1&token={server.token}")[0] == 400
    req = urllib.request.Request(base + f"/api/job?token={server.token}",  # noqa: S310
                                 data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        _open(req)
    assert info.value.code == 501  # no handler for anything but GET/HEAD


def test_security_headers(job: Any) -> None:
    server = job[2]
    with _open(server.url) as resp:
        headers = resp.headers
    assert headers["Referrer-Policy"] == "no-referrer"
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert headers["X-Frame-Options"] == "DENY"
    assert "innerHTML" not in PAGE  # job text goes in through textContent only


def test_stacks_on_request(job: Any) -> None:
    _, collector, server, publishers = job
    collector.poll()
    pub = next(p for p in publishers if p._comm.rank == 1)
    pub.start(at_exit=False)
    try:
        code, data = _get(f"http://127.0.0.1:{server.address[1]}/api/stacks?rank=1"
                          f"&token={server.token}")
    finally:
        pub.stop()
    assert code == 200 and data["rank"] == 1
    assert "Thread " in data["stacks"] and "test_live_page.py" in data["stacks"]


def test_stacks_of_a_silent_rank_time_out(job: Any) -> None:
    _, collector, _, _ = job
    collector.poll()
    answer = collector.stacks(0, timeout=0.3)
    assert answer["stacks"] == "" and "did not answer within 0.3 s" in answer["error"]


def test_inlined_data_cannot_close_the_script() -> None:
    page = render_page({"ranks": [{"state": "</script><script>alert(1)</script> & co"}]})
    assert "alert" in page and "</script><script>alert" not in page
    assert "\\u003c/script>" in page and "\\u0026 co" in page


def test_failure_report_prefers_the_cause() -> None:
    rows = [{"rank": 0, "failed": "PeerFailure: rank 2 failed"},
            {"rank": 1, "failed": ""},
            {"rank": 2, "failed": "DeadlockError: deadlock: all 4 live ranks ..."}]
    report = pick_report(rows)
    assert report == {"rank": 2, "text": "DeadlockError: deadlock: all 4 live ranks ...",
                      "also": [0]}
    assert pick_report([{"rank": 0, "failed": ""}]) is None


def test_live_address_parsing() -> None:
    assert parse_live_address("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_live_address(":9000") == ("127.0.0.1", 9000)
    assert parse_live_address("0.0.0.0") == ("0.0.0.0", 0)
    assert parse_live_address("[::1]:81") == ("::1", 81)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_live_address("host:http")
    with pytest.raises(ValueError, match="0..65535"):
        parse_live_address("host:70000")


def test_a_restarted_attempt_replaces_the_rows(job: Any) -> None:
    store, collector, _, publishers = job
    collector.poll()
    assert collector.attempt == 0 and collector.data()["ranks"][0]["seen"]
    again = LivePublisher(publishers[0]._comm, store, 1)
    again.publish()
    store.add(started_key(1), 1)  # as start_publisher does for a restarted rank
    collector.poll()
    data = collector.data()
    assert data["attempt"] == 1
    seen = [r["rank"] for r in data["ranks"] if r["seen"]]
    assert seen == [publishers[0]._comm.rank]  # the other rank has not come back yet


def test_rates_from_two_snapshots() -> None:
    collector = Collector(HashStore(), world_size=1)
    snap = {"rank": 0, "world_size": 1, "n": 1, "mono": 10.0, "calls": 100, "bytes": 4000,
            "state": "running user code", "op": "", "since": 0.0}
    collector._take(0, snap)
    collector._take(0, {**snap, "n": 2, "mono": 10.5, "calls": 150, "bytes": 6000})
    row = collector.data()["ranks"][0]
    assert row["calls_per_s"] == 100.0 and row["bytes_per_s"] == 4000
    assert row["heartbeat_age"] < 1 and not row["silent"] and not row["stuck"]
    collector._take(0, {**snap, "n": 3, "mono": 11.0, "failed": "DeadlockError: x",
                        "calls": 150, "bytes": 6000})
    assert collector.data()["report"] == {"rank": 0, "text": "DeadlockError: x", "also": []}
