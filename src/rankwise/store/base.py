"""The abstract ``Store``: argument checking and error wording shared by every backend.

Why a template class: each backend (in-memory, file, TCP, prefix) only implements a
handful of primitives on raw ``bytes`` keys. Checking the caller's arguments, turning
``str`` into ``bytes``, enforcing the size limits and wording ``DistTimeout`` messages
happen here once, so every store rejects the same misuse with the same
``InvalidArgument`` *before any I/O*, and times out with the same kind of message.

Keys starting with NUL (``"\\0"``) are reserved for the stores' own bookkeeping (for
instance the TCP store's worker counter); they are refused from callers and not counted
by ``num_keys``.

A store can be *watched* (``Store.watcher``, set on the real store; prefixes read their
base's): then ``get`` and ``wait`` block in slices and ask the watcher between them,
and when the store itself fails. Why: once a job runs, a rank blocked in a store round
(a group being created, an engine agreeing on its segment, torch's gloo connecting)
must hear that a peer failed -- the peer's traceback, not a timeout or "the store went
away" when the failed rank hosted the store. ``rankwise.init_process_group`` installs a
watcher that raises the job's failure.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..errors import DistTimeout, InvalidArgument, StoreError
from .protocol import DEFAULT_LIMITS, INT64_MAX, INT64_MIN, Limits

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+

__all__ = ["AUTH_FAILURES_KEY", "DEFAULT_TIMEOUT", "RESERVED_PREFIX", "Store", "Watcher",
           "to_seconds"]

#: called between the slices of a watched blocking call with None, and with the error
#: when the store itself fails: raises what the caller should see instead, or returns
Watcher = Callable[[StoreError | None], None]
#: seconds a watched blocking call waits between two looks at its watcher
WATCH_SLICE = 0.25

DEFAULT_TIMEOUT = timedelta(seconds=300)
RESERVED_PREFIX = b"\x00"
#: where a TCP store server notes connections that failed the token check
AUTH_FAILURES_KEY = RESERVED_PREFIX + b"auth_failures"


def to_seconds(timeout: timedelta | float, what: str = "timeout") -> float:
    """A non-negative number of seconds from a ``timedelta`` or a number."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise InvalidArgument(
            f"{what} must be a timedelta or seconds, got {type(timeout).__name__}"
        )
    if not (seconds >= 0.0 and math.isfinite(seconds)):  # also rejects NaN
        raise InvalidArgument(
            f"{what} must be a finite number of seconds >= 0 (timedelta.max for 'very long'), "
            f"got {seconds}"
        )
    return seconds


def _fmt_seconds(seconds: float) -> str:
    return f"{seconds:g}s"


#: an expected value no store key ever holds (``Store.read_many``)
_NEVER = b"\x00rankwise: absent\x00"


def _reads_absent(ops: Sequence[tuple[Any, ...]], results: list[Any]) -> list[Any]:
    """A "read" whose compare_set answered the never-stored value found no key: None."""
    return [None if op[0] == "read" and value == _NEVER else value
            for op, value in zip(ops, results, strict=True)]


