"""Helpers for testing distributed programs: N real ranks with hard timeouts.

``run_ranks(fn, n)`` starts n processes, initializes rankwise in each over loopback,
runs ``fn(rank, world_size, *args)`` and returns one ``RankResult`` per rank — the
return value, or the exception's type, message and traceback. A run that overruns its
timeout dumps every child's stack (faulthandler), kills them all and raises, so no test
can hang.
"""

from ._procs import RankResult, free_port, run_ranks

__all__ = ["RankResult", "free_port", "run_ranks"]
