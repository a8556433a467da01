"""One route for every way into a device all_reduce (docs/design.md, "One call path"):
a steady-state call, traced, enters the same rankwise functions in the same order from
``api.path.launch`` on, whether the tensor's view is kept or not, ``group=`` is given or
not, the tensor is a ``Tensor`` subclass, or the call came through torch's backend
"rankwise"; and each entry reaches ``launch`` through ``api.plans.all_reduce_tensor``,
and every call has the same observers (``api.observers``), one tuple per group and engine;
a profiler adds its observer and its event, not a route.
Two thread-ranks over the NCCL engine's gloo stand-in (``test_device_fast_path``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from test_device_fast_path import _Event, _on_device_plane, _recording

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

_SRC = str(Path(__file__).resolve().parent.parent / "src" / "rankwise") + "/"
#: calls this deep below ``launch`` are recorded
_DEPTH = 8
#: modules recorded as entered, not what they do inside: that depends on what peers sent
#: by then (the router's early frames, a ring check's batch going out) or on time (the
#: stand-in's host wait polls until the book settles the work)
_LEAVES = ("core.router", "core.ring_check", "core.communicator", "identity.callsite",
           "engines.torch.streams", "engines.torch.device_waits", "engines.torch.work_book")


def _module(frame: FrameType) -> str | None:
    name = frame.f_code.co_filename
    if not name.startswith(_SRC):
        return None
    return name[len(_SRC):-3].replace("/", ".")


def _trace(fn: Callable[[], object]) -> tuple[list[str], list[str]]:
    """``fn()`` traced on this thread: the rankwise functions entered before ``launch``
    (``module.function``), and from ``launch`` on, to ``_DEPTH`` calls below it."""
    before: list[str] = []
    route: list[str] = []
    depth = [-1]  # -1: not inside launch yet
    leaf = [0]  # the depth of the leaf module entered (0: none)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            module = _module(frame)
            if depth[0] >= 0:
                depth[0] += 1
                if module is not None and depth[0] <= _DEPTH and not leaf[0]:
                    route.append(f"{module}.{frame.f_code.co_name}")
                    if module in _LEAVES:
                        leaf[0] = depth[0]
            elif module is not None:
                if module == "api.path" and frame.f_code.co_name == "launch":
                    depth[0] = 0
                    route.append("api.path.launch")
                else:
                    before.append(f"{module}.{frame.f_code.co_name}")
        elif event == "return" and depth[0] >= 0:
            if leaf[0] == depth[0]:
                leaf[0] = 0
            depth[0] -= 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return before, route


class _Sub(torch.Tensor):
    """A ``Tensor`` subclass, as frameworks make (torch's default ``__torch_function__``)."""


def _ways(rank: int) -> dict[str, tuple[list[str], list[str], Any]]:
    import torch.distributed as tdist

    import rankwise as dist
    from rankwise.api.world import resolve_group
    from rankwise.torch._backend import TorchProcessGroup

    g = resolve_group(None)
    assert g is not None
    backend = TorchProcessGroup(g, owns_world=False)
    opts = tdist.AllreduceOptions()
    opts.asyncOp = False  # torch's synchronous wrapper's call
    kept, big = torch.ones(4), torch.ones(1 << 15)  # 128 KiB: viewed afresh every call
    sub = torch.ones(4).as_subclass(_Sub)
    ways: dict[str, Callable[[], object]] = {
        "kept view": lambda: dist.all_reduce(kept),
        "fresh view": lambda: dist.all_reduce(big),
        "group=": lambda: dist.all_reduce(kept, group=g),
        "subclass": lambda: dist.all_reduce(sub),
        "torch backend": lambda: backend.allreduce([kept], opts),
    }
    out: dict[str, tuple[list[str], list[str], Any]] = {}
    for name, fn in ways.items():
        for _ in range(3):  # the last in steady state: the plan, its fingerprint, the
            before, route = _trace(fn)  # route and the call site (of these frames) are made
        out[name] = (before, route, g.history[-1].observers)  # the call's observers
    _recording.on = True  # a profiler records: its observer joins, nothing else changes
    try:
        for _ in range(3):
            before, route = _trace(lambda: dist.all_reduce(kept))
    finally:
        _recording.on = False
    out["profiled"] = (before, route, g.history[-1].observers)
    return out


def test_every_way_into_an_all_reduce_takes_one_route(monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwise.api import profiling

    monkeypatch.setattr(profiling, "on", lambda: _recording.on)
    monkeypatch.setattr(profiling, "recording", lambda: _recording.on)
    monkeypatch.setattr(profiling, "Event", _Event)
    for ways in _on_device_plane(monkeypatch, _ways):
        _, profiled_route, profiled = ways.pop("profiled")
        routes = {name: route for name, (_, route, _) in ways.items()}
        first = routes["kept view"]
        # under a profiler the same route, with the profiler's event begun and ended
        # (``api.profiling``, ``Profiled``) and nothing else: no hop to another thread
        # (the stand-in event asks for the group: its calls are the test's, left out;
        # ``observed`` finds the profiled observer set, ``after`` is ``Profiled``'s)
        start = profiled_route.index("identity.callsite.capture")
        added = ("api.observers.observed", "api.observers.after")
        assert [f for f in profiled_route[start:] if f not in added] == \
            first[first.index("identity.callsite.capture"):], (profiled_route, first)
        assert set(profiled_route[start:]) - set(first) == set(added), profiled_route
        assert first[0] == "api.path.launch"
        assert "engines.torch.engine.all_reduce" in first, first
        for name, route in routes.items():
            assert route == first, name
        for name, (before, _, _) in ways.items():
            assert "api.plans.all_reduce_tensor" in before, (name, before)
            entry = "torch._backend.allreduce" if name == "torch backend" \
                else "api.collectives.all_reduce"
            assert before[0] == entry, (name, before)
        # one layer of observers, the same object for every way in: made once per group
        # and engine, the ring check among them (the stand-in's data is torch's)
        observers = {name: obs for name, (_, _, obs) in ways.items()}
        kinds = [type(o).__name__ for o in observers["kept view"].members]
        assert kinds == ["WhoIsWhere", "RingCheck"], kinds
        for name, obs in observers.items():
            assert obs is observers["kept view"], name
        assert profiled.members[:-1] == observers["kept view"].members
        assert type(profiled.members[-1]).__name__ == "Profiled"
