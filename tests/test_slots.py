"""``rankwise.slots.fast_new``: the C constructor makes the same objects as the class's own
``__init__`` (the fallback), and refuses classes whose ``__init__`` does more."""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest

from rankwise import slots
from rankwise.engines.base import Call
from rankwise.engines.torch.work_book import Pending
from rankwise.slots import fast_new

needs_c = pytest.mark.skipif(slots._maker is None, reason="the C module was not built")


def _values(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


@needs_c
@pytest.mark.parametrize("cls, args", [
    (Call, ("g", 3, "fp", "site", "dtype", "op", 1.5, 2.5)),
    (Call, ("g", 3, "fp", "site", "dtype", "op", 1.5, 2.5, (2, 3), 9.0, True)),
    (Pending, ("book", "call", "work", 1.0)),
    (Pending, ("book", "call", "work", 1.0, True)),
])
def test_the_c_maker_stores_what_the_init_stores(cls: Any, args: tuple[Any, ...]) -> None:
    new = fast_new(cls)
    assert new is not cls
    made, expected = new(*args), cls(*args)
    assert type(made) is cls
    got, want = _values(made), _values(expected)
    assert got.keys() == want.keys()
    for name, value in want.items():  # nan != nan: compare by identity or both nan
        assert got[name] is value or got[name] == value or (
            isinstance(value, float) and math.isnan(value) and math.isnan(got[name])), name


@needs_c
def test_keywords_and_wrong_counts_go_to_the_class_itself() -> None:
    new = fast_new(Pending)
    assert new("b", "c", "w", 1.0, error=KeyError("x")).error.args == ("x",)
    with pytest.raises(TypeError, match="missing"):
        new("b", "c")
    with pytest.raises(TypeError):
        new(*range(20))


@needs_c
def test_references_are_counted() -> None:
    new = fast_new(Pending)
    token = object()
    before = sys.getrefcount(token)
    made = [new(token, token, token, 0.0) for _ in range(100)]
    assert sys.getrefcount(token) == before + 300
    del made
    gc.collect()
    assert sys.getrefcount(token) == before


def test_without_the_c_module_the_class_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots, "_maker", None)
    assert fast_new(Pending) is Pending


@dataclass(slots=True)
class _PostInit:
    a: int

    def __post_init__(self) -> None:
        self.a += 1


@dataclass(slots=True)
class _Factory:
    a: list[int] = field(default_factory=list)


@dataclass
class _NoSlots:
    a: int


@dataclass(slots=True)
class _NoInitField:
    a: int
    b: int = field(default=0, init=False)


@dataclass(slots=True)
class _InitVar:
    a: int
    b: dataclasses.InitVar[int] = 0


@dataclass(slots=True, kw_only=True)
class _KeywordOnly:
    a: int = 0


@pytest.mark.parametrize("cls", [_PostInit, _Factory, _NoSlots, _NoInitField, _InitVar,
                                 _KeywordOnly, dict])
def test_classes_whose_init_does_more_get_themselves(cls: Any) -> None:
    assert fast_new(cls) is cls


@pytest.mark.parametrize("built", [True, False])
def test_slot_maker_stores_the_values_then_the_defaults(built: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``slot_maker``: the C maker where built, else Python; the same objects either way,
    no ``__init__`` run, and a wrong count refused."""
    if built and slots._maker is None:
        pytest.skip("the C module was not built")
    if not built:
        monkeypatch.setattr(slots, "_maker", None)

    class Three:
        __slots__ = ("a", "b", "c")

        def __init__(self) -> None:
            raise AssertionError("no __init__ runs")

    make = slots.slot_maker(Three, ("a", "b", "c"), (None,))
    full, short = make(1, [2], 3), make(1, [2])
    assert type(full) is Three
    assert (full.a, full.b, full.c) == (1, [2], 3)
    assert (short.a, short.b, short.c) == (1, [2], None)
    with pytest.raises((TypeError, AssertionError)):
        make(1)  # too few: refused (C hands it to the class, whose __init__ refuses)


def test_an_ended_work_is_a_work_with_its_values() -> None:
    """``Work.ended`` (made by ``slot_maker``): its values, the shared done event, and a
    future of its own."""
    from rankwise.core.work import Work

    class Device:
        waited = 0

        def wait(self) -> None:
            Device.waited += 1

    work = Work.ended(lambda: "all_reduce #1", ["t"], Device(), None)
    assert isinstance(work, Work)
    assert work.wait() and Device.waited == 1
    assert work.description == "all_reduce #1" and work.result() == ["t"]
    assert work.exception() is None and work.is_success()
    failed = Work.ended(lambda: "all_reduce #2", [], None, ValueError("bad"))
    with pytest.raises(ValueError, match="bad"):
        failed.wait()
    assert failed.get_future() is failed.get_future()
