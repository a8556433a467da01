"""Large buffers on huge pages: never changes contents, never fails, only whole pages.

In-process tests of ``rankwise.wire.hugepages``; whether the kernel grants huge pages is
read back from /proc/self/smaps where the machine allows it (skipped elsewhere).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from rankwise.wire import hugepages as hp


def _huge_kib(address: int, nbytes: int) -> int:
    """AnonHugePages (KiB) of the mappings overlapping [address, address + nbytes)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < address + nbytes and hi > address
        elif line.startswith("AnonHugePages:") and inside:
            total += int(line.split()[1])
    return total


needs_thp = pytest.mark.skipif(not hp.enabled(), reason="no transparent huge pages here")


def test_empty_is_aligned_writable_and_sized() -> None:
    for nbytes in (0, 1000, hp.MIN_BYTES - 1, hp.MIN_BYTES, 5 * hp.PAGE + 123):
        buf = hp.empty(nbytes)
        assert buf.nbytes == nbytes and buf.dtype == np.uint8 and buf.flags.writeable
        if nbytes >= hp.MIN_BYTES and hp.enabled():
            assert buf.__array_interface__["data"][0] % hp.PAGE == 0
        buf[:] = 7
        assert int(buf.sum()) == 7 * nbytes


@needs_thp
def test_empty_faults_in_huge_pages() -> None:
    buf = hp.empty(3 * hp.PAGE)
    buf[:] = 1
    assert _huge_kib(buf.__array_interface__["data"][0], buf.nbytes) >= 2048


@needs_thp
def test_a_reused_torch_buffer_moves_to_huge_pages_and_keeps_its_values() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(5 * hp.PAGE // 4, dtype=torch.float32)  # torch: small pages
    before = t.clone()
    a = t.numpy()
    addr = a.__array_interface__["data"][0]
    assert not hp.advise(a)  # first sighting: a possibly one-off buffer is left alone
    first = _huge_kib(addr, a.nbytes)
    converted = hp.advise(a)  # second: converted, where the kernel can (Linux >= 6.1)
    second = _huge_kib(addr, a.nbytes)
    assert torch.equal(t, before)
    assert not hp.advise(a)  # and only once
    if converted:
        start, end = hp._inner_pages(addr, a.nbytes)
        assert second - first >= (end - start) // 1024, (first, second, end - start)


def test_advise_never_fails_on_odd_buffers(tmp_path: Path) -> None:
    hp.advise(np.zeros(10, np.float32))  # small: ignored
    ro = np.zeros(hp.MIN_BYTES, np.uint8)
    ro.flags.writeable = False
    for _ in range(2):
        hp.advise(ro)
    path = tmp_path / "mapped.bin"
    path.write_bytes(bytes(hp.MIN_BYTES + hp.PAGE))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        filebacked = np.frombuffer(m, np.uint8)
        for _ in range(2):
            hp.advise(filebacked)  # file-backed: the kernel may refuse, we must not raise
        assert int(filebacked[:16].sum()) == 0
        del filebacked
    assert os.path.getsize(path) == hp.MIN_BYTES + hp.PAGE


def test_opt_out_turns_everything_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKWISE_HUGEPAGES", "0")
    assert hp._load() is None
