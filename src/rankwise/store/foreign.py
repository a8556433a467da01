"""Recognise a foreign client on rankwise's store port, to say what is wrong in one line.

``rankwise run`` exports ``MASTER_ADDR``/``MASTER_PORT`` pointing at its own store (as
torchrun does at its own). A script that never imports rankwise and calls
``torch.distributed.init_process_group`` with ``env://`` then connects torch's C++
``TCPStore`` client there, fails rankwise's handshake and retries for its whole timeout
(30 minutes), printing a C++ traceback per try. torch's client always opens with
``VALIDATE`` (one byte, 0) and a fixed little-endian magic number, so its first five
bytes are enough to name the problem and the fix. (``rankwise run`` with torch installed
takes such a client instead and serves it with torch's own store, ``launch.torch_store``:
this line is for when nothing does.)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TORCH_SCRIPT_UNDER_RANKWISE", "ForeignKnock", "describe_foreign_client"]


@dataclass(frozen=True)
class ForeignKnock:
    """A recognised foreign client on the store: what it is (with the fix) and which
    connection it came on, so the listener can tell its own workers from strangers."""

    what: str
    peer_host: str
    peer_port: int
    store_port: int

_TORCH_TCPSTORE_HELLO = b"\x00" + (0x3C85F7CE).to_bytes(4, "little")
"""``QueryType::VALIDATE`` then ``c10d::detail::validationMagicNumber`` (torch 2.x)."""

TORCH_SCRIPT_UNDER_RANKWISE = (
    "a torch.distributed TCPStore client (a script that calls torch.distributed."
    "init_process_group itself, without rankwise) connected to rankwise's store at "
    "MASTER_PORT, which it cannot speak to: add `import rankwise.torch` to the script "
    "(then backend 'rankwise' or 'gloo' works under `rankwise run`), or run it under torchrun"
)


def describe_foreign_client(head: bytes) -> str | None:
    """What connected, from its first bytes, with the fix; None if it is not recognised."""
    if head.startswith(_TORCH_TCPSTORE_HELLO):
        return TORCH_SCRIPT_UNDER_RANKWISE
    return None
