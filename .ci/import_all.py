"""Import every rankwise module: the smoke test CI runs on the oldest supported Python.

Modules that need an optional extra (torch, matplotlib, mpi4py) that is not installed
are skipped by name; any other import error fails.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

OPTIONAL = {"torch", "matplotlib", "mpi4py"}


def main() -> int:
    import rankwise

    failed, skipped, done = [], [], 0
    for info in pkgutil.walk_packages(rankwise.__path__, "rankwise."):
        if info.name.endswith(".__main__"):  # runs the CLI when imported
            continue
        try:
            importlib.import_module(info.name)
            done += 1
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] in OPTIONAL:
                skipped.append(f"{info.name} (needs {exc.name})")
            else:
                failed.append(f"{info.name}: {exc!r}")
        except Exception as exc:  # noqa: BLE001 - report every module that fails
            failed.append(f"{info.name}: {exc!r}")
    version = ".".join(map(str, sys.version_info[:3]))
    print(f"Python {version}: imported {done} rankwise modules, skipped {len(skipped)}"
          f"{' (' + ', '.join(skipped) + ')' if skipped else ''}")
    for line in failed:
        print(f"FAILED {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
