"""``rankwise doctor``'s checks on a faked machine: each seeded environment fault is found
(what, evidence, fix), by the check that owns it and no other, and a healthy machine
gives no problem at all."""

from __future__ import annotations

import errno
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from _doctor_fakes import FakeGpus, FakeNet, GiB, healthy, in_use

from rankwise.doctor import Cpus, GpuProbes, Inputs, PortState, Severity, ShmSpace, run_checks
from rankwise.doctor.inputs import cgroup_cpu_limit, usable_cpus
from rankwise.doctor.network import ifname_matches
from rankwise.doctor.probes import bounded

JOB = {"RANK": "1", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
       "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29500", "RANKWISE_AGENT_STORE": "1",
       "RANKWISE_TOKEN": "t"}
MASTER = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
E, W = Severity.ERROR, Severity.WARNING

#: id -> (the faulty machine, the check that must name it, severity, words of "what")
FAULTS: dict[str, tuple[Callable[[], Inputs], str, Severity, str]] = {
    "cvd lists more GPUs than torch sees": (
        lambda: healthy(env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, gpus=FakeGpus(2, 4)),
        "gpu", E, "lists 4 GPU(s) but torch sees 2"),
    "cvd names a GPU that does not exist": (
        lambda: healthy(env={"CUDA_VISIBLE_DEVICES": "0,7"}, gpus=FakeGpus(1, 4)),
        "gpu", E, "names GPU 7, but this machine has 4"),
    "cvd lists a GPU twice": (
        lambda: healthy(env={"CUDA_VISIBLE_DEVICES": "1,1"}, gpus=FakeGpus(1, 4)),
        "gpu", E, "lists GPU 1 twice"),
    "cvd has a space-separated entry": (
        lambda: healthy(env={"CUDA_VISIBLE_DEVICES": "0 1"}, gpus=FakeGpus(0, 2)),
        "gpu", E, "invalid entry '0 1'"),
    "cvd per rank but cuda:LOCAL_RANK": (
        lambda: healthy(env={**JOB, "CUDA_VISIBLE_DEVICES": "1"}, gpus=FakeGpus(1, 4),
                        net=FakeNet(answers={29500: PortState.RANKWISE_STORE})),
        "gpu", E, "LOCAL_RANK=1 but this process sees 1 GPU(s)"),
    "two ranks on one GPU": (
        lambda: healthy(nproc=4, gpus=FakeGpus(2, 2)), "gpu", E, "two ranks would share"),
    "cvd set but torch has no CUDA": (
        lambda: healthy(env={"CUDA_VISIBLE_DEVICES": "0"}, gpus=FakeGpus(None, 2)),
        "gpu", W, "torch here cannot use CUDA"),
    "NCCL_SOCKET_IFNAME names a missing interface": (
        lambda: healthy(env={"NCCL_SOCKET_IFNAME": "ib0"}), "interfaces", E,
        "NCCL_SOCKET_IFNAME selects no interface"),
    "NCCL_SOCKET_IFNAME excludes every interface": (
        lambda: healthy(env={"NCCL_SOCKET_IFNAME": "^lo,eth"}), "interfaces", E,
        "selects no interface"),
    "GLOO_SOCKET_IFNAME is a prefix (gloo wants exact names)": (
        lambda: healthy(env={"GLOO_SOCKET_IFNAME": "eth"}), "interfaces", E,
        "GLOO_SOCKET_IFNAME selects no interface"),
    "interface variable on loopback across nodes": (
        lambda: healthy(env={**MASTER, "GLOO_SOCKET_IFNAME": "lo", "RANKWISE_TOKEN": "t"},
                        nnodes_option=2), "interfaces", E, "only loopback"),
    "MASTER_ADDR does not resolve": (
        lambda: healthy(env={"MASTER_ADDR": "nohost", "MASTER_PORT": "29500"}),
        "master", E, "MASTER_ADDR=nohost does not resolve"),
    "MASTER_ADDR resolution hangs": (
        lambda: healthy(env={"MASTER_ADDR": "slowdns", "MASTER_PORT": "29500"},
                        net=FakeNet(hosts={"slowdns": TimeoutError("resolving took >2s")})),
        "master", E, "does not resolve"),
    "MASTER_ADDR is loopback on several nodes": (
        lambda: healthy(env={"MASTER_ADDR": "localhost", "MASTER_PORT": "29500",
                             "RANKWISE_TOKEN": "t"}, nnodes_option=2),
        "master", E, "loopback address, but the job spans 2 nodes"),
    "hostname resolves to 127.0.1.1 on several nodes": (
        lambda: healthy(env={**MASTER, "RANKWISE_TOKEN": "t"}, nnodes_option=2,
                        hostname="box", net=FakeNet(hosts={"box": ["127.0.1.1"]})),
        "hostname", W, "resolves to the loopback address 127.0.1.1"),
    "MASTER_PORT taken by another program": (
        lambda: healthy(env=MASTER, net=FakeNet(bind=in_use(),
                                                answers={29500: PortState.OTHER_PROGRAM})),
        "port", E, "in use by another program"),
    "MASTER_PORT taken by a live rankwise store": (
        lambda: healthy(env=MASTER, net=FakeNet(bind=in_use(),
                                                answers={29500: PortState.RANKWISE_STORE})),
        "port", E, "in use by a live rankwise store"),
    "MASTER_ADDR is not an address of node 0": (
        lambda: healthy(env=MASTER, hosting=True,
                        net=FakeNet(bind={29500: errno.EADDRNOTAVAIL})),
        "port", E, "not an address of this machine"),
    "nothing listens on the master port, inside a job": (
        lambda: healthy(env=JOB), "port", E, "nothing listens on 10.0.0.9:29500"),
    "the master port drops packets": (
        lambda: healthy(env=JOB, net=FakeNet(answers={29500: PortState.NO_ANSWER})),
        "port", W, "cannot be reached"),
    "the store refuses this token": (
        lambda: healthy(env=JOB, net=FakeNet(answers={29500: PortState.TOKEN_DIFFERS})),
        "port", E, "refuses this environment's token"),
    "/dev/shm is Docker's 64 MiB": (
        lambda: healthy(shm=ShmSpace(64 << 20, 64 << 20)), "shm", W, "only 64 MiB"),
    "/dev/shm is full": (
        lambda: healthy(shm=ShmSpace(8 * GiB, 10 << 20)), "shm", W, "nearly full"),
    "open-file limit below the mesh's needs": (
        lambda: healthy(nofile=(256, 256), nproc=8, nnodes_option=16,
                        env={**MASTER, "RANKWISE_TOKEN": "t"}),
        "files", E, "open-file limit 256 is too low for 128 ranks"),
    "open-file limit low for DataLoader workers": (
        lambda: healthy(nofile=(1024, 4096), num_workers=2), "files", W,
        "low for DataLoader workers"),
    "more ranks than CPUs": (
        lambda: healthy(nproc=8, cpus=Cpus(4.0, "4 (fake)")), "cpus", W,
        "8 ranks share 4 usable CPU(s)"),
    "num_workers beyond the cores per rank": (
        lambda: healthy(nproc=4, num_workers=8), "cpus", W,
        "num_workers=8 on 4 rank(s): 36 busy processes for 16 CPU(s)"),
    "OMP_NUM_THREADS beyond the cores per rank": (
        lambda: healthy(nproc=4, env={"OMP_NUM_THREADS": "8"}), "cpus", W,
        "OMP_NUM_THREADS=8 on 4 rank(s)"),
    "several nodes without a token": (
        lambda: healthy(env=MASTER, nnodes_option=2), "token", W, "without a shared token"),
    "token file missing": (
        lambda: healthy(token_file="/nonexistent/rankwise-token"), "token", E,
        "cannot be read"),
    "torch newer than the range": (
        lambda: healthy(gpus=FakeGpus(torch="2.16.0")), "torch", E,
        "torch 2.16.0 is outside the range rankwise supports (>=2.11,<2.16)"),
    "torch older than the range, tried anyway": (
        lambda: healthy(env={"RANKWISE_TORCH_ANY": "1"}, gpus=FakeGpus(torch="2.10.2")),
        "torch", W, "torch 2.10.2 is outside the range"),
    "rank variables incomplete": (
        lambda: healthy(env={"RANK": "0"}), "job", E, "inconsistent"),
}


