"""Rendezvous key-value stores with the API of torch.distributed's stores.

* ``TCPStore`` - over TCP; rank 0 (``is_master=True``) or the launcher
  (``TCPStoreServer``) hosts it. Token-authenticated, bounded binary protocol.
* ``FileStore`` - one file shared by the processes of one machine (``file://``).
* ``HashStore`` - in-process, for tests and single-process jobs.
* ``PrefixStore`` - a namespace inside another store.
"""

from __future__ import annotations

from .base import Store
from .file import FileStore
from .hash import HashStore
from .prefix import PrefixStore
from .protocol import DEFAULT_LIMITS, Limits
from .tcp import TCPStore
from .tcp_server import TCPStoreServer

__all__ = [
    "DEFAULT_LIMITS",
    "FileStore",
    "HashStore",
    "Limits",
    "PrefixStore",
    "Store",
    "TCPStore",
    "TCPStoreServer",
]
