"""The torch.distributed names rankwise does not offer, each with the reason.

``rankwise.<name>`` for one of these raises ``AttributeError`` (so ``hasattr`` and
``getattr(dist, name, None)`` keep working) whose message says why and what to use
instead, rather than Python's bare "has no attribute". (``algorithms`` and ``utils``
are rankwise subpackages of other content: the schedules, and ``utils.data``.) ``tests/data/`` holds every public
name of torch.distributed; a test checks each is either offered or listed here.
"""

from __future__ import annotations

__all__ = ["UNSUPPORTED", "unsupported_error"]

_OPTIONS = ("rankwise's ProcessGroup takes no per-call option objects; call the module "
            "functions (dist.all_reduce(t, op=..., group=pg))")
_INTERNAL = "it is a torch-internal module; rankwise has its own layout"
_DDP_INTERNAL = ("it is torch DDP's C++ machinery; rankwise.nn.DistributedDataParallel has "
                 "its own (register_comm_hook takes the same hooks)")
_DEBUG = ("rankwise's checks (call fingerprints, who-is-where, deadlock reports) are always "
          "on; there is no debug level to change (RANKWISE_DIAGNOSIS=0 turns call sites off)")
_MESH = ("DeviceMesh belongs to torch's DTensor stack; run it on torch.distributed with "
         "rankwise registered as its backend")
_COALESCED = "it is deprecated in torch; call the collective once per tensor, or on one " \
             "flattened tensor"
_TYPING = "it is a typing alias of torch's internals; use int (ranks) or str (group names)"
_RENDEZVOUS = ("rankwise's init_method understands env://, tcp://host:port and file://path; "
               "custom rendezvous handlers are not pluggable")
_SHRINK = ("rankwise does not shrink a live group around failed ranks: a failure reaches "
           "every rank as PeerFailure; restart the job (`rankwise run --max-restarts N`)")

UNSUPPORTED: dict[str, str] = {
    "AllToAllOptions": _OPTIONS, "AllreduceCoalescedOptions": _OPTIONS,
    "AllreduceOptions": _OPTIONS, "BarrierOptions": _OPTIONS, "BroadcastOptions": _OPTIONS,
    "GatherOptions": _OPTIONS, "ReduceOptions": _OPTIONS, "ReduceScatterOptions": _OPTIONS,
    "ScatterOptions": _OPTIONS,
    "BackendConfig": "get_backend_config() returns its text form ('cpu:gloo'); no config "
                     "object is needed since every backend name maps to rankwise's engines",
    "BuiltinCommHookType": _DDP_INTERNAL, "Logger": _DDP_INTERNAL, "Reducer": _DDP_INTERNAL,
    "DebugLevel": _DEBUG, "get_debug_level": _DEBUG, "set_debug_level": _DEBUG,
    "set_debug_level_from_env": _DEBUG,
    "DeviceMesh": _MESH, "init_device_mesh": _MESH, "device_mesh": _MESH,
    "GroupName": _TYPING,
    "ProcessGroupGloo": "rankwise is its own backend: backend='gloo' selects rankwise's "
                        "engines, not torch's gloo; use rankwise.ProcessGroup",
    "QueueEmptyError": "rankwise's stores have no queue operations (queue_push/queue_pop)",
    "all_gather_coalesced": _COALESCED, "all_reduce_coalesced": _COALESCED,
    "shrink_group": _SHRINK, "split_group": "use new_group or new_subgroups (every rank "
                                               "calls them in the same order)",
    "breakpoint": "`rankwise run` does not forward stdin to the ranks, so pdb on one rank "
                  "could not be driven; use RANKWISE_DUMP or rankwise.who_is_where()",
    "register_rendezvous_handler": _RENDEZVOUS, "rendezvous": _RENDEZVOUS,
    "rpc": "rankwise implements collectives and point-to-point messages, not torch RPC",
    "autograd": "distributed autograd belongs to torch RPC, which rankwise does not implement",
    "remote_device": "it belongs to torch RPC, which rankwise does not implement",
    "c10d_logger": _INTERNAL, "config": _INTERNAL, "constants": _INTERNAL,
    "distributed_c10d": _INTERNAL, "logging_handlers": _INTERNAL,
}


def unsupported_error(name: str) -> AttributeError | None:
    """The error for ``rankwise.<name>`` when torch.distributed has it and rankwise does not."""
    reason = UNSUPPORTED.get(name)
    if reason is None:
        return None
    return AttributeError(f"torch.distributed.{name} is not supported by rankwise because "
                          f"{reason}")