def _problems(inp: Inputs) -> list[tuple[str, Severity, str]]:
    return [(f.check, f.severity, f.what) for f in run_checks(inp) if f.problem]


def test_healthy_machine_has_no_problem() -> None:
    assert _problems(healthy()) == []
    assert _problems(healthy(env=MASTER, nproc=4, num_workers=3,
                             gpus=FakeGpus(4, 4))) == []
    # healthy variants of the faults: NCCL prefixes, gloo exact names, visible GPUs that
    # exist, one node on a 127.0.1.1 hostname
    assert _problems(healthy(env={"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "eth0",
                                  "CUDA_VISIBLE_DEVICES": "2,3"},
                             gpus=FakeGpus(2, 4), hostname="box",
                             net=FakeNet(hosts={"box": ["127.0.1.1"]}))) == []


@pytest.mark.parametrize("fault", list(FAULTS))
def test_seeded_fault_is_found(fault: str) -> None:
    make, check, severity, words = FAULTS[fault]
    findings = [f for f in run_checks(make()) if f.problem]
    assert findings, f"{fault}: no problem found"
    assert {f.check for f in findings} == {check}, f"{fault}: {findings}"
    hit = [f for f in findings if words in f.what]
    assert hit, f"{fault}: no finding says {words!r}: {[f.what for f in findings]}"
    assert hit[0].severity == severity
    assert hit[0].fix, f"{fault}: a finding without a fix"


