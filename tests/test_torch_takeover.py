"""The switch of issue 47 in-process: ``RANKWISE_TORCH_CHECKS`` read in one place, which
requests become backend "rankwise" over what engine, torch's functions wrapped only when
the switch is on, and `rankwise run --checks`."""

from __future__ import annotations

import pytest

import rankwise_autoload
from rankwise.cli import parse_run_args

pytestmark = pytest.mark.torch
tdist = pytest.importorskip("torch.distributed")


@pytest.mark.parametrize(("value", "mode"), [(None, "off"), ("", "off"), ("OFF", "off"),
                                             ("cpu", "cpu"), (" on ", "on")])
def test_the_switch_reads_one_variable(value: str | None, mode: str) -> None:
    environ = {} if value is None else {"RANKWISE_TORCH_CHECKS": value}
    assert rankwise_autoload.mode(environ) == mode


def test_a_bad_value_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"RANKWISE_TORCH_CHECKS='yes' is not one of "
                                         r"off, cpu, on"):
        rankwise_autoload.mode({"RANKWISE_TORCH_CHECKS": "yes"})


@pytest.mark.parametrize(("backend", "checks", "cuda", "expected"), [
    ("gloo", "cpu", False, "cpu:torch-gloo"),
    ("gloo", "cpu", True, "cpu:torch-gloo"),
    (None, "cpu", False, "cpu:torch-gloo"),
    ("cpu:gloo", "cpu", True, "cpu:torch-gloo"),
    ("GLOO", "on", False, "cpu:torch-gloo"),
    # NCCL: checked with `on` only (not yet verified on a GPU)
    (None, "cpu", True, None),
    ("nccl", "cpu", True, None),
    ("cpu:gloo,cuda:nccl", "cpu", True, None),
    ("nccl", "on", True, "cpu:torch-gloo,cuda:nccl"),
    ("cpu:gloo,cuda:nccl", "on", True, "cpu:torch-gloo,cuda:nccl"),
    (None, "on", True, "cpu:torch-gloo,cuda:nccl"),
    # always as asked
    ("gloo", "off", False, None),
    ("rankwise", "on", False, None),
    ("mpi", "on", False, None),
    ("ucc", "cpu", False, None),
    ("cpu:gloo,cpu:gloo", "on", False, None),
    ("cuda:gloo", "on", True, None),
])
def test_which_requests_are_taken_over(backend: str | None, checks: str, cuda: bool,
                                       expected: str | None) -> None:
    from rankwise.torch.takeover import underneath

    assert underneath(backend, checks, cuda) == expected


def _originals(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """torch's functions, put back after the test whatever install() did."""
    c10d = tdist.distributed_c10d
    got = {}
    for name in ("init_process_group", "new_group"):
        got[name] = getattr(c10d, name)
        monkeypatch.setattr(c10d, name, got[name])
        monkeypatch.setattr(tdist, name, got[name])
    return got


def test_install_does_nothing_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _originals(monkeypatch)
    monkeypatch.delenv("RANKWISE_TORCH_CHECKS", raising=False)
    rankwise_autoload.install()
    assert tdist.init_process_group is before["init_process_group"]
    assert tdist.new_group is before["new_group"]


def test_install_wraps_both_names_once(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _originals(monkeypatch)
    monkeypatch.setenv("RANKWISE_TORCH_CHECKS", "cpu")
    rankwise_autoload.install()
    rankwise_autoload.install()
    for name in ("init_process_group", "new_group"):
        wrapped = getattr(tdist, name)
        assert getattr(tdist.distributed_c10d, name) is wrapped
        assert wrapped.rankwise_takes_over is before[name]
        assert wrapped.__wrapped__ is before[name]  # torch's signature and docstring


@pytest.mark.parametrize(("argv", "environ", "checks"), [
    ([], None, "cpu"), (["--checks=off"], "on", "off"), (["--checks", "on"], None, "on"),
    ([], "off", "off"), ([], "on", "on"),
])
def test_rankwise_run_checks(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                             environ: str | None, checks: str) -> None:
    if environ is None:
        monkeypatch.delenv("RANKWISE_TORCH_CHECKS", raising=False)
    else:
        monkeypatch.setenv("RANKWISE_TORCH_CHECKS", environ)
    assert parse_run_args([*argv, "train.py"]).checks == checks


def test_rankwise_run_refuses_a_bad_switch(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANKWISE_TORCH_CHECKS", "all")
    with pytest.raises(SystemExit):
        parse_run_args(["train.py"])
    assert "RANKWISE_TORCH_CHECKS='all' is not one of off, cpu, on" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_run_args(["--checks=cuda", "train.py"])


def test_a_torch_rankwise_refuses_is_left_alone_saying_why(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    calls: list[tuple[object, ...]] = []
    wrapped = rankwise_autoload._lazy("init_process_group", lambda *a, **k: calls.append(a))
    monkeypatch.setenv("RANKWISE_TORCH_CHECKS", "cpu")
    import rankwise.torch

    monkeypatch.setitem(sys.modules, "rankwise.torch.takeover", None)  # import fails
    monkeypatch.delattr(rankwise.torch, "takeover", raising=False)
    monkeypatch.setattr(rankwise_autoload, "_refused", [])
    wrapped("gloo")
    wrapped("gloo")
    assert calls == [("gloo",), ("gloo",)]
    err = capsys.readouterr().err
    assert err.count("rankwise: checks off (RANKWISE_TORCH_CHECKS=cpu), torch.distributed "
                     "runs as asked:") == 1, err
