"""Copies between user buffers and slots (``rankwise.engines.shm.copying``): exact at
every distance between source and destination, the slow distances (1-31 bytes modulo a
page, 16 KiB to 512 KiB) go through the bounce buffer and the rest straight, and nothing
bounces on a machine whose ``memcpy`` has no slow path."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rankwise.engines.shm import copying
from rankwise.engines.shm.copying import SLOW_MAX, SLOW_MIN, Copier, address, is_slow

PAGE = 4096


def _at_page_offset(buf: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
    """The ``nbytes`` of ``buf`` that start ``offset`` bytes past a page boundary."""
    skip = (offset - address(buf)) % PAGE
    return buf[skip:skip + nbytes]


@pytest.mark.parametrize("bounce", [True, False])
@pytest.mark.parametrize("nbytes", [SLOW_MIN, 100_003, 300_000])
def test_copies_are_exact_at_every_distance(nbytes: int, bounce: bool) -> None:
    rng = np.random.default_rng(nbytes)
    src_buf = rng.integers(0, 256, nbytes + 2 * PAGE, dtype=np.uint8)
    src = _at_page_offset(src_buf, 0, nbytes)
    copier = Copier(bounce=bounce)
    for distance in [*range(40), 2048, PAGE - 8]:
        dst_buf = np.zeros(nbytes + 3 * PAGE, np.uint8)
        dst = _at_page_offset(dst_buf, distance, nbytes)
        copier.copy(dst, src)
        np.testing.assert_array_equal(dst, src, err_msg=f"distance {distance}")
        assert int(dst_buf.sum(dtype=np.int64)) == int(src.sum(dtype=np.int64)), \
            f"distance {distance}: bytes outside the destination changed"


def _spy_on_bounces(monkeypatch: Any) -> list[int]:
    bounced: list[int] = []
    real = Copier.bounce

    def spy(self: Copier, dst: np.ndarray, src: np.ndarray, src_at: int) -> None:
        bounced.append(dst.nbytes)
        real(self, dst, src, src_at)

    monkeypatch.setattr(Copier, "bounce", spy)
    return bounced


def test_slow_distances_and_only_those_bounce(monkeypatch: Any) -> None:
    bounced = _spy_on_bounces(monkeypatch)
    copier = Copier(bounce=True)
    src_buf = np.ones(SLOW_MAX + 2 * PAGE, np.uint8)
    dst_buf = np.zeros(SLOW_MAX + 3 * PAGE, np.uint8)
    for nbytes, distance, slow in [(64 << 10, 16, True), (64 << 10, 1, True),
                                   (64 << 10, 31, True), (64 << 10, 32, False),
                                   (64 << 10, 0, False), (64 << 10, PAGE - 16, False),
                                   (SLOW_MIN - 64, 16, False), (SLOW_MAX, 16, False)]:
        bounced.clear()
        src = _at_page_offset(src_buf, 0, nbytes)
        dst = _at_page_offset(dst_buf, distance, nbytes)
        assert is_slow(address(dst), address(src), nbytes) == slow
        copier.copy(dst, src)
        assert bounced == ([nbytes] if slow else []), (nbytes, distance)
        np.testing.assert_array_equal(dst, src)


def test_read_only_sources_have_an_address() -> None:
    a = np.arange(10_000, dtype=np.float32)
    a.flags.writeable = False
    assert address(a) == a.ctypes.data


def test_without_the_slow_path_nothing_bounces(monkeypatch: Any) -> None:
    bounced = _spy_on_bounces(monkeypatch)
    monkeypatch.setattr(copying, "_measured", False)  # as measured on a machine without it
    copier = Copier()
    assert not copier.bounces
    src_buf = np.arange(SLOW_MAX + 2 * PAGE, dtype=np.uint32).view(np.uint8)[:SLOW_MAX + PAGE]
    dst_buf = np.zeros(SLOW_MAX + 3 * PAGE, np.uint8)
    for distance in (1, 16, 31):
        src = _at_page_offset(src_buf, 0, 64 << 10)
        dst = _at_page_offset(dst_buf, distance, 64 << 10)
        copier.copy(dst, src)
        copier.copy_at(dst, address(dst), src, address(src))
        np.testing.assert_array_equal(dst, src)
    assert bounced == []


def test_the_machine_is_measured_once(monkeypatch: Any) -> None:
    monkeypatch.setattr(copying, "_measured", None)
    verdict = copying.slow_path_here()
    assert isinstance(verdict, bool)
    assert copying._measured is verdict  # kept: later Copiers do not measure again
    assert Copier().bounces is verdict