def test_torch_in_range_or_absent_is_no_problem() -> None:
    for version in ("2.11.0+cu130", "2.15.0", None):
        assert _problems(healthy(gpus=FakeGpus(torch=version))) == [], version


def test_the_torch_probe_reads_the_installed_version() -> None:
    """Read from the package's metadata, so the doctor needs no ``import torch``."""
    torch = pytest.importorskip("torch")
    assert GpuProbes(import_torch=False).torch_version() == torch.__version__


def test_findings_show_evidence_and_fix() -> None:
    (f,) = [f for f in run_checks(healthy(env={"NCCL_SOCKET_IFNAME": "ib0"})) if f.problem]
    assert "interfaces here: lo, eth0" in f.evidence and "NCCL_SOCKET_IFNAME=eth0" in f.fix
    (f,) = [f for f in run_checks(healthy(nproc=4, num_workers=8)) if f.problem]
    assert "use num_workers=3" in f.fix  # 16 CPUs / 4 ranks - the rank itself
    (f,) = [f for f in run_checks(healthy(env={**JOB, "CUDA_VISIBLE_DEVICES": "1"},
                                          gpus=FakeGpus(1, 4), net=FakeNet(
                                              answers={29500: PortState.RANKWISE_STORE})))
            if f.problem]
    assert "use cuda:0" in f.fix


def test_token_file_permissions(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o644)
    (f,) = [f for f in run_checks(healthy(token_file=str(token))) if f.problem]
    assert f.severity == E and "readable by other users" in f.what and "0644" in f.evidence
    assert f"chmod 600 {token}" in f.fix
    token.chmod(0o600)
    assert _problems(healthy(env={"RANKWISE_TOKEN_FILE": str(token)})) == []
    token.write_text("")
    assert [w for _, _, w in _problems(healthy(token_file=str(token)))] == [
        f"the token file {token} is empty"]


def test_only_the_store_host_binds_the_port() -> None:
    # in a job whose launcher serves the store, a busy port is the store: probe, not bind
    net = FakeNet(bind=in_use(), answers={29500: PortState.RANKWISE_STORE})
    assert _problems(healthy(env=JOB, net=net)) == []
    assert net.probed == [("10.0.0.9", 29500)]
    # outside a job: a local MASTER_ADDR means this node will host it
    net = FakeNet(bind=in_use())
    assert [c for c, _, _ in _problems(healthy(env=MASTER, net=net))] == ["port"]


def test_a_broken_check_does_not_hide_the_others() -> None:
    class Broken(FakeGpus):
        def physical_count(self) -> int | None:
            raise RuntimeError("driver exploded")

    findings = run_checks(healthy(gpus=Broken(), env={"NCCL_SOCKET_IFNAME": "ib0"}))
    assert [(f.check, f.what) for f in findings if f.problem] == [
        ("gpu", "the gpu check could not run"),
        ("interfaces", "NCCL_SOCKET_IFNAME selects no interface of this host")]


