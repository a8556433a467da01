"""Per-rank timelines in the Chrome trace / Perfetto JSON format, and their merge.

Why: "which rank was late, in which call, from which line" is a picture. With
``RANKWISE_TRACE=dir`` every rank records one span per collective (op, sequence
number, bytes, group, call site) and per blocking recv (peer, tag), in memory, and
writes ``dir/rank<N>.json`` when it leaves the job. Timestamps are wall-clock
microseconds, so the ranks of one host line up without a clock exchange.

Merge the files into one timeline (open it at https://ui.perfetto.dev or
chrome://tracing)::

    python -m rankwise.diagnosis.trace merge dir -o timeline.json
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from ..identity.calls import describe
from ..wire.buffers import dtype_by_code
from ..wire.frames import Op

__all__ = ["MAX_EVENTS", "Tracer", "main", "merge"]

MAX_EVENTS = 1_000_000  #: per rank; later spans are counted, not kept (bounded memory)


class Tracer:
    """Collects this rank's spans; cheap enough to leave on for a whole run."""

    def __init__(self, directory: str, rank: int) -> None:
        self.directory = directory
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self._tids: dict[str, int] = {}
        self._lock = threading.Lock()

    def _tid(self) -> int:
        name = threading.current_thread().name
        tid = self._tids.get(name)
        if tid is None:
            tid = self._tids[name] = len(self._tids)
        return tid

    def _add(self, event: dict[str, Any]) -> None:
        if len(self.events) >= MAX_EVENTS:
            self.dropped += 1
            return
        self.events.append(event)

    def collective(self, group: Any, record: Any) -> None:
        fp = record.fp
        d = dtype_by_code(fp.dtype) if fp.dtype else None
        nbytes = fp.count * d.storage.itemsize if d is not None and fp.count > 0 else 0
        name = Op(fp.op).name if fp.op in Op._value2member_map_ else f"op#{fp.op}"
        args = {"seq": record.seq, "group": group.name, "bytes": nbytes,
                "peers": list(group.ranks) if len(group.ranks) <= 64 else len(group.ranks),
                "call": describe(fp), "site": record.site.chain}
        label = record.label
        if label:  # record_comm's name titles the span; the op stays in the arguments
            args["op"] = name
            name = label
        self._add({
            "name": name, "cat": "collective", "ph": "X", "pid": self.rank,
            "tid": self._tid(), "ts": record.started * 1e6,
            "dur": max(0.0, record.finished - record.started) * 1e6, "args": args,
        })

    def recv(self, start: float, end: float, src: int, nbytes: int, tag: int,
             site: Any) -> None:
        self._add({
            "name": "recv", "cat": "p2p", "ph": "X", "pid": self.rank, "tid": self._tid(),
            "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6,
            "args": {"peer": src, "bytes": nbytes, "tag": tag, "site": site.chain},
        })

    def write(self) -> str:
        """Write ``rank<N>.json`` (atomically: a merge never reads half a file)."""
        os.makedirs(self.directory, exist_ok=True)
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
             "args": {"name": f"rank {self.rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
             "args": {"sort_index": self.rank}},
        ]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                  "args": {"name": name}} for name, tid in self._tids.items()]
        path = os.path.join(self.directory, f"rank{self.rank}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms",
                       "otherData": {"rank": self.rank, "dropped": self.dropped}}, fh)
        os.replace(tmp, path)
        return path


def merge(directory: str, out: str) -> int:
    """Merge every ``*.json`` trace in ``directory`` into ``out``; return the span count."""
    events: list[dict[str, Any]] = []
    files = sorted(f for f in os.listdir(directory)
                   if f.endswith(".json") and os.path.join(directory, f) != os.path.abspath(out))
    for name in files:
        with open(os.path.join(directory, name)) as fh:
            try:
                data = json.load(fh)
            except ValueError as exc:
                raise SystemExit(f"{name}: not a trace file ({exc})") from None
        if isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
            events.extend(e for e in data["traceEvents"] if isinstance(e, dict))
    meta = [e for e in events if e.get("ph") == "M"]
    spans = sorted((e for e in events if e.get("ph") != "M"), key=lambda e: e.get("ts", 0))
    with open(out, "w") as fh:
        json.dump({"traceEvents": meta + spans, "displayTimeUnit": "ms"}, fh)
    return len(spans)


def main(argv: list[str] | None = None) -> int:
    import argparse  # here: every rank imports this module at init, few run its command

    parser = argparse.ArgumentParser(prog="python -m rankwise.diagnosis.trace",
                                     description="rankwise timelines (RANKWISE_TRACE=dir)")
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge the per-rank files of a directory into one")
    m.add_argument("directory")
    m.add_argument("-o", "--output", default="rankwise-trace.json")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.directory):
        parser.error(f"{args.directory} is not a directory")
    n = merge(args.directory, args.output)
    print(f"wrote {args.output}: {n} spans; open it at https://ui.perfetto.dev")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
