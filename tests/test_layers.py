"""``.ci/layers.py``: the layer order docs/design.md states is the one the imports keep."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _layers() -> Any:
    spec = importlib.util.spec_from_file_location("ci_layers", ROOT / ".ci" / "layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tree_keeps_the_design_order(capsys: Any) -> None:
    assert _layers().main(ROOT) == 0, capsys.readouterr().out


@pytest.mark.parametrize(("where", "line", "says"), [
    ("wire/frames.py", "from ..api import init", "wire (layer 7) imports api (layer 2)"),
    # launch imports store already: store importing launch closes a loop in one layer
    ("store/base.py", "from ..launch import env", "import cycle between"),
    ("newpart.py", "", "src/rankwise/newpart: in no layer"),
])
def test_an_upward_import_a_cycle_or_an_unplaced_module_fails(
        where: str, line: str, says: str, tmp_path: Path, capsys: Any) -> None:
    shutil.copytree(ROOT / "src", tmp_path / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "design.md", tmp_path / "docs" / "design.md")
    target = tmp_path / "src" / "rankwise" / where
    target.write_text((target.read_text() if target.exists() else "") + line + "\n")
    assert _layers().main(tmp_path) == 1
    assert says in capsys.readouterr().out
