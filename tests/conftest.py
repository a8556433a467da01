"""Make ``src/`` importable when the package is not installed (a plain checkout)."""

import os
import sys

_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)
os.environ["PYTHONPATH"] = _SRC + os.pathsep + os.environ.get("PYTHONPATH", "")


import pytest

#: the engines every engine-parametrized suite runs on (``pytestmark =
#: pytest.mark.usefixtures("engine")`` in a module)
ENGINES = ("tcp", "shm", "torch-gloo")


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test once per engine: child processes inherit ``RANKWISE_ENGINE``, and
    ``shm`` is forced (an error, not a silent fallback to tcp, if it cannot be used)."""
    monkeypatch.setenv("RANKWISE_ENGINE", request.param)
    return str(request.param)
