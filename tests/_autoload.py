"""rankwise's ``torch.backends`` entry point for the processes a test starts.

The tests run a checkout's ``src`` from PYTHONPATH, whose entry points no installed
dist-info declares (an editable install declares those of the tree it was made from), so
``import torch`` would not call ``rankwise_autoload.install``. This writes a dist-info that
declares it; where rankwise is installed with it too, torch calls ``install`` twice, which
changes nothing the second time.
"""

from __future__ import annotations

import os
from pathlib import Path

from launch_scripts.helpers import env

__all__ = ["autoload_env"]


def autoload_env(tmp: Path, checks: str | None = None) -> dict[str, str]:
    """The launcher tests' environment, with the entry point on PYTHONPATH and
    ``RANKWISE_TORCH_CHECKS`` set to ``checks`` (unset when None)."""
    info = tmp / "site" / "rankwise_autoload_tests-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rankwise-autoload-tests\n"
                                   "Version: 0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\n"
                                           "rankwise = rankwise_autoload:install\n")
    e = env()
    e["PYTHONPATH"] = os.pathsep.join(p for p in (e["PYTHONPATH"], str(tmp / "site")) if p)
    e.pop("RANKWISE_TORCH_CHECKS", None)
    if checks is not None:
        e["RANKWISE_TORCH_CHECKS"] = checks
    return e
