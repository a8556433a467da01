"""Mutual HMAC challenge that every rankwise connection (store and data) passes first.

Why: a rendezvous port is reachable by anyone on the network, and what arrives on it
steers a training job. With a shared token (``token=`` or ``RANKWISE_TOKEN``) each side
proves it knows the token without sending it, and a wrong token ends in ``AuthError``
on the connecting side at once, never in a hang.

Protocol (all on a blocking socket whose timeout the caller has set)::

    client -> server   MAGIC | purpose-len | purpose | has_token(1) | client_nonce(16)
    server -> client   MAGIC | status(1) | server_nonce(16)
                       status: 0 ok, 1 token settings differ, 2 purpose differs
    with a token:
    client -> server   HMAC(token, "c" | purpose | server_nonce | client_nonce)
    server -> client   status(1) | HMAC(token, "s" | purpose | client_nonce | server_nonce)

The purpose string ("store", "mesh") keeps a proof made for one kind of connection
from being replayed on another. Limits of this scheme, by design: after the handshake
frames are neither signed nor encrypted, so it keeps strangers and stale processes out
but does not protect against someone who can rewrite traffic on the path; use long
random tokens, on a network you trust.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
from dataclasses import dataclass

from .. import settings
from ..errors import AuthError, DistNetworkError

__all__ = ["NotRankwiseEndpoint", "PendingProof", "ServerHandshake", "client_handshake",
           "client_hello", "read_token_file", "recv_exact", "resolve_token", "server_handshake"]

_MAGIC = b"RWAUTH01"
_NONCE = 16
_FIRST_LOOK = 5  #: bytes of a client's hello read before judging it (< len(_MAGIC))
_MAC = 32
_OK, _TOKEN_SETTINGS_DIFFER, _PURPOSE_DIFFERS, _BAD_PROOF = 0, 1, 2, 3
TOKEN_ENV = "RANKWISE_TOKEN"
TOKEN_FILE_ENV = "RANKWISE_TOKEN_FILE"


class NotRankwiseEndpoint(AuthError):
    """The peer answered, but not with rankwise's handshake: another program holds the
    port (``rankwise doctor`` tells this apart from a store that refuses our token)."""


def read_token_file(path: str) -> str:
    """A token kept in a file (surrounding whitespace ignored); ``AuthError`` if unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(64 * 1024).strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthError(f"cannot read the token file {path!r} ({TOKEN_FILE_ENV}): {exc}") from exc
    if not text:
        raise AuthError(f"the token file {path!r} is empty")
    return text


def resolve_token(token: str | bytes | None) -> bytes | None:
    """The token to use: the explicit argument, else ``RANKWISE_TOKEN``, else the file
    named by ``RANKWISE_TOKEN_FILE``, else none."""
    if token is None:
        token = settings.text(TOKEN_ENV)
    path = settings.text(TOKEN_FILE_ENV)
    if token is None and path:
        token = read_token_file(path)
    if token is None:
        return None
    raw = token.encode() if isinstance(token, str) else bytes(token)
    if not raw:
        return None
    return raw


def recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    """Read exactly ``n`` bytes or raise ``DistNetworkError`` naming ``what``."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError as exc:
            raise DistNetworkError(f"timed out reading {what}") from exc
        except OSError as exc:
            raise DistNetworkError(f"connection failed while reading {what}: {exc}") from exc
        if k == 0:
            raise DistNetworkError(f"connection closed while reading {what}")
        got += k
    return bytes(buf)


def _send(sock: socket.socket, data: bytes, what: str) -> None:
    try:
        sock.sendall(data)
    except OSError as exc:
        raise DistNetworkError(f"connection failed while sending {what}: {exc}") from exc


def _mac(token: bytes, side: bytes, purpose: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(token, side + purpose + a + b, hashlib.sha256).digest()


def client_handshake(sock: socket.socket, token: bytes | None, purpose: str, peer: str) -> None:
    """Prove our token to the server at ``peer`` and check its proof in return."""
    pending = client_hello(sock, token, purpose, peer)
    if pending is not None:
        _send(sock, pending.proof, "token proof")
        pending.finish(sock)


@dataclass(frozen=True)
class PendingProof:
    """A client handshake's last step: ``proof`` still to send, the server's verdict and
    proof still to read (``finish``). Why held back: the proof may go out in one write
    with the client's first request, a round trip less on a slow link (``TCPStore``).
    Still safe: the server handles no request before the proof passed, and the client
    reads no reply before the server proved itself."""

    proof: bytes
    expected: bytes
    peer: str

    def finish(self, sock: socket.socket) -> None:
        """Read the server's verdict on our proof and check its own; ``AuthError`` if
        either fails."""
        answer = recv_exact(sock, 1 + _MAC, f"token verdict from {self.peer}")
        if answer[0] != _OK:
            raise AuthError(
                f"{self.peer} rejected our token: the shared token differs between processes. "
                f"Give every process the same RANKWISE_TOKEN (or token= argument)."
            )
        if not hmac.compare_digest(answer[1:], self.expected):
            raise AuthError(f"{self.peer} could not prove it holds the shared token; refusing "
                            "to talk to it")


def client_hello(sock: socket.socket, token: bytes | None, purpose: str,
                 peer: str) -> PendingProof | None:
    """The handshake's first exchange (settings and nonces); the proof still owed when
    there is a token (``PendingProof``), else None: the connection is ready."""
    purpose_b = purpose.encode()
    if len(purpose_b) > 255:
        raise ValueError(f"handshake purpose must be at most 255 bytes, got {len(purpose_b)}")
    client_nonce = secrets.token_bytes(_NONCE)
    _send(
        sock,
        _MAGIC + bytes([len(purpose_b)]) + purpose_b + bytes([token is not None]) + client_nonce,
        "handshake",
    )
    reply = recv_exact(sock, len(_MAGIC) + 1 + _NONCE, f"handshake reply from {peer}")
    if reply[: len(_MAGIC)] != _MAGIC:
        raise NotRankwiseEndpoint(f"{peer} is not a rankwise endpoint (unexpected handshake "
                                  "bytes)")
    status = reply[len(_MAGIC)]
    server_nonce = reply[len(_MAGIC) + 1 :]
    if status == _TOKEN_SETTINGS_DIFFER:
        mine = "set" if token is not None else "not set"
        raise AuthError(
            f"{peer} refused the connection: the shared token is {mine} here but "
            f"{'not set' if token is not None else 'required'} there. Give every process the "
            f"same RANKWISE_TOKEN (or token= argument)."
        )
    if status == _PURPOSE_DIFFERS:
        raise AuthError(f"{peer} serves a different kind of rankwise connection than {purpose!r}")
    if status != _OK:
        raise AuthError(f"{peer} refused the handshake (status {status})")
    if token is None:
        return None
    return PendingProof(_mac(token, b"c", purpose_b, server_nonce, client_nonce),
                        _mac(token, b"s", purpose_b, client_nonce, server_nonce), peer)


class ForeignClient(AuthError):
    """The peer's first bytes are not rankwise's handshake; ``head`` holds them, so the
    server can tell the user what connected (see ``rankwise.store.foreign``)."""

    def __init__(self, message: str, head: bytes) -> None:
        super().__init__(message)
        self.head = head


class ServerHandshake:
    """The server side of the handshake without I/O, so a blocking socket
    (``server_handshake``) and an event loop (the store server) run the same checks.

    Feed it exactly ``need`` bytes at a time (``step``); each step returns the bytes to
    send back, and raises ``AuthError`` (``ForeignClient`` for another system's client)
    *after* the caller sent them, via ``error``: the failing client is told why first.
    """

    def __init__(self, token: bytes | None, purpose: str, peer: str) -> None:
        self._token = token
        self._purpose = purpose.encode()
        self._peer = peer
        self._stage = 0
        self._head = b""
        self._client_nonce = b""
        self._server_nonce = secrets.token_bytes(_NONCE)
        self.need = _FIRST_LOOK  #: bytes the next ``step`` takes
        self.what = f"handshake from {peer}"  #: what those bytes are, for error messages
        self.done = False
        self.error: AuthError | None = None  #: raise this once the reply is sent

    def step(self, data: bytes) -> bytes:
        """Take ``need`` bytes; the reply to send (possibly empty)."""
        stage, self._stage = self._stage, self._stage + 1
        peer = self._peer
        if stage == 0:  # the first bytes alone: torch's TCPStore sends 5, then may wait
            self._head = data
            if not _MAGIC.startswith(data):
                raise ForeignClient(f"{peer} is not a rankwise client (unexpected handshake "
                                    "bytes)", data)
            self.need = len(_MAGIC) + 1 - _FIRST_LOOK
            return b""
        if stage == 1:
            head = self._head + data
            if head[: len(_MAGIC)] != _MAGIC:
                raise ForeignClient(f"{peer} is not a rankwise client (unexpected handshake "
                                    "bytes)", head)
            self.need, self.what = head[len(_MAGIC)], f"handshake purpose from {peer}"
            return b""
        if stage == 2:
            self._head = data  # the purpose asked for
            self.need, self.what = 1 + _NONCE, f"handshake from {peer}"
            return b""
        if stage == 3:
            return self._hello(data)
        return self._verdict(data)

    def _hello(self, rest: bytes) -> bytes:
        client_has_token = bool(rest[0])
        self._client_nonce = rest[1:]
        purpose_b, peer, token = self._head, self._peer, self._token
        status = _OK
        if purpose_b != self._purpose:
            status = _PURPOSE_DIFFERS
            self.error = AuthError(f"{peer} asked for a {purpose_b!r} connection on a "
                                   f"{self._purpose.decode()!r} endpoint")
        elif client_has_token != (token is not None):
            status = _TOKEN_SETTINGS_DIFFER
            self.error = AuthError(f"{peer} connected {'without' if token else 'with'} a "
                                   "token; refused")
        self.done = self.error is not None or token is None
        self.need, self.what = _MAC, f"token proof from {peer}"
        return _MAGIC + bytes([status]) + self._server_nonce

    def _verdict(self, proof: bytes) -> bytes:
        assert self._token is not None
        expected = _mac(self._token, b"c", self._purpose, self._server_nonce, self._client_nonce)
        self.done = True
        if not hmac.compare_digest(proof, expected):
            self.error = AuthError(f"{self._peer} presented a wrong token; connection refused")
            return bytes([_BAD_PROOF]) + bytes(_MAC)
        return bytes([_OK]) + _mac(self._token, b"s", self._purpose, self._client_nonce,
                                   self._server_nonce)


def server_handshake(sock: socket.socket, token: bytes | None, purpose: str, peer: str) -> None:
    """Check the proof of a connecting client; raise ``AuthError`` if it fails.

    The failing client is told why (so it raises a clear error of its own) before
    the caller closes the socket.
    """
    machine = ServerHandshake(token, purpose, peer)
    while not machine.done:
        reply = machine.step(recv_exact(sock, machine.need, machine.what))
        if reply:
            _send(sock, reply, "handshake reply")
        if machine.error is not None:
            raise machine.error
