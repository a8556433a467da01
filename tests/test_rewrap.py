"""rankwise's exception back from torch's re-wrap (``rankwise.unwrap``), and the bare copy
torch's C++ is given: no frame of rankwise's in what torch formats of it."""

from __future__ import annotations

import sys
import traceback

import pytest

import rankwise
from rankwise import rewrap
from rankwise.errors import DistTimeout, PeerFailure


def _raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as exc:  # noqa: BLE001 - handed back to the test
        return exc


def test_bare_keeps_class_message_and_attributes_but_no_traceback() -> None:
    error = _raised(PeerFailure("rank 1 died: gone", rank=1, last_collective="x"))
    copy = rewrap.bare(error)
    assert type(copy) is PeerFailure and str(copy) == str(error)
    assert (copy.rank, copy.last_collective) == (1, "x")  # type: ignore[attr-defined]
    assert copy.__traceback__ is None and error.__traceback__ is not None


def test_bare_copies_a_timeout_too() -> None:
    """``DistTimeout`` is a ``TimeoutError`` (an ``OSError``), whose layout
    ``BaseException.__new__`` refuses: a timed-out DDP bucket failed its torch future with
    that ``TypeError`` instead of the timeout."""
    error = _raised(DistTimeout("all_reduce #4 timed out", "who is where: ..."))
    copy = rewrap.bare(error)
    assert type(copy) is DistTimeout and isinstance(copy, TimeoutError)
    assert str(copy) == str(error) and copy.report == "who is where: ..."  # type: ignore[attr-defined]
    assert copy.__traceback__ is None


def test_unwrap_finds_rankwise_errors_by_chain_and_by_torchs_text() -> None:
    mine = PeerFailure("rank 3 died: its connection was lost\nmore lines", rank=3)
    assert rankwise.unwrap(mine) is mine
    outer = RuntimeError("wrapped")
    outer.__cause__ = mine
    assert rankwise.unwrap(outer) is mine
    torchs = RuntimeError(f"Cannot extract tensors from value: PeerFailure: {mine}\n\nAt:\n")
    assert rankwise.unwrap(torchs) is torchs  # not handed to torch: not found
    rewrap.note(mine)
    assert rankwise.unwrap(torchs) is mine
    other = RuntimeError("Cannot extract tensors from value: ValueError: rank 3 died")
    assert rankwise.unwrap(other) is other


def test_torchs_tensor_extraction_raises_a_copy_from_no_frame_of_rankwise() -> None:
    """What DDP's reducer does with a failed bucket's value (``_extract_tensors`` pickles
    it): the error comes out with only torch's frame on it, and unwrap finds the original."""
    torch = pytest.importorskip("torch")
    from torch._jit_internal import _extract_tensors

    from rankwise.torch._work import _Failed, fail_future

    error = _raised(PeerFailure("rank 1 died: test", rank=1))
    future = torch.futures.Future()
    fail_future(future, error)
    with pytest.raises(PeerFailure) as info:
        future.value()  # Python's callers get the original
    assert info.value is error
    with pytest.raises(PeerFailure, match="rank 1 died: test") as info:
        _extract_tensors(_Failed(error))  # the value C++ holds
    assert info.value is not error
    files = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
    assert not [f for f in files if "/rankwise/" in f], files
    assert rankwise.unwrap(RuntimeError(f"Cannot extract tensors from value: "
                                        f"PeerFailure: {info.value}")) is error


def test_a_seam_lets_rankwise_errors_out_without_the_frames_they_came_through() -> None:
    """``rewrap.frameless``: a rankwise error leaves with the caller's frames only (3.10
    keeps the seam's own one); any other error keeps every frame (a bug's are wanted)."""
    def inner(error: BaseException) -> None:
        raise error

    @rewrap.frameless
    def method(error: BaseException) -> None:
        inner(error)

    def frames(error: BaseException) -> list[str]:
        try:
            method(error)
        except BaseException as exc:  # noqa: BLE001 - read here
            return [f.name for f in traceback.extract_tb(exc.__traceback__)]
        raise AssertionError("method did not raise")

    names = frames(PeerFailure("rank 1 died: test", rank=1))
    assert names == (["frames"] if sys.version_info >= (3, 11) else ["frames", "seam"])
    assert frames(KeyError("bug")) == ["frames", "seam", "method", "inner"]
