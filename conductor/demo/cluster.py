"""A local emulated P/D cluster for `conductor demo`: emulators and a gateway as child processes.

Every child runs in its own session (its own process group), so a Ctrl-C at the terminal reaches
only the demo, which then shuts the children down in order: SIGTERM to each group, a grace period,
SIGKILL to stragglers, and a wait on every PID so none is left behind or unreaped. On Linux each
child also asks the kernel for SIGTERM should the demo itself die without cleaning up
(PR_SET_PDEATHSIG), so even a SIGKILLed demo leaves no workers running.

Ports are chosen by binding port 0 on loopback for all of them at once (so two are never equal),
then released just before the children bind them; or, with a base port (`conductor demo
--base-port N`), taken in order from N: the gateway on N, then each worker's HTTP, KV-event and
side-channel ports (and a prefill's bootstrap port), each checked free first.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from conductor.config.settings import merge_settings

_PR_SET_PDEATHSIG = 1
BOOTSTRAP_PROTOCOLS = ("mooncake", "sglang")  # a prefill serves a bootstrap port for the handshake


def free_ports(n: int) -> list[int]:
    """`n` distinct free TCP ports on 127.0.0.1."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class PortTaken(RuntimeError):
    """A port the cluster was told to use is not free."""


def ports_needed(n_prefill: int, n_decode: int, pd_protocol: str) -> int:
    """How many ports a cluster of this shape binds: the gateway's, three per worker (HTTP, KV
    events, side channel) and, for the protocols with one, each prefill's bootstrap port."""
    bootstrap = n_prefill if pd_protocol in BOOTSTRAP_PROTOCOLS else 0
    return 1 + (n_prefill + n_decode) * 3 + bootstrap


def ports_from(base: int, count: int) -> list[int]:
    """Ports base .. base+count-1, each checked free on loopback now; PortTaken naming the first
    that is not, ValueError past 65535."""
    last = base + count - 1
    if base < 1 or last > 65535:
        raise ValueError(f"the cluster needs {count} ports from {base} ({base}-{last}): they must lie in 1-65535")
    for port in range(base, last + 1):
        with socket.socket() as s:
            # as the servers themselves bind: a port held only by a closed connection's TIME_WAIT
            # (the previous cluster's, in a --compare) is free to them
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError as exc:
                raise PortTaken(
                    f"port {port} is taken ({exc.strerror}); the cluster needs ports {base}-{last}: give another --base-port"
                ) from None
    return list(range(base, last + 1))


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    """One started process and where its output goes."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    url: str | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class ChildGroup:
    """Tracks the children by PID and ends them all, whatever happened."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)
    _logs: list[IO[bytes]] = field(default_factory=list)

    def start(self, name: str, argv: Sequence[str], url: str | None = None, env: dict[str, str] | None = None) -> Child:
        log_path = self.log_dir / f"{name}.log"
        log = log_path.open("wb")
        self._logs.append(log)
        preexec: Callable[[], None] | None = _die_with_parent if sys.platform.startswith("linux") else None
        proc = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec,
            env={**os.environ, **(env or {})},
        )
        child = Child(name, proc, log_path, url)
        self.children.append(child)
        return child

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every child's group, wait up to `grace_s`, SIGKILL what is left, reap all."""
        for child in reversed(self.children):  # the gateway first: it stops sending to workers
            if child.alive():
                _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for child in self.children:
            if child.alive():
                _signal_group(child.proc, signal.SIGKILL)
                child.proc.wait()
            else:  # the group may still hold something the child started
                _signal_group(child.proc, signal.SIGKILL)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def dead(self) -> list[Child]:
        return [c for c in self.children if not c.alive()]


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    # the child leads its own group (start_new_session), so its PID is the group id; a group that
    # is already gone raises ProcessLookupError, which is what we wanted anyway
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """What to start."""

    n_prefill: int
    n_decode: int
    pd_protocol: str  # nixl | mooncake | sglang
    policy: str
    model: str
    time_scale: float  # multiplies the emulators' modelled durations
    noise: float  # lognormal sigma of the emulators' timing noise
    slo_ttft_s: float | None
    slo_tbt_s: float | None
    block_size: int = 16
    kv_events: bool = True  # the emulators publish vLLM KV events
    kv_index: bool = True  # the gateway keys prompts and keeps a KV-cache index fed by those events
    policy_options: dict[str, Any] = field(default_factory=dict)
    gateway_extra: dict[str, Any] = field(default_factory=dict)  # more gateway settings (YAML keys)
    emulator_extra: tuple[str, ...] = ()  # more flags for every emulator (`--bidirectional-kv-xfer`)
    base_port: int | None = None  # the gateway on it, the workers after it (ports_from); None: any free ports


