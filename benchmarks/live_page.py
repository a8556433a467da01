"""The live page's cost to a job: per-call and per-step time, page off / on / on under load.

Runs ``rankwise run -n N`` jobs in rotation: ``--no-live``; the page on (default) with
nobody looking; the page on while ``--rate`` requests/s hit ``/api/job`` for the whole
measured window (the acceptance: 200/s for 10 s); and a control, the page off while the
same load hits a stand-in server in this driver (the same CPU churn on the machine,
without the page: on a shared 2-core machine busy CPUs alone change wake-up times). Each rank times ``--seconds`` of
4-byte all_reduces (per-call time), then ``--seconds`` of "steps" (2 ms of numpy work and
an all_reduce of 256 KiB); the slowest rank's medians are printed per job, and per mode
the median over ``--rounds`` with min-max, as ratios to "off". The load's answers (codes,
latency) are counted: the page must keep answering.

    python benchmarks/live_page.py --ranks 2 --seconds 8 --rounds 4 --rate 200
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

MODES = ("off", "on", "on+load", "off+load")


def _rank(seconds: float) -> None:
    import numpy as np

    import rankwise as dist

    dist.init_process_group("tcp")
    began = time.time()
    tiny = np.ones(1, dtype=np.float32)
    big = np.ones(64 * 1024, dtype=np.float32)
    a = np.random.default_rng(0).standard_normal((160, 160))

    def agreed(n: float) -> int:  # every rank must make the same number of calls
        v = np.array([n], dtype=np.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MIN)
        return max(1, int(v[0]))

    def step() -> None:
        nonlocal a
        w = time.perf_counter() + 0.002
        while time.perf_counter() < w:  # the "compute" of a step
            a = np.tanh(a @ a.T / 160)
        dist.all_reduce(big)

    t = time.perf_counter()
    for _ in range(300):
        dist.all_reduce(tiny)
    blocks = agreed(seconds / ((time.perf_counter() - t) / 3))
    t = time.perf_counter()
    for _ in range(5):
        step()
    n_steps = agreed(seconds / ((time.perf_counter() - t) / 5))
    print("MEASURING", flush=True)
    dist.barrier()
    calls: list[float] = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(100):
            dist.all_reduce(tiny)
        calls.append((time.perf_counter() - t) / 100 * 1e6)
    dist.barrier()
    steps: list[float] = []
    for _ in range(n_steps):
        t = time.perf_counter()
        step()
        steps.append((time.perf_counter() - t) * 1e3)
    from rankwise.live.publisher import current_publisher

    pub = current_publisher()
    print("RESULT " + json.dumps({"call_us": statistics.median(calls),
                                  "step_ms": statistics.median(steps),
                                  "page_cpu_pct": 100 * pub.cpu_s / (time.time() - began)
                                  if pub is not None else 0.0}), flush=True)
    dist.destroy_process_group()


class _Load:
    """``rate`` GETs per second to ``url``, paced, from 4 threads, until stopped."""

    def __init__(self, url: str, rate: float) -> None:
        self.url, self.rate = url, rate
        self.codes: dict[int, int] = {}
        self.latency: list[float] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(4)]

    def start(self) -> None:
        self.began = time.monotonic()
        for t in self._threads:
            t.start()

    def stop(self) -> float:
        self._stop.set()
        for t in self._threads:
            t.join()
        return time.monotonic() - self.began

    def _run(self, i: int) -> None:
        period = 4 / self.rate
        nxt = time.monotonic() + i * period / 4
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=5) as resp:  # noqa: S310
                    resp.read()
                    code = resp.status
            except Exception:  # noqa: BLE001 - counted as a failure
                code = 0
            with self._lock:
                self.codes[code] = self.codes.get(code, 0) + 1
                self.latency.append((time.monotonic() - t) * 1e3)
            nxt += period
            self._stop.wait(max(0.0, nxt - time.monotonic()))


class _StandIn:
    """A local HTTP server answering a fixed JSON body of the page's size: the control."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        body = json.dumps({"ranks": [{"state": "x" * 400, "recent": ["y" * 60] * 8}] * 2})

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                raw = body.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: Any) -> None:
                return

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _job(ranks: int, seconds: float, mode: str, rate: float) -> tuple[dict[str, float],
                                                                       dict[str, Any]]:
    cmd = [sys.executable, "-m", "rankwise", "run", "-n", str(ranks), "--no-prefix"]
    if mode.startswith("off"):
        cmd.append("--no-live")
    standin = _StandIn() if mode == "off+load" else None
    proc = subprocess.Popen([*cmd, __file__, "--rank", str(seconds)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    results: list[dict[str, float]] = []
    load: _Load | None = None
    load_info: dict[str, Any] = {}
    measuring = 0
    for line in proc.stdout:
        m = re.search(r"live page at (http://\S+)", line)
        if m and mode == "on+load":
            base, token = m.group(1).split("/?token=")
            load = _Load(f"{base}/api/job?token={token}", rate)
        if standin is not None and load is None:
            load = _Load(standin.url, rate)
        if line.startswith("MEASURING"):
            measuring += 1
            if measuring == ranks and load is not None:
                load.start()
        if line.startswith("RESULT"):
            results.append(json.loads(line.split(" ", 1)[1]))
            if len(results) == ranks and load is not None:
                took = load.stop()
                lat = sorted(load.latency)
                load_info = {"requests": len(lat), "seconds": round(took, 1),
                             "per_s": round(len(lat) / took, 1), "codes": load.codes,
                             "p50_ms": round(lat[len(lat) // 2], 2),
                             "p99_ms": round(lat[int(len(lat) * 0.99)], 2)}
    if standin is not None:
        standin.close()
    if proc.wait(timeout=120) != 0:
        raise SystemExit(f"job failed in mode {mode}")
    return ({k: max(r[k] for r in results) for k in ("call_us", "step_ms", "page_cpu_pct")},
            load_info)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--rank":
        _rank(float(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", type=float, default=200.0)
    a = p.parse_args()
    got: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        k = r % len(MODES)
        order = MODES[k:] + MODES[:k]  # rotate: no mode always runs first
        for mode in order:
            res, load = _job(a.ranks, a.seconds, mode, a.rate)
            got[mode].append(res)
            print(f"round {r} {mode:8s}: {res['call_us']:.1f} us/call, "
                  f"{res['step_ms']:.2f} ms/step, snapshot thread "
                  f"{res['page_cpu_pct']:.3f}% of a core"
                  + (f"; load {load}" if load else ""),
                  flush=True)
    for key, unit in (("call_us", "us/call"), ("step_ms", "ms/step")):
        base = [x[key] for x in got["off"]]
        for mode in MODES:
            vals = [x[key] for x in got[mode]]
            ratios = [v / b for v, b in zip(vals, base)]
            print(f"{key} {mode:8s}: median {statistics.median(vals):.2f} {unit} "
                  f"(min {min(vals):.2f}, max {max(vals):.2f}); vs off, per round: median "
                  f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
                  f"max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
