"""``rankwise analyze`` on torch flight-recorder dumps (issue 38).

Real dumps from a plain 2-rank gloo job broken in the test (rank 0 all_reduce, rank 1
broadcast), a checked-in NCCL dump built in torch's format
(``data/make_flight_recorder_nccl.py``), and the restricted unpickler refusing code.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
from _procs import ROOT, free_port, start, wait_all

from rankwise.diagnosis.analyze import analyze
from rankwise.diagnosis.flight import NotAFlightDump, load_flight_dumps, read_flight_dump

NCCL_DIR = str(ROOT / "tests" / "data" / "flight_recorder_nccl")


@pytest.fixture(scope="module")
def gloo_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("fr")
    port = str(free_port())
    prog = str(ROOT / "tests" / "_flight_recorder_program.py")
    procs = [start([sys.executable, prog, str(r), port, str(out)]) for r in range(2)]
    results = wait_all(procs, timeout=90)
    assert [rc for rc, _, _ in results] == [0, 0], results
    return out


@pytest.mark.procs
@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("form", ["pickle", "json"])
def test_plain_gloo_divergence_named(gloo_dumps: Path, form: str) -> None:
    text = analyze(str(gloo_dumps / form))
    line = next(ln for ln in text.splitlines() if "collective #3" in ln)
    assert "group default_pg (ranks 0, 1), collective #3" in line
    assert "rank 0 called all_reduce(sizes [[4]], dtypes ['Float'])" in line
    assert "rank 1 called broadcast(sizes [[4]], dtypes ['Double'])" in line
    assert "the op and dtypes disagree" in line
    assert "in #3 all_reduce" in text and "in #3 broadcast" in text
    if form == "pickle":  # only the pickle carries stacks: the user's line is named
        rank0, rank1 = _line_of("        dist.all_reduce(t)"), _line_of("        dist.broadcast(")
        assert f"_flight_recorder_program.py:{rank0}" in line
        assert f"_flight_recorder_program.py:{rank1}" in line
        assert f"_flight_recorder_program.py:{rank1} in <module>" in text


def _line_of(start: str) -> int:
    """The line of the flight-recorder program that starts with ``start`` (once)."""
    lines = (ROOT / "tests" / "_flight_recorder_program.py").read_text().splitlines()
    found = [i for i, ln in enumerate(lines, 1) if ln.startswith(start)]
    assert len(found) == 1, found
    return found[0]


def test_nccl_dump_missing_rank_and_states() -> None:
    text = analyze(NCCL_DIR)
    assert "3 of 3 ranks left a dump (format 2.10, nccl calls)" in text
    assert ("group default_pg (ranks 0-2), collective #3: ranks 0, 1 called all_reduce("
            "sizes [[1024]], dtypes ['Float']) at /job/train.py:40; rank 2 never reached it "
            "(stopped at #2).") in text
    assert "group sub:1,2 (ranks 1, 2), collective #1: rank 2 called barrier" in text
    assert "rank 1 recorded no call in this group" in text
    assert ("rank 0, group default_pg: in #3 all_reduce(sizes [[1024]], dtypes ['Float']) at "
            "/job/train.py:40, state 'started'") in text
    assert "last completed #2 all_reduce" in text
    assert "rank 2, group default_pg: idle after #2" in text
    assert "/job/train.py:57 in train_step" in text


def test_nccl_dump_one_rank_file_gone(tmp_path: Path) -> None:
    for r in (0, 2):
        name = f"nccl_trace_rank_{r}"
        (tmp_path / name).write_bytes(Path(NCCL_DIR, name).read_bytes())
    text = analyze(str(tmp_path))
    assert "2 of 3 ranks left a dump" in text and "no dump from rank 1" in text
    assert "rank 1: unknown (no dump)" in text


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch pwned",))


def test_pickle_with_code_is_refused_without_running_it(tmp_path: Path) -> None:
    evil = tmp_path / "nccl_trace_rank_0"
    evil.write_bytes(pickle.dumps({"version": "2.10", "entries": [], "x": _Boom()}))
    with pytest.raises(NotAFlightDump, match="refused .*system"):
        read_flight_dump(str(evil))
    assert load_flight_dumps(str(tmp_path)) == {}
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
    assert "no torch flight-recorder dumps" in analyze(str(tmp_path))


def test_other_files_are_not_dumps(tmp_path: Path) -> None:
    (tmp_path / "notes1").write_text("hello")
    (tmp_path / "data2").write_text('{"a": 1}')
    assert load_flight_dumps(str(tmp_path)) == {}
