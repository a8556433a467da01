"""Network: interface variables of NCCL and gloo, MASTER_ADDR (resolution, loopback on a
job of several nodes, reachability), the hostname-to-127.0.1.1 trap, MASTER_PORT."""

from __future__ import annotations

import errno
import ipaddress

from ..launch.env import uses_agent_store
from .findings import Finding, Severity
from .inputs import Inputs
from .probes import PortState

__all__ = ["check_hostname", "check_ifnames", "check_master_addr", "check_master_port",
           "ifname_matches"]


def _loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.split("%")[0]).is_loopback
    except ValueError:
        return False


def ifname_matches(spec: str, interfaces: list[str], exact: bool) -> list[str]:
    """Interfaces selected by an ``*_SOCKET_IFNAME`` value. NCCL's rules (``exact`` False):
    comma-separated prefixes, ``=`` before the list for exact names, ``^`` to exclude.
    gloo's (``exact`` True): comma-separated exact names."""
    exclude = False
    if not exact and spec.startswith("^"):
        exclude, spec = True, spec[1:]
    if not exact and spec.startswith("="):
        exact, spec = True, spec[1:]
    names = [n.strip() for n in spec.split(",") if n.strip()]

    def hit(iface: str) -> bool:
        return any(iface == n if exact else iface.startswith(n) for n in names)

    return [i for i in interfaces if hit(i) != exclude]


_IFNAME_VARS = (("NCCL_SOCKET_IFNAME", False, "NCCL"), ("GLOO_SOCKET_IFNAME", True, "gloo"))


def check_ifnames(inp: Inputs) -> list[Finding]:
    found: list[Finding] = []
    interfaces = list(inp.interfaces)
    real = [i for i in interfaces if not i.startswith("lo")]
    for var, exact, lib in _IFNAME_VARS:
        spec = inp.env.get(var)
        if not spec or not interfaces:
            continue
        chosen = ifname_matches(spec, interfaces, exact)
        evidence = f"{var}={spec}; interfaces here: {', '.join(interfaces)}"
        suggestion = f"{var}={real[0]}" if real else f"unset {var}"
        if not chosen:
            found.append(Finding(
                "interfaces", Severity.ERROR, f"{var} selects no interface of this host",
                evidence, f"set {suggestion} (the interface that reaches the other nodes) or "
                f"unset it; {lib} fails at init when the named interface does not exist"))
        elif inp.multi_node() and all(i.startswith("lo") for i in chosen):
            found.append(Finding(
                "interfaces", Severity.ERROR,
                f"{var} selects only loopback, but the job spans {inp.nnodes()} nodes",
                evidence, f"set {suggestion}: other nodes cannot reach this one through "
                "loopback"))
    return found


def _resolve(inp: Inputs, host: str) -> tuple[list[str], str]:
    """(addresses, error text)."""
    try:
        return inp.net.resolve(host), ""
    except (OSError, TimeoutError) as exc:
        return [], str(exc) or type(exc).__name__


def check_master_addr(inp: Inputs) -> list[Finding]:
    addr, _ = inp.master()
    if not addr:
        return [Finding("master", Severity.INFO,
                        "MASTER_ADDR is not set (rankwise run sets it for its workers)")]
    ips, error = _resolve(inp, addr)
    if not ips:
        return [Finding("master", Severity.ERROR, f"MASTER_ADDR={addr} does not resolve",
                        error, "use the IP address of node 0, or a name every node resolves "
                        "(check /etc/hosts and DNS)")]
    if inp.multi_node() and all(_loopback(ip) for ip in ips):
        return [Finding(
            "master", Severity.ERROR,
            f"MASTER_ADDR={addr} is a loopback address, but the job spans {inp.nnodes()} nodes",
            f"{addr} -> {', '.join(ips)}",
            "set MASTER_ADDR to node 0's address on the network the nodes share: on other "
            "nodes a loopback address is the node itself")]
    return [Finding("master", Severity.INFO, f"MASTER_ADDR={addr} resolves to {', '.join(ips)}")]


