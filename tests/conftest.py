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
ENGINES = ("tcp", "shm")
#: added by ``pytest.mark.torch_engines`` only to the suites issue 13 names (differential,
#: misuse, diagnosis catalogue): each torch-gloo case pays torch's import and a torch
#: group per process, too much to spend on every suite in CI
TORCH_ENGINES = ("torch-gloo",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped, saying why, where torch sees no CUDA device
    (``pytest -m cuda`` runs exactly them on a GPU machine)."""
    gpu = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not gpu:
        return
    from rankwise.engines.select import cuda_missing

    why = cuda_missing()
    if why is not None:
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=f"needs CUDA: {why}"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine" not in metafunc.fixturenames:
        return
    params: list[object] = list(ENGINES)
    if metafunc.definition.get_closest_marker("torch_engines") is not None:
        params += [pytest.param(e, marks=pytest.mark.torch) for e in TORCH_ENGINES]
    metafunc.parametrize("engine", params, indirect=True)


@pytest.fixture
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test once per engine: child processes inherit ``RANKWISE_ENGINE``, and
    ``shm`` is forced (an error, not a silent fallback to tcp, if it cannot be used)."""
    if request.param in TORCH_ENGINES:
        pytest.importorskip("torch.distributed")
    monkeypatch.setenv("RANKWISE_ENGINE", request.param)
    return str(request.param)
