"""Seed 003's programs print exactly what the seed's comments promise, at 2 and 4 ranks.

Each program runs once as the seed runs it (``python examples/p2p.py``: 2 ranks,
``python examples/collectives.py``: 4 ranks; its own spawned processes, tcp:// init) and
once at 4 ranks under ``rankwise run`` (env:// init). The ranks' code is the same ``run``
either way, so p2p at 4 and collectives at 2 on the spawn path added nothing but ~17 s of
spawned interpreters importing torch; the rank counts differ between the two inits.

Why parse per rank: the ranks print concurrently into one pipe, so lines from different
processes interleave (a header can even end up glued to another rank's line). One
process's own writes stay in order, though, so each rank's sequence of
``Rank  i  has data  X`` values is compared with the sequence the seed promises for it.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import _procs
import pytest

ROOT = Path(__file__).resolve().parent.parent
#: one printed value: a tensor repr, a list of them (gather / all_gather), or a formatted
#: scalar (p2p prints ``f"{tensor[0]}"``, which formats as ``1.0``)
_LINE = re.compile(r"Rank  (\d+)  has data  "
                   r"(\[(?:tensor\(\[[^\]]*\]\)(?:, )?)*\]|tensor\([^)]*\)|-?\d+\.\d+)")
_ANY = object()  #: a value the seed makes no promise about


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RANK", None)  # the examples take RANK as "started by a launcher"
    env.pop("MASTER_PORT", None)
    return env


def _run(args: list[str], timeout: float = 120) -> str:
    proc = _procs.run([sys.executable, *args], cwd=ROOT, env=_env(), timeout=timeout)
    assert proc.returncode == 0, (f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout}\n"
                                  f"stderr:\n{proc.stderr[-4000:]}")
    return proc.stdout


def _per_rank(out: str) -> dict[int, list[str]]:
    values: dict[int, list[str]] = {}
    for m in _LINE.finditer(out):
        values.setdefault(int(m.group(1)), []).append(m.group(2))
    return values


def _check(out: str, want: dict[int, list[object]]) -> None:
    got = _per_rank(out)
    assert sorted(got) == sorted(want), f"ranks that printed: {sorted(got)}\n{out}"
    for rank, expected in want.items():
        seq = got[rank]
        assert len(seq) == len(expected) and all(
            e is _ANY or s == e for s, e in zip(seq, expected)), \
            f"rank {rank} printed {seq}, the seed promises {expected}\nfull output:\n{out}"


def _p2p_expected(n: int) -> dict[int, list[object]]:
    return {r: ["1.0", "1.0"] for r in range(n)}  # sync, then async: every rank 1.


def _collectives_expected(n: int) -> dict[int, list[object]]:
    """The run order is reduce, all_reduce, gather, all_gather, broadcast, scatter."""
    ones = "[" + ", ".join(["tensor([1.])"] * n) + "]"
    want: dict[int, list[object]] = {}
    for r in range(n):
        seq: list[object] = [f"tensor([{n}.])" if r == 0 else _ANY,  # reduce: rank 0 has n
                             f"tensor([{n}.])"]  # all_reduce: every rank n
        if r == 0:
            seq.append(ones)  # gather: rank 0 [1, 1, ...]
        seq += [ones,  # all_gather: every rank [1, 1, ...]
                "tensor([2.])",  # broadcast: every rank 2
                f"tensor([{r + 1}.])"]  # scatter: rank i has i+1
        want[r] = seq
    return want


@pytest.mark.parametrize("n", [2])
@pytest.mark.procs
def test_p2p_example(n: int) -> None:
    _check(_run(["examples/p2p.py", str(n)]), _p2p_expected(n))


@pytest.mark.parametrize("n", [4])
@pytest.mark.procs
def test_collectives_example(n: int) -> None:
    _check(_run(["examples/collectives.py", str(n)]), _collectives_expected(n))


@pytest.mark.parametrize("script,expected", [("examples/collectives.py", _collectives_expected),
                                             ("examples/p2p.py", _p2p_expected)])
@pytest.mark.procs
def test_examples_under_launcher(script: str, expected: object) -> None:
    out = _run(["-m", "rankwise", "run", "-n", "4", script])
    _check(out, expected(4))  # type: ignore[operator]


def test_parser_sees_interleaved_lines() -> None:
    """The parser finds a value even when another rank's header is glued to it."""
    text = ("Rank  2  has data  tensor([2.])******test_broadcast******\n"
            "Rank  0  has data  [tensor([1.]), tensor([1.])]\n")
    assert _per_rank(text) == {2: ["tensor([2.])"], 0: ["[tensor([1.]), tensor([1.])]"]}


#: a short run of seed 001's training example (1 epoch, 4 steps per rank, a check every 2)
_DDP_SHORT = ["--samples", "64", "--image", "8", "--batch", "8", "--epochs", "1",
              "--check-every", "2"]


def _ddp_train_passes(out: str, world: int, engines: str) -> None:
    """What the example promises: every parameter check passes, and the final line says
    the parameters are identical on every rank, moved by the engine asked for."""
    checks = re.findall(r"parameter check: (PASS|FAIL)", out)
    assert checks and set(checks) == {"PASS"}, out
    assert re.search(f"data moved by ({engines})$", out, re.MULTILINE), out
    assert f"RESULT: PASS: parameters identical on all {world} ranks" in out, out


@pytest.mark.torch
@pytest.mark.timeout(240)
@pytest.mark.parametrize("choice,moved_by", [("rankwise", "tcp|shm"),
                                              ("torch-gloo", "torch-gloo")])
@pytest.mark.procs
def test_ddp_train_example_keeps_replicas_identical(choice: str, moved_by: str) -> None:
    pytest.importorskip("torch")
    out = _run(["-m", "rankwise", "run", "-n", "2", "examples/ddp_train.py", *_DDP_SHORT,
                "--engine", choice], timeout=200)
    _ddp_train_passes(out, 2, moved_by)


@pytest.mark.cuda
@pytest.mark.procs
@pytest.mark.timeout(300)
def test_ddp_train_example_on_cuda() -> None:
    """Issue 13's acceptance: ``--device cuda`` under ``rankwise run``, one rank per GPU
    on NCCL (two ranks share GPU 0 on a one-GPU machine: the example then picks gloo,
    which stages CUDA tensors through the host), replicas identical."""
    out = _run(["-m", "rankwise", "run", "-n", "2", "examples/ddp_train.py", *_DDP_SHORT,
                "--device", "cuda"], timeout=280)
    _ddp_train_passes(out, 2, "tcp|shm|nccl")
