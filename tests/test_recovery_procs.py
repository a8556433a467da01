"""In-place recovery with real processes under ``rankwise run --on-failure=continue``:
a rank is lost, the survivors shrink and go on in the same processes, and (``--respawn``)
a replacement joins with ``grow``. The agreement itself: ``test_recovery.py``."""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path

import _procs
import pytest

EXAMPLE = str(_procs.ROOT / "examples" / "recovery_ddp.py")

#: a rank that exits with an error after init; the other shrinks to a world of one
LOSE_ONE = textwrap.dedent("""
    import os, sys
    import rankwise
    rankwise.init_process_group("gloo", timeout=60)
    pid = os.getpid()
    if rankwise.get_rank() == 1:
        sys.exit(7)
    try:
        rankwise.barrier()
    except rankwise.PeerFailure as exc:
        m = rankwise.shrink(timeout=20)
        x = [0]
        rankwise.all_gather_object(x, os.getpid())
        print(f"shrunk: rank {m.rank} of {m.world_size}, lost {list(m.lost)}, "
              f"same process {x[0] == pid}", flush=True)
    rankwise.destroy_process_group()
""")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=_procs.SRC, **extra)
    env.pop("RANKWISE_TRANSPORT", None)
    return env


@pytest.mark.procs
def test_continue_keeps_the_survivor_running_and_exits_3(tmp_path: Path) -> None:
    script = tmp_path / "lose_one.py"
    script.write_text(LOSE_ONE)
    done = _procs.run([sys.executable, "-m", "rankwise", "run", "-n", "2",
                       "--on-failure=continue", str(script)], timeout=90, env=_env())
    text = done.stdout + done.stderr
    assert done.returncode == 3, text
    assert "shrunk: rank 0 of 1, lost [1], same process True" in text
    assert "rank 1 exit code 7" in text and "the other ranks go on" in text
    assert "exit status 3 (ranks were lost; the others finished)" in text


def _resumed_within(text: str) -> list[float]:
    """Seconds from the victim's SIGKILL to each survivor's resumption (its printed t=)."""
    killed = float(re.search(r"SIGKILL to itself .*\(t=([0-9.]+)\)", text).group(1))  # type: ignore[union-attr]
    return [float(t) - killed for t in re.findall(r"resumed at step \d+ .*\(t=([0-9.]+)\)", text)]


@pytest.mark.procs
@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("transport,grow", [("tcp", False), ("shm", True)])
def test_ddp_loses_a_rank_and_finishes_in_the_same_processes(transport: str,
                                                             grow: bool) -> None:
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "rankwise", "run", "-n", "4", "--on-failure=continue"]
    cmd += ["--respawn", "1"] if grow else []
    cmd += [EXAMPLE, "--steps", "16", "--kill-at", "10"] + (["--grow"] if grow else [])
    done = _procs.run(cmd, timeout=240, env=_env(RANKWISE_TRANSPORT=transport))
    text = done.stdout + done.stderr
    assert done.returncode == 3, text[-4000:]
    waits = _resumed_within(text)
    assert len(waits) == 3 and max(waits) < 5.0, (waits, text[-4000:])
    assert "restarting" not in text  # no process was restarted: the survivors went on
    size = 4 if grow else 3
    assert f"PASS: parameters identical on {size} ranks after 16 steps (world size {size}" \
        in text, text[-4000:]
    if grow:
        assert re.search(r"joined the running job at step \d+ \(4 ranks\)", text)


@pytest.mark.procs
@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("grow", [False, True])
def test_torchs_own_ddp_loses_a_rank_and_finishes_in_the_same_processes(grow: bool) -> None:
    """torch's DDP over backend "rankwise" (``--torch-ddp``): the survivors catch what
    torch's reducer made of the PeerFailure (``rankwise.unwrap``), ``shrink`` makes torch's
    default group again over them, and the 2 train on with identical parameters; with
    ``grow``, the replacement joins torch's group of 3 as well."""
    pytest.importorskip("torch.distributed")
    cmd = [sys.executable, "-m", "rankwise", "run", "-n", "3", "--on-failure=continue"]
    cmd += ["--respawn", "1"] if grow else []
    cmd += [EXAMPLE, "--torch-ddp", "--steps", "16", "--kill-at", "8"]
    cmd += ["--grow"] if grow else []
    done = _procs.run(cmd, timeout=240, env=_env())
    text = done.stdout + done.stderr
    assert done.returncode == 3, text[-4000:]
    waits = _resumed_within(text)
    print(f"kill -> resumed: {', '.join(f'{s:.2f}s' for s in waits)}")  # docs/recovery.md
    assert len(waits) == 2 and max(waits) < 5.0, (waits, text[-4000:])
    assert text.count("lost ranks [2] (PeerFailure); resumed at step 8") == 2, text[-4000:]
    assert "restarting" not in text
    # 8 steps more (at 2 ranks, or 3 once the replacement joined), torch's group the same
    size = 3 if grow else 2
    assert f"PASS: parameters identical on {size} ranks after 16 steps (world size {size}, " \
        f"torch's {size}," in text, text[-4000:]