def check_hostname(inp: Inputs) -> list[Finding]:
    """The Debian/Ubuntu /etc/hosts line ``127.0.1.1 <hostname>``: harmless on one node, a
    trap on several (whatever advertises this host by name gives the others loopback)."""
    ips, _ = _resolve(inp, inp.hostname)
    trap = [ip for ip in ips if _loopback(ip) and ip != "127.0.0.1" and ip != "::1"]
    if not trap:
        return []
    finding = Finding(
        "hostname", Severity.WARNING if inp.multi_node() else Severity.INFO,
        f"this host's name {inp.hostname!r} resolves to the loopback address {trap[0]}",
        f"{inp.hostname} -> {', '.join(ips)} (the '127.0.1.1 hostname' line of /etc/hosts)",
        "on a job of several nodes, map the hostname to the machine's network address in "
        "/etc/hosts, or set MASTER_ADDR to node 0's IP and GLOO_SOCKET_IFNAME/"
        "NCCL_SOCKET_IFNAME to the interface the nodes share")
    return [finding]


def _hosting(inp: Inputs, ip: str) -> bool:
    if inp.hosting is not None:
        return inp.hosting
    job = inp.cluster()
    if job is not None:
        return job.rank == 0 and not uses_agent_store(inp.env)
    return inp.net.is_local(ip)


def check_master_port(inp: Inputs) -> list[Finding]:
    addr, port = inp.master()
    if not addr or port is None:
        return []
    if not 0 < port < 65536:
        return [Finding("port", Severity.ERROR, f"MASTER_PORT={port} is not a TCP port",
                        "", "use a port in 1024..65535 that is free on node 0")]
    ips, _ = _resolve(inp, addr)
    if not ips:
        return []  # the master check reports it
    ip, where = ips[0], f"{addr}:{port}"
    if _hosting(inp, ip):
        return _bind_findings(inp, ip, port, where)
    state, detail = inp.net.probe(ip, port)
    evidence = f"{where} answers with {state.value}: {detail}"
    if state is PortState.RANKWISE_STORE:
        return [Finding("port", Severity.INFO, f"a rankwise store listens on {where}")]
    if state is PortState.REFUSED:
        severity = Severity.ERROR if inp.in_job() else Severity.INFO
        return [Finding("port", severity, f"nothing listens on {where}", evidence,
                        "start node 0 (or rank 0) first, or check MASTER_ADDR/MASTER_PORT "
                        "match what node 0 uses")]
    if state is PortState.TOKEN_DIFFERS:
        return [Finding("port", Severity.ERROR,
                        f"the rankwise store on {where} refuses this environment's token",
                        evidence, "give every node and rank the same RANKWISE_TOKEN or "
                        "RANKWISE_TOKEN_FILE")]
    if state is PortState.OTHER_PROGRAM:
        return [Finding("port", Severity.ERROR,
                        f"{where} is held by a program that is not a rankwise store", evidence,
                        "pick another MASTER_PORT (the same on every node)")]
    return [Finding("port", Severity.ERROR if state is PortState.UNREACHABLE else
                    Severity.WARNING, f"{where} cannot be reached from this host", evidence,
                    "check routes and firewalls between the nodes (the store port and the "
                    "ranks' data ports must be open), and that MASTER_ADDR is node 0's address "
                    "on the network they share")]


def _bind_findings(inp: Inputs, ip: str, port: int, where: str) -> list[Finding]:
    err = inp.net.bind_error(ip, port)
    if err is None:
        return [Finding("port", Severity.INFO, f"the store can listen on {where}")]
    if err.errno == errno.EADDRINUSE:
        state, _ = inp.net.probe(ip, port)
        holder = ("a live rankwise store (another job, or an earlier run still going)"
                  if state in (PortState.RANKWISE_STORE, PortState.TOKEN_DIFFERS)
                  else "another program")
        return [Finding("port", Severity.ERROR, f"MASTER_PORT {port} is in use by {holder}",
                        f"binding {where}: {err.strerror}; the port answers with "
                        f"{state.value}", "choose a free MASTER_PORT (or let `rankwise run` "
                        "pick one: it does on one node), or stop the other job; find it with "
                        f"`ss -ltnp 'sport = :{port}'`")]
    if err.errno == errno.EADDRNOTAVAIL:
        return [Finding("port", Severity.ERROR,
                        f"MASTER_ADDR {ip} is not an address of this machine, so the store "
                        "cannot listen on it", f"binding {where}: {err.strerror}",
                        "on node 0, MASTER_ADDR must be one of its own addresses")]
    return [Finding("port", Severity.ERROR, f"the store cannot listen on {where}",
                    f"binding {where}: {err}", "pick a port in 1024..65535 that is free")]
