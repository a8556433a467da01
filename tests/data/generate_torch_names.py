"""Regenerate ``torch_distributed_names.json``: every public name of torch.distributed.

Run with torch installed: ``python tests/data/generate_torch_names.py``. The test that
reads the file (``tests/test_torch_names.py``) runs without torch. Names torch.distributed
merely imports (``sys``, ``timedelta``, ``torch``, its logger ...) are left out: they are
not part of its API.
"""

from __future__ import annotations

import json
import logging
import pathlib
import types

import torch
import torch.distributed as dist


def _kind(value: object) -> str | None:
    """The name's kind, or None when it is something torch.distributed only imported."""
    if isinstance(value, types.ModuleType):
        return "module" if value.__name__.startswith("torch.distributed.") else None
    if isinstance(value, logging.Logger):
        return None
    module = getattr(value, "__module__", None) or type(value).__module__
    if not str(module).startswith("torch"):
        return None
    if isinstance(value, type):
        return "class"
    return "function" if callable(value) else "value"


def main() -> None:
    names = {}
    for name in sorted(dir(dist)):
        if name.startswith("_"):
            continue
        kind = _kind(getattr(dist, name))
        if kind is not None:
            names[name] = kind
    out = pathlib.Path(__file__).with_name("torch_distributed_names.json")
    doc = {"torch_version": torch.__version__, "names": names}
    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"{len(names)} names of torch {torch.__version__} -> {out}")


if __name__ == "__main__":
    main()
