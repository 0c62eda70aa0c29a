"""Real hosts for multi-host fault tests: one Linux network namespace per host, joined by veth pairs to a bridge in
a namespace of its own (the switch).

Each host has its own address (10.77.<k>.<i + 1>/24), loopback, hostname (a UTS namespace per command) and
/etc/hosts naming every host (`ip netns exec` mounts /etc/netns/<namespace>/hosts over /etc/hosts), so torchrun,
its c10d rendezvous and gloo resolve and bind each host's own address as on separate machines. Every name carries
this process's id, so parallel test runs never meet; the namespaces keep their traffic apart in any case.

The faults:
- `kill_host(i)`: SIGKILL to every process of the host and its node-local memory (`local_dir`, on /dev/shm)
  removed. The host's kernel survives and closes their sockets, so peers see the connections reset at once (a
  crashed node whose network answers, a killed container).
- `cut_link(i)`: the host's port on the switch goes down; its processes run on, and nothing they send arrives
  anywhere (a dead machine or a cable). Peers notice only by a timeout. `restore_link(i)` brings the port back up.

Needs root and `ip netns` (CI runs as root); elsewhere the tests using it are skipped with the reason.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

PREFIX = "hlat"
NETNS_ETC = Path("/etc/netns")  # `ip netns exec` mounts the files of /etc/netns/<namespace>/ over /etc's
SHM = Path("/dev/shm")
_instances = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _netns_pids(namespace: str) -> list[int]:
    done = _ip("netns", "pids", namespace, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "multi-host tests need iproute2's `ip` and util-linux's `unshare`"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` fails here: {done.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return None


def _sweep_stale() -> None:
    """Namespaces and files left by a test process that was killed before its teardown."""
    for entry in _ip("netns", "list", check=False).stdout.split("\n"):
        name = entry.split(" ")[0]
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not Path(f"/proc/{parts[1]}").exists():
            for pid in _netns_pids(name):
                os.kill(pid, signal.SIGKILL)
            _ip("netns", "delete", name, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
            shutil.rmtree(SHM / f"{PREFIX}-hosts-{parts[1]}-{parts[2]}", ignore_errors=True)


class Host:
    """One host: its namespace, address, hostname and node-local directory."""

    def __init__(self, index: int, tag: str, subnet: int, shm_root: Path):
        self.index = index
        self.name = f"{PREFIX}-{tag}-h{index}"  # the namespace's name and the host's hostname
        self.address = f"10.77.{subnet}.{index + 1}"
        self.port = f"p{index}"  # its veth end on the switch (the host's own end is eth0)
        self.local_dir = shm_root / f"h{index}"  # node-local memory: gone with the host
        self.processes: list[subprocess.Popen] = []

    def popen(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """`argv` on this host, in a session of its own, with `env`, stdout and stderr to `log` (appended)."""
        command = [
            "ip",
            "netns",
            "exec",
            self.name,
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.name,
            *argv,
        ]
        with open(log, "ab") as out:
            process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(process)
        return process

    def pids(self) -> list[int]:
        return _netns_pids(self.name)


class Hosts:
    """`n` hosts on one switch; a context manager whose exit kills every process and removes every namespace,
    veth, /etc/netns entry and node-local directory, however the test ended."""

    def __init__(self, n: int):
        self.tag = f"{os.getpid()}-{next(_instances)}"
        self.switch = f"{PREFIX}-{self.tag}-sw"
        self.shm_root = SHM / f"{PREFIX}-hosts-{self.tag}"
        subnet = (os.getpid() + int(self.tag.split("-")[1])) % 250
        self.hosts = [Host(i, self.tag, subnet, self.shm_root) for i in range(n)]

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __enter__(self) -> Hosts:
        _sweep_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        sw = ["-n", self.switch]
        _ip(*sw, "link", "set", "lo", "up")
        _ip(*sw, "link", "add", "br0", "type", "bridge")
        _ip(*sw, "link", "set", "br0", "up")
        names = "".join(f"{h.address} {h.name}\n" for h in self.hosts)
        for h in self.hosts:
            _ip("netns", "add", h.name)
            (NETNS_ETC / h.name).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / h.name / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
            _ip("-n", h.name, "link", "set", "lo", "up")
            _ip(*sw, "link", "add", h.port, "type", "veth", "peer", "name", "eth0", "netns", h.name)
            _ip(*sw, "link", "set", h.port, "master", "br0")
            _ip(*sw, "link", "set", h.port, "up")
            _ip("-n", h.name, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _ip("-n", h.name, "link", "set", "eth0", "up")
            h.local_dir.mkdir(parents=True)

    def kill_host(self, i: int, memory_lost: bool = True) -> None:
        """SIGKILL to every process in host i (again until none is left: one may be forking) and, unless the host
        only lost its processes (`memory_lost` false), its node-local memory removed."""
        host = self.hosts[i]
        deadline = time.time() + 30
        while (pids := host.pids()) and time.time() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        for process in host.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if memory_lost:
            shutil.rmtree(host.local_dir, ignore_errors=True)

    def cut_link(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[i].port, "down")

    def restore_link(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[i].port, "up")

    def close(self) -> None:
        for i, host in enumerate(self.hosts):
            self.kill_host(i)
            _ip("netns", "delete", host.name, check=False)  # its veth pair goes with it
            shutil.rmtree(NETNS_ETC / host.name, ignore_errors=True)
        _ip("netns", "delete", self.switch, check=False)
        shutil.rmtree(self.shm_root, ignore_errors=True)


@pytest.fixture
def hosts():
    """A factory of `Hosts` (`hosts(2)`), each torn down after the test; skipped where namespaces are not allowed."""
    if reason := unavailable():
        pytest.skip(reason)
    made: list[Hosts] = []

    def make(n: int) -> Hosts:
        made.append(Hosts(n).__enter__())
        return made[-1]

    yield make
    for h in made:
        h.close()
