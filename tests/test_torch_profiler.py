"""Profiler events for communication (issue 26 item 3): ``rankwise:<op>`` as gloo's
``gloo:<op>``, with the same count, ``is_async`` and input shapes, on the torch backend and
through ``import rankwise as dist`` alike; and none without a profiler."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.procs

from test_ddp_harness import free_port, run_ranks

pytestmark = pytest.mark.procs


def _calls(pg: Any, rank: int, world: int) -> None:
    import torch.distributed as tdist

    t = torch.ones(4, 3)
    tdist.all_reduce(t, group=pg)
    tdist.all_reduce(t, group=pg, async_op=True).wait()  # type: ignore[union-attr]
    tdist.all_reduce_coalesced([torch.ones(2), torch.ones(3, 1)], group=pg)
    tdist.broadcast(t, src=0, group=pg)
    tdist.all_gather([torch.zeros(4, 3) for _ in range(world)], t, group=pg)
    tdist.all_gather_coalesced([[torch.zeros(2), torch.zeros(1, 5)] for _ in range(world)],
                               [torch.ones(2), torch.ones(1, 5)], group=pg)
    tdist.all_to_all_single(torch.zeros(world, 2), torch.ones(world, 2), group=pg)
    tdist.reduce(t, dst=0, group=pg)
    peer = (rank + 1) % world
    src = (rank - 1) % world
    if rank % 2 == 0:
        tdist.send(torch.ones(rank + 1, 2), peer, group=pg)
        tdist.recv(torch.zeros(src + 1, 2), src, group=pg)
    else:
        tdist.recv(torch.zeros(src + 1, 2), src, group=pg)
        tdist.send(torch.ones(rank + 1, 2), peer, group=pg)
    work = tdist.irecv(torch.zeros(3), group=pg)  # any source
    tdist.send(torch.ones(3), peer, group=pg)
    assert work is not None
    work.wait()


def _events(prof: Any, prefix: str) -> list[tuple[str, bool, Any, int]]:
    return sorted((e.name[len(prefix):], e.is_async, e.input_shapes, e.count)
                  for e in (prof.events() if isinstance(prof, torch.profiler.profile)
                            else prof.function_events) if e.name.startswith(prefix))


def _profiled(rank: int, world: int, gloo_port: int) -> dict[str, Any]:
    import torch.distributed as tdist

    import rankwise
    import rankwise.torch  # registers backend "rankwise"

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank,
                             world_size=world)
    mine = tdist.new_group(backend="rankwise")
    got: dict[str, Any] = {}
    for name, pg in (("gloo", None), ("rankwise", mine)):
        with torch.autograd.profiler.profile(record_shapes=True) as prof:
            _calls(pg, rank, world)
        got[name] = _events(prof, f"{name}:")
    # rankwise's own API, on its own world: the same events
    t = torch.ones(5)
    with torch.profiler.profile(record_shapes=True) as prof2:
        rankwise.all_reduce(t)
        rankwise.all_gather([torch.zeros(5) for _ in range(world)], t)
        rankwise.barrier()
    got["api"] = _events(prof2, "rankwise:")
    # every event has its end (one ended from a bare thread shows "finished": false)
    trace = f"{tempfile.gettempdir()}/rankwise-profile-{os.getpid()}.json"
    prof2.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(trace)
    got["unfinished"] = [e["name"] for e in events if str(e.get("name")).startswith(
        "rankwise:") and e.get("args", {}).get("finished") is False]
    got["api_sum"] = t.tolist()
    # without a profiler: no event, and no profiler thread started by rankwise
    from rankwise.api import profiling

    got["on_without"] = profiling.on()
    tdist.destroy_process_group()
    return got


def test_communication_events_match_gloo() -> None:
    for got in run_ranks(_profiled, 2, free_port(), backend="rankwise", timeout=180):
        assert got["gloo"], "gloo recorded nothing: the comparison would be empty"
        assert got["rankwise"] == got["gloo"]
        assert got["api"] == [("all_gather", True, [[5]], 1), ("all_reduce", True, [[5]], 1),
                              ("barrier", True, [], 1)]
        assert got["api_sum"] == [2.0] * 5
        assert got["unfinished"] == []
        assert got["on_without"] is False


def test_no_event_machinery_without_torch_imported() -> None:
    """``on()`` never imports torch (a numpy-only job stays numpy-only)."""
    import subprocess
    import sys

    code = ("import sys; from rankwise.api import profiling; "
            "print(profiling.on(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["False", "False"]
