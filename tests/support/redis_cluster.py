"""A real Redis Cluster for tests and benchmarks: six `redis-server --cluster-enabled yes` processes.

Three masters and three replicas on free loopback ports in a temporary directory, joined with
`redis-cli --cluster create`. Plain API for scripts (`start_redis_cluster()` / `RedisClusterNodes.stop()`
or the `redis_cluster()` context manager); pytest users call `require_cluster_tools()` first, so a
machine without the binaries skips with a reason, and CI, which installs them, fails (tests/support/ci.py).

The node timeout is short (1 s by default) so that a killed master's replica takes over within a
few seconds: the failover tests wait for that, they do not sleep a fixed time.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

CLUSTER_BUS_OFFSET = 10_000  # Redis Cluster's bus listens on the client port + 10000


def missing_cluster_tools() -> str | None:
    """Why a cluster cannot be started here (a missing binary), or None."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    return f"{' and '.join(missing)} not on PATH (install redis-server)" if missing else None


def require_cluster_tools() -> None:
    """Skip (fail under CI) with the reason when the binaries are missing; nothing otherwise."""
    from tests.support.ci import require  # pytest's: not for the scripts that use this module

    reason = missing_cluster_tools()
    require(reason is None, reason or "")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_ports(count: int) -> list[int]:
    """`count` ports whose cluster-bus twin (port + 10000) is free too, all below 65536."""
    chosen: list[int] = []
    rng = random.Random()
    while len(chosen) < count:
        port = rng.randrange(20_000, 65_536 - CLUSTER_BUS_OFFSET)
        if port not in chosen and _port_free(port) and _port_free(port + CLUSTER_BUS_OFFSET):
            chosen.append(port)
    return chosen


@dataclass
class RedisClusterNodes:
    """Running cluster nodes: their ports, startup URLs, processes and the temp dir they write in."""

    ports: list[int]
    directory: Path
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{p}" for p in self.ports]

    @property
    def alive_ports(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_connect_timeout=2, socket_timeout=5)

    def masters(self) -> list[int]:
        """Ports of the live nodes that are masters now (as a live node sees the cluster)."""
        out = []
        for line in self._nodes_view():
            fields = line.split()
            if "master" in fields[2] and "fail" not in fields[2]:
                out.append(int(fields[1].split("@")[0].rsplit(":", 1)[1]))
        return sorted(out)

    def master_of_slot(self, slot: int) -> int:
        """Port of the master serving `slot` now."""
        with self.client(self.alive_ports[0]) as c:
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(master[1])
        raise LookupError(f"slot {slot} is not served")

    def _nodes_view(self) -> list[str]:
        with self.client(self.alive_ports[0]) as c:
            raw = c.execute_command("CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return [line for line in text.splitlines() if line.strip()]

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crashed master: its replica takes over after the node timeout)."""
        proc = self.procs[port]
        proc.kill()
        proc.wait(timeout=10)

    def healthy(self) -> bool:
        """Every live node says cluster_state:ok and knows all 16384 slots are served."""
        for port in self.alive_ports:
            try:
                with self.client(port) as c:
                    info = c.execute_command("CLUSTER", "INFO")
            except redis.RedisError:
                return False
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text or "cluster_slots_ok:16384" not in text:
                return False
        return True

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis cluster on {self.ports} not healthy after {timeout_s}s:\n{self.logs()}")
            time.sleep(0.1)

    def logs(self, tail: int = 20) -> str:
        parts = []
        for port in self.ports:
            log = self.directory / f"{port}.log"
            if log.exists():
                parts.append(f"--- {port}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-tail:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Kill every node and delete the temp dir; safe to call twice."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _start_node(port: int, directory: Path, node_timeout_ms: int) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    assert binary is not None
    args = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        str(directory / f"nodes-{port}.conf"),
        "--cluster-node-timeout",
        str(node_timeout_ms),
        "--dir",
        str(directory),
        # a replica may always take over, however long a busy test machine kept it from its master
        "--cluster-replica-validity-factor",
        "0",
        # a replica's first sync starts at once, not 5 s later (Redis's default delay for diskless
        # sync, which waits for more replicas to share one RDB): writes made inside that delay
        # were seen acknowledged by a replica that then held another key set (Redis 7.0.15)
        "--repl-diskless-sync-delay",
        "0",
        "--save",
        "",
        "--appendonly",
        "no",
        "--logfile",
        str(directory / f"{port}.log"),
    ]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ping(port: int, timeout_s: float, *, socket_timeout_s: float = 0.5, poll_s: float = 0.05) -> None:
    """Until the redis-server on `port` answers PING; its last error once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(port=port, socket_connect_timeout=socket_timeout_s, socket_timeout=socket_timeout_s)
    try:
        while True:
            try:
                if client.ping():
                    return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(poll_s)
    finally:
        client.close()


def start_redis_cluster(
    nodes: int = 6, replicas: int = 1, *, node_timeout_ms: int = 1000, timeout_s: float = 60.0
) -> RedisClusterNodes:
    """Start and join a cluster; the caller must `stop()` it. Raises RuntimeError if a binary is missing."""
    reason = missing_cluster_tools()
    if reason is not None:
        raise RuntimeError(reason)
    tmp = tempfile.TemporaryDirectory(prefix="redis-cluster-")
    cluster = RedisClusterNodes(ports=free_cluster_ports(nodes), directory=Path(tmp.name), _tmp=tmp)
    try:
        for port in cluster.ports:
            cluster.procs[port] = _start_node(port, cluster.directory, node_timeout_ms)
        for port in cluster.ports:
            wait_ping(port, timeout_s)
        cli = shutil.which("redis-cli")
        assert cli is not None
        create = subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in cluster.ports),
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
        if create.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed: {create.stdout.decode(errors='replace')}"
                f"{create.stderr.decode(errors='replace')}"
            )
        cluster.wait_healthy(timeout_s)
        # replicas must have attached too, or a failover test would find no one to promote
        deadline = time.monotonic() + timeout_s
        while len(cluster.masters()) != nodes // (replicas + 1) or not _replicas_synced(cluster, replicas):
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas did not attach:\n{cluster.logs()}")
            time.sleep(0.1)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _replicas_synced(cluster: RedisClusterNodes, replicas: int) -> bool:
    """Every master has `replicas` replicas that finished their first sync (state "online"; a
    connected replica may still be waiting for its RDB)."""
    for port in cluster.masters():
        with cluster.client(port) as c:
            info = c.info("replication")
        online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"]
        if len(online) < replicas:
            return False
    return True


@contextmanager
def redis_cluster(nodes: int = 6, replicas: int = 1, *, node_timeout_ms: int = 1000) -> Iterator[RedisClusterNodes]:
    """A running cluster for the `with` block; everything is killed and deleted afterwards, also on failure."""
    cluster = start_redis_cluster(nodes, replicas, node_timeout_ms=node_timeout_ms)
    try:
        yield cluster
    finally:
        cluster.stop()
