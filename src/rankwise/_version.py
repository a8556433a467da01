"""rankwise's version, in a module of its own: the rendezvous compares it between ranks
(``api.init``), and ``rankwise/__init__`` imports that module before it could define it."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
