"""One store round in O(n) requests: rank 0 of the round gathers, everyone reads one blob.

Why: "every member writes its value, then reads everyone's" costs each of n members a
wait on n keys and n reads, n^2 requests a round; at 256 ranks a ``new_group`` of the
world was 65,000 requests. Here rank 0 of the round reads the n values and publishes
one blob that every other member reads once: about 4n requests. ``digest`` may shrink
the blob (a verdict instead of every value) where readers need less than everything.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..errors import DistTimeout

__all__ = ["KEYS_PER_WAIT", "gather"]

KEYS_PER_WAIT = 512  #: keys per wait request, so that one request stays small


def gather(store: Any, key: str, value: str, size: int, rank: int, timeout: float,
           digest: Callable[[list[bytes]], str] | None = None) -> str:
    """Publish ``value`` as ``<key>/<rank>``; return ``digest`` of every rank's value in
    rank order (default: the values joined as a JSON list), as rank 0 computed it.
    A value that does not come raises the store's ``DistTimeout``."""
    deadline = time.monotonic() + timeout
    done = f"{key}/all"
    if rank == 0:
        store.set(f"{key}/{rank}", value)
        keys = [f"{key}/{r}" for r in range(size)]
        for start in range(0, size, KEYS_PER_WAIT):
            left = max(deadline - time.monotonic(), 0.001)
            store.wait(keys[start:start + KEYS_PER_WAIT], timedelta(seconds=left))
        values = [v if v is not None else store.get(k)  # (read_many: one round trip)
                  for k, v in zip(keys, store.read_many(keys), strict=True)]
        blob = digest(values) if digest is not None else json.dumps(
            [v.decode("utf-8", "replace") for v in values])
        store.set(done, blob)
        return blob
    # publish, wait and read in one round trip
    _, blob_b = store.batch_then_wait_get([("set", f"{key}/{rank}", value)], done, timeout)
    if blob_b is None:
        raise DistTimeout(f"store wait for {done!r} timed out after {timeout:g} s: rank 0 of "
                          "this round did not publish every member's value (a member may "
                          "have crashed or be stuck earlier)")
    return str(blob_b.decode("utf-8", "replace"))
