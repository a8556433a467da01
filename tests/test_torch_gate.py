"""Issue 28: a torch outside the supported range is refused with one line naming it."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from _procs import SRC, run

from rankwise.torch_gate import SUPPORTED, check_torch, supported


@pytest.mark.parametrize("version,ok", [
    ("2.11.0+cu130", True), ("2.12.1", True), ("2.13.0", True), ("2.13.0a0+git1234", True),
    ("2.14.1+cu130", True), ("2.15.0", True), ("2.10.2", False), ("2.16.0", False),
    ("3.0.0", False),
    ("1.13.1", False),
    ("garbage", False),
])
def test_the_range(version: str, ok: bool) -> None:
    assert supported(version) is ok


def test_refused_with_one_line_naming_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANKWISE_TORCH_ANY", raising=False)
    with pytest.raises(ImportError) as info:
        check_torch(SimpleNamespace(__version__="2.9.1"))
    message = str(info.value)
    assert "\n" not in message and SUPPORTED in message and "2.9.1" in message
    check_torch(SimpleNamespace(__version__="2.11.0+cu130"))
    monkeypatch.setenv("RANKWISE_TORCH_ANY", "1")
    check_torch(SimpleNamespace(__version__="2.9.1"))


def test_pyproject_states_the_same_range() -> None:
    from pathlib import Path

    text = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert f'torch = ["torch{SUPPORTED}"]' in text


@pytest.mark.procs
def test_importing_the_torch_parts_under_an_old_torch_fails_at_import() -> None:
    """``rankwise.nn`` imported with a torch that says it is 2.9: the gate's line."""
    pytest.importorskip("torch")
    code = ("import torch; torch.__version__ = '2.9.0'\n"
            "try:\n    import rankwise.nn\nexcept ImportError as e:\n    print('REFUSED', e)\n")
    out = run([sys.executable, "-c", code], timeout=120,
              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": SRC})
    assert out.stdout.startswith("REFUSED rankwise supports torch " + SUPPORTED), \
        out.stdout + out.stderr
