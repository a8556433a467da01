"""Reading torch's flight-recorder dumps without running anything in them.

Why: a job on plain torch (backend "nccl" or "gloo") leaves one flight-recorder dump per
rank (``TORCH_FR_BUFFER_SIZE``; ``TORCH_FR_DUMP_TEMP_FILE`` + rank, the pickle that
``torch._C._distributed_c10d._dump_fr_trace`` returns, or the JSON of
``_dump_fr_trace_json``). torch's own reader (``flight_recorder.components.loader``)
calls ``pickle.load`` on them: a dump from another machine could run code. Here a pickle
dump goes through an unpickler whose ``find_class`` refuses every global, so only builtin
containers and scalars come out (the format needs nothing else); JSON is JSON. No torch
import: ``rankwise analyze`` runs where the files were copied to.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from typing import Any

__all__ = ["FlightDump", "NotAFlightDump", "load_flight_dumps", "read_flight_dump"]

MAX_DUMP_BYTES = 256 << 20  #: a bigger file is not a flight-recorder dump worth reading

FlightDump = dict[str, Any]


class NotAFlightDump(ValueError):
    """The file is neither a flight-recorder pickle nor its JSON."""


class _DataOnlyUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings and numbers; refuses every class and function."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"refused {module}.{name}: a flight-recorder dump holds only plain data")


def read_flight_dump(path: str) -> FlightDump:
    """One rank's dump (pickle or JSON), checked to have the keys torch writes."""
    size = os.path.getsize(path)
    if size > MAX_DUMP_BYTES:
        raise NotAFlightDump(f"{path}: {size} bytes, more than a flight-recorder dump")
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        if raw[:1] == b"\x80":
            data = _DataOnlyUnpickler(io.BytesIO(raw)).load()
        else:
            data = json.loads(raw)
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, KeyError,
            IndexError, AttributeError, MemoryError, RecursionError) as exc:
        raise NotAFlightDump(f"{path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries", []), list) \
            or "version" not in data:
        raise NotAFlightDump(f"{path}: no 'version' and 'entries': not a flight-recorder dump")
    return data


_RANK_SUFFIX = re.compile(r"(.*?)(\d+)$")


def _merge(into: FlightDump, more: FlightDump) -> None:
    """A second dump of one rank (torch 2.15 keeps one recorder per backend: a group over
    "cpu:gloo,cuda:nccl2" is in gloo's and in nccl2's) added to the first: entries side by
    side, each still naming its backend in ``profiling_name``."""
    into["entries"] = list(into.get("entries") or []) + list(more.get("entries") or [])
    for key in ("pg_config", "pg_status"):
        merged = dict(into.get(key) or {})
        merged.update(more.get(key) or {})
        into[key] = merged
    if more.get("version") != into.get("version"):
        into["version"] = f"{into.get('version')}, {more.get('version')}"


def load_flight_dumps(directory: str) -> dict[int, FlightDump]:
    """Every flight-recorder dump in ``directory``, by the rank its name ends with
    (torch names them ``<TORCH_FR_DUMP_TEMP_FILE><rank>``; several per rank, one per
    backend's recorder, are merged); other files are skipped."""
    dumps: dict[int, FlightDump] = {}
    for name in sorted(os.listdir(directory)):
        m = _RANK_SUFFIX.fullmatch(name)
        path = os.path.join(directory, name)
        if not m or not os.path.isfile(path):
            continue
        try:
            dump = read_flight_dump(path)
        except (NotAFlightDump, OSError):
            continue
        rank = int(m.group(2))
        if rank in dumps:
            _merge(dumps[rank], dump)
        else:
            dumps[rank] = dump
    return dumps