def test_ifname_rules() -> None:
    ifs = ["lo", "eth0", "eth1", "ib0"]
    assert ifname_matches("eth", ifs, exact=False) == ["eth0", "eth1"]
    assert ifname_matches("=eth", ifs, exact=False) == []
    assert ifname_matches("^eth,lo", ifs, exact=False) == ["ib0"]
    assert ifname_matches("eth0,ib0", ifs, exact=True) == ["eth0", "ib0"]


def test_cpu_quota_caps_the_affinity_mask() -> None:
    files = {"/sys/fs/cgroup/cpu.max": "200000 100000\n"}
    quota = cgroup_cpu_limit(files.get)
    assert quota is not None and quota[0] == 2.0
    cpus = usable_cpus(16, quota)
    assert cpus.usable == 2.0 and "cpu.max" in cpus.evidence
    assert cgroup_cpu_limit({"/sys/fs/cgroup/cpu.max": "max 100000"}.get) is None
    v1 = {"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "150000",
          "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"}
    assert cgroup_cpu_limit(v1.get) == (
        1.5, "cgroup cpu.cfs_quota_us 150000 / cpu.cfs_period_us 100000")
    assert usable_cpus(4, None).usable == 4.0


def test_a_hanging_probe_is_cut_off() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="stuck call did not finish within 0.2s"):
        bounded(lambda: time.sleep(30), 0.2, "stuck call")
    assert time.monotonic() - start < 5.0
    with pytest.raises(socket.gaierror):
        bounded(lambda: socket.getaddrinfo("no-such-host.invalid", None), 10.0, "resolve")


def test_gpu_probe_reads_torch_and_the_driver(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """The real GpuProbes over a fake torch module and a fake driver listing (no GPU here)."""
    import types

    from rankwise.doctor import GpuProbes

    fake = types.ModuleType("torch")
    fake.version = types.SimpleNamespace(cuda="12.4")  # type: ignore[attr-defined]
    fake.cuda = types.SimpleNamespace(device_count=lambda: 3)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", fake)
    for bus in ("0000:17:00.0", "0000:65:00.0"):
        (tmp_path / bus).mkdir()
    probes = GpuProbes(import_torch=False, proc_gpus=str(tmp_path))
    assert probes.device_count() == 3 and probes.physical_count() == 2
    fake.version = types.SimpleNamespace(cuda=None)  # type: ignore[attr-defined]
    assert probes.device_count() is None  # a CPU-only build
    assert GpuProbes(proc_gpus=str(tmp_path / "absent")).physical_count() is None
    # and a driver that hangs is cut off, not waited for, and said so
    fake.version = types.SimpleNamespace(cuda="12.4")  # type: ignore[attr-defined]
    fake.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        device_count=lambda: time.sleep(30))
    start = time.monotonic()
    (f,) = run_checks(healthy(gpus=GpuProbes(import_torch=False, timeout=0.2)), ["gpu"])
    assert time.monotonic() - start < 5.0
    assert f.problem and "device_count() did not finish within 0.2s" in f.evidence


def test_a_hanging_resolver_costs_one_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """MASTER_ADDR is resolved by three checks; a DNS server that never answers is waited
    for once (bounded), and reported as unresolvable."""
    import threading

    from rankwise.doctor import NetProbes

    release = threading.Event()
    calls: list[str] = []

    def stuck(host: str, *args: object, **kw: object) -> list[object]:
        calls.append(host)
        release.wait(30)
        raise socket.gaierror("released")

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    try:
        start = time.monotonic()
        findings = run_checks(healthy(env={"MASTER_ADDR": "slow.example", "MASTER_PORT": "1"},
                                      net=NetProbes(resolve_timeout=0.3)))
        elapsed = time.monotonic() - start
    finally:
        release.set()
    assert calls.count("slow.example") == 1
    assert elapsed < 5.0
    (f,) = [f for f in findings if f.problem]
    assert "does not resolve" in f.what and "within 0.3s" in f.evidence
