"""Hosts for multi-host tests: Linux network namespaces on one bridge, real TCP between them.

    with Network() as net:
        redis_host, web_host = net.host("redis"), net.host("web1")     # 10.77.0.2, 10.77.0.3
        server = start_redis(host=redis_host.address, password="pw", via=redis_host.via)
        web = spawn_gunicorn(url, models, host=web_host.address, via=web_host.via)
        requests.get(web.url + "/health")      # from this process: the bridge's own address, 10.77.0.1
        web_host.partition(); web_host.heal(); web_host.kill()

Each host is a namespace with one veth whose other end is on the bridge; the test process is the
client host, through the bridge's address in the root namespace. Traffic stays between these
addresses. Every name made here starts with `PREFIX`: a run that crashed leaves namespaces and links
that the next `Network` removes (their processes killed) before it makes its own.

Needs root and iproute2's `ip` (`apt-get install iproute2`); `unavailable()` says why not, for a skip.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

PREFIX = "nsrv"
SUBNET = "10.77.0"  # a /24 of private addresses; .1 is the bridge (the client host)


def ip_binary() -> str | None:
    return shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.path.exists(p)), None)


def ip(*args: str, check: bool = True) -> str:
    done = subprocess.run([ip_binary() or "ip", *args], capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if ip_binary() is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    probe = f"{PREFIX}-probe"
    ip("netns", "del", probe, check=False)
    done = subprocess.run([ip_binary(), "netns", "add", probe], capture_output=True, text=True)
    if done.returncode:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def namespace_pids(netns: str) -> list[int]:
    return [int(pid) for pid in ip("netns", "pids", netns, check=False).split()]


def kill_namespace(netns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in the namespace, and wait until none is left."""
    deadline = time.monotonic() + timeout
    while pids := namespace_pids(netns):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} of {netns} outlived SIGKILL")
        time.sleep(0.05)


def remove_leftovers() -> None:
    """Namespaces and links of ours that an earlier run left behind (it crashed, or was killed)."""
    for line in ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX + "-"):
            kill_namespace(name)
            ip("netns", "del", name, check=False)
    for line in ip("-o", "link", "show", check=False).splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        if name.startswith(PREFIX + "-"):
            ip("link", "del", name, check=False)


@dataclass
class Host:
    """One namespace on the bridge: `address` on its `eth0`, the bridge's end of the veth named `veth`."""

    name: str
    address: str
    netns: str
    veth: str

    @property
    def via(self) -> list[str]:
        """What runs a command on this host: `[*host.via, "python", ...]`."""
        return [ip_binary(), "netns", "exec", self.netns]

    def partition(self) -> None:
        """Cut the host off the network (its side of the link down): its processes run on, unreachable."""
        ip("-n", self.netns, "link", "set", "eth0", "down")

    def heal(self) -> None:
        ip("-n", self.netns, "link", "set", "eth0", "up")

    def pids(self) -> list[int]:
        return namespace_pids(self.netns)

    def kill(self) -> None:
        """The host vanishes: every process on it killed at once (SIGKILL)."""
        kill_namespace(self.netns)


@dataclass
class Network:
    """A bridge with hosts on it; `close` (or leaving the `with`) removes every trace, processes too."""

    subnet: str = SUBNET
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"{PREFIX}-br"

    @property
    def client_address(self) -> str:
        """This process's address on the network (the client host)."""
        return f"{self.subnet}.1"

    def start(self) -> "Network":
        remove_leftovers()
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.client_address}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        return self

    def host(self, name: str) -> Host:
        """A new host, on the next free address. Names: a few letters and digits (an interface name
        has at most 15 characters)."""
        netns = veth = f"{PREFIX}-{name}"
        if len(veth) > 15 or name in self.hosts:
            raise ValueError(f"host name {name!r} is taken or too long")
        address = f"{self.subnet}.{len(self.hosts) + 2}"
        ip("netns", "add", netns)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        ip("link", "set", veth, "master", self.bridge, "up")
        ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", netns, "link", "set", "eth0", "up")
        ip("-n", netns, "link", "set", "lo", "up")
        host = self.hosts[name] = Host(name, address, netns, veth)
        return host

    def close(self) -> None:
        for host in self.hosts.values():
            kill_namespace(host.netns)
            ip("netns", "del", host.netns, check=False)
            ip("link", "del", host.veth, check=False)  # gone with its namespace; a half-made host's is not
        self.hosts.clear()
        ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> "Network":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
