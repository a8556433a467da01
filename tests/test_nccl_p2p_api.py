"""Point-to-point on NCCL through the public API: thread-ranks over the real control
plane (headers as frames, the router, the mismatch broadcast), a fake NCCL engine with
the real book (``_nccl_p2p_fakes.FakeNcclEngine``). No GPU, no sleeps.
"""

from __future__ import annotations

from typing import Any

import pytest
from _nccl_p2p_fakes import FakeNcclEngine, FakeNet, floats, on_fake_nccl

from rankwise.errors import CollectiveMismatch, InvalidArgument

torch = pytest.importorskip("torch")


def test_the_api_sends_tensors_over_nccl_and_host_memory_beside_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    import rankwise as dist

    def rank(r: int, engine: FakeNcclEngine) -> Any:
        if r == 0:
            engine.tensors.device = torch.device("meta")  # the group's GPU: another one
            with pytest.raises(InvalidArgument, match="the tensor is on cpu, but the "
                               r"default group \(WORLD\)'s NCCL communicator is on meta"):
                dist.send(floats(1, 2), 1)
            with pytest.raises(InvalidArgument, match="is on cpu"):  # the whole batch
                dist.batch_isend_irecv([dist.P2POp(dist.isend, np.ones(1), 1, tag=4),
                                        dist.P2POp(dist.isend, floats(1), 1)])
            engine.tensors.device = torch.device("cpu")
            assert not engine.p2p._sent and not net.log, "I/O before the device check"
            dist.send(np.ones(1), 1, tag=5)  # after anything of the batch, if it sent
            dist.send(floats(1, 2), 1, tag=1)
            work = dist.isend(floats(3, 4, 5), 1, tag=2)
            assert work is not None and work.wait()
            dist.send(np.array([9.0], dtype=np.float32), 1, tag=1)  # host memory, tag 1 too
            ours, theirs = floats(6), torch.zeros(1)
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, theirs, 1),
                                            dist.P2POp(dist.isend, ours, 1)])
            for w in works:
                w.wait()
            return theirs.tolist(), engine.p2p is not None
        marker = np.zeros(1)
        dist.recv(marker, 0, tag=5)
        batch = dist.irecv(np.zeros(1), 0, tag=4)
        assert batch is not None and not batch.is_completed(), "the refused batch sent"
        second, first, host = torch.zeros(3), torch.zeros(2), np.zeros(1, dtype=np.float32)
        assert dist.recv(second, 0, tag=2) == 0
        pending = dist.irecv(first, 0, tag=1)
        assert dist.recv(host, 0, tag=1) == 0
        assert pending is not None and pending.wait() and pending.source_rank() == 0
        ours, theirs = floats(7), torch.zeros(1)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, ours, 0),
                                        dist.P2POp(dist.irecv, theirs, 0)])
        for w in works:
            w.wait()
        return second.tolist(), first.tolist(), host.tolist(), theirs.tolist()

    net = FakeNet(reads=True)
    zero, one = on_fake_nccl(monkeypatch, 2, rank, net)
    assert zero == ([7.0], True)
    assert one == ([3, 4, 5], [1, 2], [9.0], [6.0])


def test_the_switch_off_sends_tensors_through_host_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import rankwise as dist

    def rank(r: int, engine: FakeNcclEngine) -> Any:
        monkeypatch.setenv("RANKWISE_NCCL_P2P", "0")
        if r == 0:
            dist.send(floats(1, 2), 1)
        else:
            got = torch.zeros(2)
            dist.recv(got, 0)
            return got.tolist(), engine.p2p
        return None

    assert on_fake_nccl(monkeypatch, 2, rank)[1] == ([1, 2], None)


def test_a_mismatch_through_the_api_reaches_both_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    import rankwise as dist

    def rank(r: int, engine: FakeNcclEngine) -> Any:
        try:
            if r == 0:
                dist.send(floats(1, 2, 3, 4), 1)  # returns: the stream waits, not the host
                dist.recv(torch.zeros(1), 1, tag=77)  # released by rank 1's mismatch
            else:
                dist.recv(torch.zeros(5), 0)
        except CollectiveMismatch as exc:
            engine.dog.tick()  # one pass (its thread may have made it already)
            return str(exc), engine.aborted, engine.dog.failed, engine.dog.in_flight()
        return None

    (zero, aborted, failed, left), (one, *_) = on_fake_nccl(monkeypatch, 2, rank)
    for text in (zero, one):
        assert "rank 0 sent float32 x 4 (tag 0) at" in text and "test_nccl_p2p_api.py:" in text
        assert "rank 1 received it with recv(float32 x 5)" in text
    # the send waiting in NCCL: its group aborted, its work settled with the mismatch
    assert aborted == 1 and isinstance(failed, CollectiveMismatch) and left == 0


def test_a_device_recv_is_seen_by_the_deadlock_detector(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting for a header shows as a blocked recv (who-is-where, deadlock cycles),
    as on the host path: a cycle with a host recv is found, not left to the timeout."""
    import numpy as np

    import rankwise as dist
    from rankwise.errors import DeadlockError

    def rank(r: int, engine: FakeNcclEngine) -> Any:
        try:
            if r == 0:
                dist.recv(np.zeros(1, dtype=np.float32), 1, tag=5)  # host memory
            else:
                dist.recv(torch.zeros(2), 0, tag=3)  # CALL:device-recv
        except DeadlockError as exc:
            return str(exc)
        return None

    zero, one = on_fake_nccl(monkeypatch, 2, rank)
    for text in (zero, one):
        assert "rank 1: recv from rank 0 at test_nccl_p2p_api.py:" in text
        assert "rank 0: recv from rank 1 at test_nccl_p2p_api.py:" in text
