"""What ``rankwise run`` does when a foreign client knocks on its store.

A script that never imports rankwise and calls ``torch.distributed.init_process_group``
with ``env://`` connects torch's ``TCPStore`` client to the launcher's store, fails the
handshake and retries for 30 minutes. The store recognises the knock
(``rankwise.store.foreign``); this decides what happens then, decided so:

- the first knock prints one line naming the fix, whoever knocked;
- the job ends at once (``LocalAgent.abort``: workers torn down, no restart, the
  summary names the cause) when the knock provably comes from a process of this job
  (``peer_process``), or when the job has no token (anyone can already change its
  rendezvous, so a knock ends nothing that was protected);
- a knock from a stranger on an authenticated job ends nothing: an unauthenticated
  connection must not be able to abort it. If a worker of this job knocks later, that
  knock still ends the job. (A worker on another node that alone runs a torch-only
  script is not provably this job's: its node's own ranks then hit their timeout.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..store.foreign import ForeignKnock
from .agent import LocalAgent
from .peer_process import job_holds_connection

__all__ = ["ForeignAlarm"]


class ForeignAlarm:
    """The store's ``on_foreign`` listener for one job. ``agent`` and ``marker`` are set
    once the workers are about to start; before that, a knock can only be a stranger's."""

    def __init__(self, token: str | None, say: Callable[[str], None]) -> None:
        self._token = token
        self._say = say
        self._lock = threading.Lock()
        self._told = False
        self.agent: LocalAgent | None = None
        self.marker: str | None = None

    def __call__(self, knock: ForeignKnock) -> None:
        with self._lock:
            first, self._told = not self._told, True
        if first:
            self._say(f"rankwise run: {knock.what}")
        agent = self.agent
        if agent is not None and (self._token is None or self._from_this_job(knock)):
            agent.abort(knock.what)

    def _from_this_job(self, knock: ForeignKnock) -> bool:
        marker = self.marker
        return marker is not None and job_holds_connection(marker, knock.peer_port,
                                                           knock.store_port)