@dataclass(frozen=True, slots=True)
class StartedCluster:
    """Where the started cluster answers."""

    gateway_url: str  # http://127.0.0.1:PORT
    prefill_urls: tuple[str, ...]  # the prefill emulators, in start order
    decode_urls: tuple[str, ...]  # the decode emulators
    config_path: Path  # the gateway's generated settings file (in the log directory)


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def start_cluster(spec: ClusterSpec, group: ChildGroup) -> StartedCluster:
    """Start the emulators and the gateway (not waiting for them: see wait_ready)."""
    bootstrap = spec.pd_protocol in BOOTSTRAP_PROTOCOLS
    count = ports_needed(spec.n_prefill, spec.n_decode, spec.pd_protocol)
    ports = iter(free_ports(count) if spec.base_port is None else ports_from(spec.base_port, count))
    gw_port = next(ports)
    prefill_cfg: list[dict[str, Any]] = []
    decode_cfg: list[dict[str, Any]] = []
    for role, count, target in (("prefill", spec.n_prefill, prefill_cfg), ("decode", spec.n_decode, decode_cfg)):
        for i in range(count):
            port, events_port, side_port = next(ports), next(ports), next(ports)
            argv = _python(
                "-m",
                "adapters.emulator",
                "--role",
                role,
                "--pd-protocol",
                spec.pd_protocol,
                "--port",
                str(port),
                "--model",
                spec.model,
                "--block-size",
                str(spec.block_size),
                "--time-scale",
                repr(spec.time_scale),
                "--noise",
                repr(spec.noise),
                "--seed",
                str(len(group.children)),
                "--engine-id",
                f"demo-{role}-{i}",
                "--side-channel-port",
                str(side_port),
                "--log-level",
                "warning",
                *spec.emulator_extra,
            )
            entry: dict[str, Any] = {"url": f"http://127.0.0.1:{port}", "name": f"{role}-{i}"}
            if spec.kv_events:
                # as vLLM's --kv-events-config has it: "*" means the worker binds and the gateway
                # connects to the worker's host (adapters/kv_events.py applies vLLM's rule)
                argv += ["--kv-events-endpoint", f"tcp://*:{events_port}"]
                entry["kv_events_endpoint"] = f"tcp://*:{events_port}"
            if role == "prefill" and bootstrap:
                boot = next(ports)
                argv += ["--bootstrap-port", str(boot)]
                entry["bootstrap_port"] = boot
            group.start(f"{role}-{i}", argv, entry["url"])
            target.append(entry)
    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": gw_port,
        "logs": {"level": "warning"},
        "pd": {"protocol": spec.pd_protocol},
        "policy": spec.policy,
        "policy_options": spec.policy_options,
        "models": [spec.model],
        "prefill": prefill_cfg,
        "decode": decode_cfg,
        "health": {"interval_s": 1.0},
        "slo": {k: v for k, v in (("ttft_s", spec.slo_ttft_s), ("tbt_s", spec.slo_tbt_s)) if v is not None},
        "block_size": spec.block_size,
    }
    settings = merge_settings(base, spec.gateway_extra)
    if spec.kv_index:
        # the built-in byte tokenizer is the emulators' too; keys are the gateway's own xxhash
        # chain, mapped to the workers' vLLM hashes through the token ids their events carry
        settings["kv"] = {"enabled": True, "tokenizer": "builtin", **settings.get("kv", {})}
    config_path = group.log_dir / "gateway.yaml"
    config_path.write_text(yaml.safe_dump(settings, sort_keys=False), encoding="utf-8")
    gw_url = f"http://127.0.0.1:{gw_port}"
    group.start("gateway", _python("-m", "conductor", "serve", "--config", str(config_path)), gw_url)
    return StartedCluster(gw_url, tuple(p["url"] for p in prefill_cfg), tuple(d["url"] for d in decode_cfg), config_path)


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(cluster: StartedCluster, group: ChildGroup, timeout_s: float = 90.0) -> None:
    """Until every emulator answers /health and the gateway /ready; RuntimeError naming the child
    that died or never answered."""
    deadline = time.monotonic() + timeout_s
    pending = [c for c in group.children if c.url]
    while pending:
        dead = group.dead()
        if dead:
            raise RuntimeError(f"{dead[0].name} (pid {dead[0].pid}) exited with {dead[0].proc.returncode}:\n{dead[0].log_tail()}")
        if time.monotonic() > deadline:
            names = ", ".join(c.name for c in pending)
            raise RuntimeError(f"not ready after {timeout_s:.0f}s: {names}")
        child = pending[0]
        path = "/ready" if child.name == "gateway" else "/health"
        if _get_ok(f"{child.url}{path}"):
            pending.pop(0)
        else:
            time.sleep(0.1)