class Store(abc.ABC):
    """Key-value store used for rendezvous, with the API of torch.distributed's stores.

    Keys are ``str`` (sent as UTF-8); values are ``bytes`` (a ``str`` value is encoded
    as UTF-8). ``get`` and ``wait`` block until the keys exist, bounded by ``timeout``.
    """

    def __init__(
        self, timeout: timedelta | float = DEFAULT_TIMEOUT, limits: Limits = DEFAULT_LIMITS
    ):
        if not isinstance(limits, Limits):
            raise InvalidArgument(f"limits must be a Limits, got {type(limits).__name__}")
        self._timeout_s = to_seconds(timeout)
        self._limits = limits

    # ----------------------------------------------------------------- primitives
    @abc.abstractmethod
    def _set(self, key: bytes, value: bytes) -> None: ...

    @abc.abstractmethod
    def _get(self, key: bytes, timeout_s: float) -> bytes | None:
        """The value, or ``None`` when ``timeout_s`` passed without the key appearing."""

    @abc.abstractmethod
    def _add(self, key: bytes, amount: int) -> int: ...

    @abc.abstractmethod
    def _compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes: ...

    @abc.abstractmethod
    def _wait(self, keys: list[bytes], timeout_s: float) -> list[bytes]:
        """The keys still missing after waiting up to ``timeout_s`` (empty: all there)."""

    @abc.abstractmethod
    def _check(self, keys: list[bytes]) -> bool: ...

    @abc.abstractmethod
    def _delete_key(self, key: bytes) -> bool: ...

    @abc.abstractmethod
    def _num_keys(self) -> int: ...

    def _batch(self, ops: list[tuple[str, list[bytes]]]) -> list[bytes | int | None]:
        """``ops`` (``("set"|"add"|"compare_set", args)``, keys already namespaced) in
        order; a network store sends them all before reading a reply (``TCPStore``)."""
        out: list[bytes | int | None] = []
        for name, args in ops:
            if name == "set":
                self._set(args[0], args[1])
                out.append(None)
            elif name == "add":
                out.append(self._add(args[0], int(args[1])))
            else:
                out.append(self._compare_set(args[0], args[1], args[2]))
        return out

    def _batch_then_get(self, ops: list[tuple[str, list[bytes]]], key: bytes,
                        timeout_s: float) -> tuple[list[bytes | int | None], bytes | None]:
        """``_batch(ops)``, then ``_get(key, timeout_s)``; a network store sends them all
        in one write (``TCPStore``)."""
        return self._batch(ops), self._get(key, timeout_s)

    def _batch_wait_read(self, ops: list[tuple[str, list[bytes]]], keys: list[bytes],
                         timeout_s: float) -> tuple[list[bytes | int | None], list[bytes],
                                                    list[bytes | None]]:
        """``_batch(ops)``, ``_wait(keys, timeout_s)`` and, when none is missing, every
        key's value: (results, missing keys, values); a network store sends them all in
        one write (``TCPStore``)."""
        results = self._batch(ops)
        missing = self._wait(keys, timeout_s)
        return results, missing, [] if missing else \
            [self._compare_set(key, _NEVER, _NEVER) for key in keys]

    def auth_failures(self) -> str:
        """What the server noted about connections that failed the token check ("" if
        none): a rank started with a different RANKWISE_TOKEN shows up here, so waiting
        ranks can say why it never joined."""
        if not self._check([AUTH_FAILURES_KEY]):
            return ""
        return (self._get(AUTH_FAILURES_KEY, 1.0) or b"").decode("utf-8", "replace")

    def _describe(self) -> str:
        """Where this store lives, for error messages."""
        return type(self).__name__

    # ----------------------------------------------------------- argument checks
    def _key(self, key: object) -> bytes:
        if not isinstance(key, str):
            raise InvalidArgument(f"store keys must be str, got {type(key).__name__}")
        raw = key.encode("utf-8")
        if raw.startswith(RESERVED_PREFIX):
            raise InvalidArgument(f"store keys starting with NUL are reserved, got {key!r}")
        if len(raw) > self._limits.max_key_bytes:
            raise InvalidArgument(
                f"store key of {len(raw)} bytes exceeds the limit of "
                f"{self._limits.max_key_bytes} bytes: {key[:40]!r}..."
            )
        return raw

    def _keys(self, keys: object) -> list[bytes]:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise InvalidArgument(f"keys must be a list of str, got {type(keys).__name__}")
        if len(keys) > self._limits.max_keys:
            raise InvalidArgument(
                f"{len(keys)} keys in one request exceed the limit of {self._limits.max_keys}"
            )
        return [self._key(k) for k in keys]

    def _value(self, value: object, what: str = "value") -> bytes:
        if isinstance(value, str):
            raw = value.encode("utf-8")
        elif isinstance(value, (bytes, bytearray, memoryview)):
            raw = bytes(value)
        else:
            raise InvalidArgument(f"store {what} must be bytes or str, got {type(value).__name__}")
        if len(raw) > self._limits.max_value_bytes:
            raise InvalidArgument(
                f"store {what} of {len(raw)} bytes exceeds the limit of "
                f"{self._limits.max_value_bytes} bytes"
            )
        return raw

    # ---------------------------------------------------------------- public API
    @property
    def timeout(self) -> timedelta:
        """How long ``get``/``wait`` (and connecting) may block."""
        return timedelta(seconds=self._timeout_seconds())

    def _timeout_seconds(self) -> float:
        """The default bound in seconds (a wrapping store defers to the wrapped one)."""
        return self._timeout_s

    #: see the module's doc; kept by the real store (a prefix forwards to its base)
    watcher: Watcher | None = None

    def set_watcher(self, watcher: Watcher | None) -> None:
        """Watch this store's blocking calls with ``watcher`` (None: stop watching)."""
        self.watcher = watcher

    def _watching(self) -> Watcher | None:
        return self.watcher

    def watched(self) -> bool:
        """Whether blocking calls hear a watcher (so a caller need not poll for failures)."""
        return self._watching() is not None

    def _blocking(self, step: Callable[[float], bool], timeout_s: float) -> None:
        """Run ``step(seconds)`` (True: done) for up to ``timeout_s`` seconds: at once
        when nothing watches, else in ``WATCH_SLICE`` slices with the watcher asked in
        between and shown a store failure before it is raised."""
        watch = self._watching()
        if watch is None:
            step(timeout_s)
            return
        end = time.monotonic() + timeout_s
        try:
            # never a zero slice: to a store server 0 may mean "no bound"
            while not step(max(0.001, min(WATCH_SLICE, end - time.monotonic()))):
                if time.monotonic() >= end:
                    return
                watch(None)
        except StoreError as err:
            watch(err)
            raise

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Change the default bound of blocking calls."""
        self._timeout_s = to_seconds(timeout)

    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key``, waking everyone blocked on it."""
        self._set(self._key(key), self._value(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, blocking until it is set; ``DistTimeout`` after ``timeout``."""
        timeout_s = self._timeout_seconds()
        value = self.wait_get(key, timeout_s)
        if value is None:
            raise DistTimeout(
                f"store get({key!r}) on {self._describe()} timed out after "
                f"{_fmt_seconds(timeout_s)}: no process set that key. Check that every rank "
                f"reached the same point (a rank may have crashed or be stuck earlier), or "
                f"raise the timeout."
            )
        return value

    def wait_get(self, key: str, timeout: timedelta | float) -> bytes | None:
        """``key``'s value once it is set, None when ``timeout`` passed first: a wait and
        a read in one round trip (a blocking get), as init's waits use it."""
        raw = self._key(key)
        got: list[bytes | None] = [None]

        def step(seconds: float) -> bool:
            got[0] = self._get(raw, seconds)
            return got[0] is not None
        self._blocking(step, to_seconds(timeout))
        return got[0]

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (missing counts as 0)."""
        raw = self._key(key)
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise InvalidArgument(f"add amount must be an int, got {type(amount).__name__}")
        if not INT64_MIN <= amount <= INT64_MAX:
            raise InvalidArgument(f"add amount {amount} does not fit in 64 bits")
        return self._add(raw, amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it currently holds ``expected``; return what it holds.

        torch semantics: a missing key counts as matching an *empty* ``expected``. When
        the key is missing and ``expected`` is not empty nothing is stored and
        ``expected`` is returned.
        """
        raw = self._key(key)
        return self._compare_set(
            raw, self._value(expected, "expected value"), self._value(desired, "desired value")
        )

    def batch(self, ops: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run ``ops`` in order, each ``("set", key, value)``, ``("add", key, amount)``,
        ``("compare_set", key, expected, desired)`` or ``("read", key)``; their results
        (None for a set, and for a read of a missing key). Why:
        on a network store they cost one round trip together, not one each -- what init
        pays per request on a slow link (docs/scale.md)."""
        return _reads_absent(ops, self._batch(self._raw_ops(ops)))

    def batch_then_wait_get(self, ops: Sequence[tuple[Any, ...]], key: str,
                            timeout: timedelta | float) -> tuple[list[Any], bytes | None]:
        """``batch(ops)`` and ``wait_get(key, timeout)`` in one round trip: what a member
        of a store round does (publish, then wait for the verdict). The watcher, if
        any, is asked as during ``wait_get``."""
        raw, raw_key = self._raw_ops(ops), self._key(key)
        results: list[Any] = []
        got: list[bytes | None] = [None]

        def step(seconds: float) -> bool:  # the batch goes with the first look only
            if results:
                got[0] = self._get(raw_key, seconds)
            else:
                done, got[0] = self._batch_then_get(raw, raw_key, seconds)
                results.extend(done)
            return got[0] is not None
        self._blocking(step, to_seconds(timeout))
        return _reads_absent(ops, results), got[0]

    def batch_then_wait_read(self, ops: Sequence[tuple[Any, ...]], keys: Sequence[str],
                             timeout: timedelta | float) -> tuple[list[Any], list[bytes] | None]:
        """``batch(ops)``, then wait until every one of ``keys`` is set and read them, in one
        round trip: what a round's leader does (publish, collect every member's answer).
        The values are None when ``timeout`` passed first; the watcher is asked as during
        ``wait``."""
        raw, raw_keys = self._raw_ops(ops), self._keys(list(keys))
        results: list[Any] = []
        values: list[bytes | None] = []
        missing = raw_keys
        first = [True]

        def step(seconds: float) -> bool:  # the batch goes with the first look only
            nonlocal missing
            done, missing, got = self._batch_wait_read(raw if first[0] else [], missing,
                                                       seconds)
            if first[0]:
                results.extend(done)
                first[0] = False
            if not missing:
                values.extend(None if v == _NEVER else v for v in got)
            return not missing
        self._blocking(step, to_seconds(timeout))
        if missing:
            return _reads_absent(ops, results), None
        if len(values) != len(raw_keys):  # the keys came over several looks: read them all
            values[:] = self.read_many(list(keys))
        if any(v is None for v in values):
            raise StoreError(f"batch_then_wait_read on {self._describe()}: a key waited for "
                             "was deleted before it was read")
        return _reads_absent(ops, results), [v for v in values if v is not None]

    def _raw_ops(self, ops: Sequence[tuple[Any, ...]]) -> list[tuple[str, list[bytes]]]:
        """``batch``'s ops with their keys namespaced and values encoded, checked before
        any I/O."""
        raw: list[tuple[str, list[bytes]]] = []
        for op in ops:
            name, key, *rest = op
            if name == "add":
                amount = rest[0]
                if not isinstance(amount, int) or isinstance(amount, bool) \
                        or not INT64_MIN <= amount <= INT64_MAX:
                    raise InvalidArgument(f"add amount must be a 64-bit int, got {amount!r}")
                raw.append((name, [self._key(key), str(amount).encode()]))
            elif name in ("set", "compare_set"):
                raw.append((name, [self._key(key), *(self._value(v) for v in rest)]))
            elif name == "read":  # a compare_set that changes nothing (``read_many``)
                raw.append(("compare_set", [self._key(key), _NEVER, _NEVER]))
            else:
                raise InvalidArgument(f"batch: unknown store op {name!r}")
        return raw

    def read_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys`` (None where missing) in one ``batch``, without waiting:
        each is a ``compare_set`` whose expected value no one stores, which changes
        nothing and answers what the key holds."""
        return self.batch([("read", key) for key in keys])

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key exists; ``DistTimeout`` naming the missing ones."""
        raw = self._keys(keys)
        timeout_s = self._timeout_seconds() if timeout is None else to_seconds(timeout)
        if not raw:
            return
        missing = raw

        def step(seconds: float) -> bool:
            nonlocal missing
            missing = self._wait(missing, seconds)
            return not missing
        self._blocking(step, timeout_s)
        if missing:
            names = [m.decode("utf-8", "replace") for m in missing]
            raise DistTimeout(
                f"store wait on {self._describe()} timed out after {_fmt_seconds(timeout_s)}: "
                f"{len(names)} of {len(raw)} keys still missing: {names!r}. The processes "
                f"that should set them may have crashed or be stuck."
            )

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists, without waiting."""
        raw = self._keys(keys)
        return self._check(raw) if raw else True

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""
        return self._delete_key(self._key(key))

    def num_keys(self) -> int:
        """How many keys the store holds (reserved bookkeeping keys excluded)."""
        return self._num_keys()

    def close(self) -> None:  # noqa: B027 - optional to override, not abstract
        """Release connections/files; the base store holds none."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
