"""Point-to-point on the NCCL engine's own class, in real processes: the CPU stand-in
(``RANKWISE_TENSOR_PATH=device``: torch's gloo where NCCL would be) with
``RANKWISE_NCCL_P2P=1``. What the in-process fakes of ``test_nccl_p2p.py`` cannot show:
the real engine's wiring (its torch group, book, abort) and headers over TCP.
"""

from __future__ import annotations

from typing import Any

import pytest

import rankwise as dist
from rankwise.testing import run_ranks

torch = pytest.importorskip("torch")

ENV = {"RANKWISE_TENSOR_PATH": "device", "RANKWISE_NCCL_P2P": "1"}


def _exchange(rank: int, world: int) -> Any:
    if rank == 0:  # tag 1, then tag 2; rank 1 receives them the other way round
        w1 = dist.isend(torch.tensor([1.0, 2.0]), 1, tag=1)
        w2 = dist.isend(torch.tensor([3.0, 4.0, 5.0]), 1, tag=2)
        back = torch.zeros(1)
        dist.recv(back, 1, tag=7)
        assert w1 is not None and w2 is not None
        w1.wait()
        w2.wait()
        got = [back.tolist()]
    else:
        second, first = torch.zeros(3), torch.zeros(2)
        assert dist.recv(second, 0, tag=2) == 0
        assert dist.recv(first, 0, tag=1) == 0
        dist.send(torch.tensor([9.0]), 0, tag=7)
        got = [second.tolist(), first.tolist()]
    peer = 1 - rank
    ours, theirs = torch.full((2,), float(rank + 10)), torch.zeros(2)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, ours, peer),
                                     dist.P2POp(dist.irecv, theirs, peer)]):
        w.wait()
    got.append(theirs.tolist())
    return got


@pytest.mark.timeout(120)
@pytest.mark.procs
def test_p2p_on_the_nccl_engine_class() -> None:
    results = run_ranks(_exchange, 2, timeout=90, init_kwargs={"backend": "nccl"}, env=ENV)
    assert [r.error_type for r in results] == [None, None], [r.traceback for r in results]
    assert results[0].value == [[9.0], [11.0, 11.0]]
    assert results[1].value == [[3.0, 4.0, 5.0], [1.0, 2.0], [10.0, 10.0]]


def _mismatch(rank: int, world: int) -> None:
    if rank == 0:
        w = dist.isend(torch.arange(4, dtype=torch.float32), 1)  # CALL:sent
        assert w is not None
        w.wait()  # never received: the receiver's mismatch ends it
    else:
        dist.recv(torch.zeros(5), 0)  # CALL:received


@pytest.mark.timeout(120)
@pytest.mark.procs
def test_a_p2p_mismatch_on_the_nccl_engine_class_reaches_both_ranks() -> None:
    from _error_cases import line_of

    results = run_ranks(_mismatch, 2, timeout=90,
                        init_kwargs={"backend": "nccl", "timeout": 20.0}, env=ENV)
    sent = f"test_nccl_p2p_procs.py:{line_of(__file__, 'CALL:sent')}"
    received = f"test_nccl_p2p_procs.py:{line_of(__file__, 'CALL:received')}"
    for r in results:
        assert r.error_type == "CollectiveMismatch", r.traceback
        assert f"rank 0 sent float32 x 4 (tag 0) at {sent}" in r.traceback
        assert f"rank 1 received it with recv(float32 x 5) at {received}" in r.traceback
