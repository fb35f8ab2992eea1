"""Several "hosts" on one machine, for the tests of the mesh across hosts: Linux network
namespaces, each with its own address on a bridge the test makes (10.250.X.0/24, X from the
test process's id, so two runs do not meet), reached from the test process through the
bridge's own address. Nothing outside the namespaces the test made is ever contacted. The
file system is shared (as a shared file system would be across hosts): the storage tier is one
directory every host sees.

``Hosts(n)`` is a context manager: everything it made is removed on the way out, whatever
happened (and processes started in a namespace die with the test: ``Proc``'s PDEATHSIG).
Needs root and iproute2; ``hosts_or_skip`` says why not where they are missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import Proc


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def hosts_or_skip() -> None:
    """Skips, saying why, where network namespaces cannot be made (not root, no iproute2, a
    kernel or container that refuses them)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("several hosts need root and iproute2 (network namespaces)")
    probe = f"kvmesh-probe-{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"network namespaces cannot be made here: {err}")
    ip("netns", "del", probe)


class Hosts:
    def __init__(self, n: int) -> None:
        tag = os.getpid() % 250
        self.tag = f"{os.getpid() % 100000:05d}"
        self.bridge = f"kvb{self.tag}"
        self.namespaces = [f"kvmesh-{self.tag}-{i}" for i in range(n)]
        self.addresses = [f"10.250.{tag}.{i + 1}" for i in range(n)]
        self.gateway = f"10.250.{tag}.254"  # the test process's side of the bridge
        self.made: list[tuple[str, str]] = []  # ("netns" | "link", name), to remove

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _veth(self, i: int) -> str:
        return f"kvv{self.tag}{i}"

    def _make(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self.made.append(("link", self.bridge))
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, (ns, address) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
            ip("netns", "add", ns)
            self.made.append(("netns", ns))
            veth = self._veth(i)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", veth, "master", self.bridge)
            ip("link", "set", veth, "up")
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "route", "add", "default", "via", self.gateway)

    def remove(self) -> None:
        """Everything made, removed (a namespace's end of its veth goes with it)."""
        for kind, name in reversed(self.made):
            with contextlib.suppress(RuntimeError):
                ip(*(("netns", "del", name) if kind == "netns" else ("link", "del", name)))
        self.made.clear()

    def run(self, i: int, args: list[str], env: dict[str, str], log: Path) -> Proc:
        """A process on host ``i`` (in its namespace)."""
        return Proc(["ip", "netns", "exec", self.namespaces[i], *args], env, log)

    def service(self, i: int, role: str, env: dict[str, str], log: Path) -> Proc:
        return self.run(i, [sys.executable, "-m", f"services.{role}"], env, log)

    def cut(self, i: int) -> None:
        """Host ``i`` cut off the network (its cable pulled), and ``heal`` puts it back."""
        ip("link", "set", self._veth(i), "down")

    def heal(self, i: int) -> None:
        ip("link", "set", self._veth(i), "up")
