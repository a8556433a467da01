"""Make ``src/`` importable when the package is not installed (a plain checkout)."""

import os
import sys

_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)
os.environ["PYTHONPATH"] = _SRC + os.pathsep + os.environ.get("PYTHONPATH", "")


import pytest
from _procs import ProcsGuard, kill_started

#: the engines every engine-parametrized suite runs on (``pytestmark =
#: pytest.mark.usefixtures("engine")`` in a module)
ENGINES = ("tcp", "shm")
#: added by ``pytest.mark.torch_engines`` only to the suites issue 13 names (differential,
#: misuse, diagnosis catalogue): each torch-gloo case pays torch's import and a torch
#: group per process, too much to spend on every suite in CI
TORCH_ENGINES = ("torch-gloo",)
#: added by ``pytest.mark.tensor_paths`` (suites whose programs pass torch tensors): the
#: tensor path without a GPU (``RANKWISE_TENSOR_PATH``, see ``rankwise.wire.device``):
#: torch tensors go to the NCCL engine's class on torch's gloo, or are staged through
#: host copies onto rankwise's own engine, exactly as CUDA tensors would be
TENSOR_PATHS = {"nccl-stand-in": "device", "staged": "staged"}


_guard = ProcsGuard()


def _byte_compile() -> None:
    """Compile ``src/rankwise`` and the tests' own modules once per session, as a wheel
    install does (torch's and numpy's come compiled). Under ``PYTHONDONTWRITEBYTECODE=1``
    (this sandbox, CI included) an editable checkout has no ``.pyc`` files, so every rank,
    launcher and script the suite starts compiled rankwise's ~200 modules again: ~0.25
    CPU-s per process, thousands of processes per run (docs/scale.md, the same fix in
    ``benchmarks/scale.py``). ``compileall`` rewrites only stale files; an edited module
    is recompiled by the next session, and a stale ``.pyc`` is never used (its source's
    mtime and size are checked on import)."""
    import compileall

    tests = os.path.dirname(os.path.abspath(__file__))
    for folder in (os.path.join(_SRC, "rankwise"), tests):
        compileall.compile_dir(folder, quiet=2, workers=1)


def pytest_configure(config: pytest.Config) -> None:
    _guard.install()
    _byte_compile()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """While a test runs (setup to teardown), starting a process fails it unless it is
    marked ``procs``: the fast loop (``-m "not procs"``) cannot grow a slow test unseen."""
    _guard.enter(item.nodeid, item.get_closest_marker("procs") is not None)
    try:
        return (yield)
    finally:
        _guard.leave()


@pytest.fixture(autouse=True)
def _processes_bounded(request: pytest.FixtureRequest) -> object:
    """Fail a test that started a process without the ``procs`` mark (also when the start
    happened in a thread, or the test caught the error); after a ``procs`` test, kill
    what it started through ``_procs`` and left running (its own checks ran first)."""
    yield
    kill_started()
    starts = _guard.violations(request.node.nodeid)
    if starts:
        pytest.fail(f"started a process ({starts[0]}) without the `procs` mark: add "
                    "`pytestmark = pytest.mark.procs` to the file (or mark the test)",
                    pytrace=False)


#: test modules that face torch by name (their tests are marked ``torch``, see below)
TORCH_MODULES = ("test_torch_", "test_ddp", "test_sampler")


def _faces_torch(item: pytest.Item) -> bool:
    """A test of a torch-facing module: named so, or holding the torch module in its
    globals (``torch = pytest.importorskip("torch")``, ``import torch``)."""
    module = getattr(item, "module", None)
    if module is None:
        return False
    name = module.__name__.rpartition(".")[2]
    if name.startswith(TORCH_MODULES):
        return True
    found = vars(module).get("torch")
    return getattr(found, "__name__", None) == "torch"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every torch-facing test carries the ``torch`` marker (``-m torch`` runs them all:
    ``scripts/torch-matrix`` does, on each supported torch). Tests marked ``cuda`` are
    skipped, saying why, where torch sees no CUDA device (``pytest -m cuda`` runs exactly
    them on a GPU machine)."""
    for item in items:
        if item.get_closest_marker("torch") is None and _faces_torch(item):
            item.add_marker(pytest.mark.torch)
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
    if metafunc.definition.get_closest_marker("tensor_paths") is not None:
        params += [pytest.param(e, marks=pytest.mark.torch) for e in TENSOR_PATHS]
    metafunc.parametrize("engine", params, indirect=True)


@pytest.fixture
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test once per engine: child processes inherit ``RANKWISE_ENGINE``, and
    ``shm`` is forced (an error, not a silent fallback to tcp, if it cannot be used)."""
    if request.param in TORCH_ENGINES or request.param in TENSOR_PATHS:
        pytest.importorskip("torch.distributed")
    path = TENSOR_PATHS.get(request.param)
    if path is not None:
        monkeypatch.setenv("RANKWISE_TENSOR_PATH", path)
        monkeypatch.setenv("RANKWISE_ENGINE", "auto")
    else:
        monkeypatch.setenv("RANKWISE_ENGINE", request.param)
    return str(request.param)
