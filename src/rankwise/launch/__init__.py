"""The launcher: ``rankwise run`` (CLI), ``spawn`` (Python API), cluster env detection.

Modules, one job each::

    cli         argument parsing (torchrun spellings)      job         one node's run: store, restarts, exit code
    agent       spawn / watch / tear down local workers    rendezvous  several launchers agree on one job via the store
    env         read (detect_env) and write worker env     worker      hooks inside a launched worker (error file, SIGTERM)
    summary     root cause + the one failure summary       output      [rank N] prefixing and log files
    spawn       torch.multiprocessing.spawn semantics
    torch_store torch's own store behind rankwise's port, for plain torch ranks
    error_files torch's @record error files, read into the summary
"""

from .env import ClusterEnv, detect_env, require_env
from .spawn import (
    ProcessContext,
    ProcessExitedException,
    ProcessRaisedException,
    spawn,
    start_processes,
)
from .worker import Terminated, install_worker_hooks

__all__ = [
    "ClusterEnv",
    "ProcessContext",
    "ProcessExitedException",
    "ProcessRaisedException",
    "Terminated",
    "detect_env",
    "install_worker_hooks",
    "require_env",
    "spawn",
    "start_processes",
]
