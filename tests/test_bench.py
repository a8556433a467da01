"""``rankwise bench``: the size grammar, misuse caught before any process starts, and one
tiny real run that yields the table, the raw JSON and (with matplotlib) the plot."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import _procs
import pytest

from rankwise.bench.run import available_engines, main, parse_sizes

K, M = 1 << 10, 1 << 20


def test_size_ranges_and_lists() -> None:
    assert parse_sizes("4..64M") == tuple(4 * 4**i for i in range(13))
    assert parse_sizes("4..64M")[-1] == 64 * M
    assert parse_sizes("4..32:2") == (4, 8, 16, 32)
    assert parse_sizes("4,1K,1M") == (4, K, M)
    assert parse_sizes("1M, 4 , 1KiB,4") == (4, K, M)
    assert parse_sizes("16..100") == (16, 64)  # a range never passes its upper end
    assert parse_sizes("4,1K..4K") == (4, K, 4 * K)


@pytest.mark.parametrize("text, says", [
    ("4..x", "'x' \\(in '4..x'\\) is not a size"),
    ("1Q", "'1Q' is not a size"),
    ("6", "multiples of 4"),
    ("0", "multiples of 4"),
    ("2G", "multiples of 4 from 4 to 1G"),
    ("1M..4", "runs backwards"),
    ("4..1K:1", "factor after ':'"),
    ("4..1K:two", "factor after ':'"),
    ("", "'' is not a size"),
])
def test_bad_sizes_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        parse_sizes(text)


@pytest.mark.parametrize("argv, says", [
    (["--sizes", "4..x"], "argument --sizes: 'x' (in '4..x') is not a size"),
    (["--ops", "all_reduce,allreduce"], "--ops: unknown allreduce"),
    (["-n", "1"], "at least 2 ranks"),
    (["--engines", "warp"], "--engines: warp not available"),
    (["--engines", "auto"], "--engines: auto not available"),
    (["--rounds", "0"], "--rounds"),
    (["--mpi"], "MPI needs the ranks started by mpirun"),
    (["--json", "/no/such/folder/x.json"], "folder /no/such/folder does not exist"),
])
def test_misuse_stops_before_any_process(argv: list[str], says: str,
                                         capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    started = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
    assert time.monotonic() - started < 5  # nothing was launched


def test_plot_without_matplotlib_names_the_extra(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwise.bench import run as bench

    monkeypatch.setattr(bench, "_has", lambda module: module != "matplotlib")
    with pytest.raises(SystemExit):
        main(["--plot", "x.png"])
    assert "pip install 'rankwise[plot]'" in capsys.readouterr().err


def test_without_torch_gloo_is_skipped_with_one_line(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwise.bench import run as bench

    monkeypatch.setattr(bench, "_has", lambda module: module != "torch")
    cfg = bench._check(bench._parser(), bench._parser().parse_args([]), worker=False)
    assert not cfg.gloo
    err = capsys.readouterr().err
    assert "torch is not installed: gloo columns skipped" in err


def test_sizes_print_readably() -> None:
    from rankwise.bench.report import human_size

    assert [human_size(x) for x in (4, K, 16 * M, 65532)] == ["4 B", "1 KiB", "16 MiB",
                                                              "~64 KiB"]


def test_ratios_far_below_one_keep_their_digits() -> None:
    # a shm engine 200x faster than gloo once printed "0.00", which reads as "no data"
    from rankwise.bench.report import _ratio_text

    for x in (0.0052, 0.00099, 2.5e-6, 0.15, 1.234, 37.0):
        text = _ratio_text(x)
        assert float(text) == pytest.approx(x, rel=0.06), text
    assert _ratio_text(0.0052) == "0.0052" and _ratio_text(0.15) == "0.15"


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.procs
def test_tiny_real_run(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    has_plot = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        has_plot = False
    raw, png = tmp_path / "raw.json", tmp_path / "bench.png"
    argv = ["-n", "2", "--ops", "all_reduce", "--sizes", "4,1K", "--rounds", "2",
            "--round-time", "0.02", "--no-mpi", "--json", str(raw)]
    if has_plot:
        argv += ["--plot", str(png)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK")}
    res = _procs.run([sys.executable, "-m", "rankwise", "bench", *argv], env=env, timeout=120,
                     cwd=None)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    engines = list(available_engines())  # one pass, and one column, per rankwise engine
    libs = [*engines, "gloo"]
    header = next(line for line in lines if line.startswith("op "))
    assert header.split() == ["op", "size", *(w for x in libs for w in (x, "us")),
                              *(w for x in libs for w in (x, "GB/s")),
                              *(w for x in libs for w in (x, "sys%")),
                              *(f"{e}/gloo" for e in engines)]
    rows = [line.split() for line in lines if line.startswith("all_reduce")]
    assert [r[1:3] for r in rows] == [["4", "B"], ["1", "KiB"]]
    for r in rows:  # latencies, bandwidths, kernel shares, then "ratio (low-high)"
        numbers = r[3:3 + 3 * len(libs)]
        assert all(float(x) >= 0 for x in numbers)
        assert all(float(x) <= 100 for x in numbers[2 * len(libs):])  # a share, in percent
        ratios = r[3 + 3 * len(libs):]
        for med, spread in zip(ratios[::2], ratios[1::2]):
            low, high = (float(x) for x in spread.strip("()").split("-"))
            assert float(med) > 0 and 0 < low <= high
    saved = json.loads(raw.read_text())
    assert saved["format"] == "rankwise-bench/1"
    (run,) = saved["runs"]
    assert run["world_size"] == 2 and [p["engine"] for p in run["passes"]] == engines
    for p in run["passes"]:  # each pass times gloo again: its ratios pair rounds of one pass
        cells = p["cells"]
        assert [(c["op"], c["bytes"]) for c in cells] == [("all_reduce", 4), ("all_reduce", K)]
        assert all(len(c["seconds"][lib]) == 2 for c in cells
                   for lib in (f"rankwise-{p['engine']}", "gloo"))
        assert all(0.0 <= c["kernel"][lib] <= 1.0 for c in cells
                   for lib in (f"rankwise-{p['engine']}", "gloo"))
    if has_plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # the saved numbers render again, without a run
        again = _procs.run([sys.executable, "-m", "rankwise", "bench", "--from-json",
                            str(raw)], timeout=60, cwd=None)
        assert again.returncode == 0 and header in again.stdout
