"""Real vLLM engines for the end-to-end tests: finding vLLM, the tiny model, starting and reading engines.

vLLM is never imported here: it lives in a venv of its own (`.ci/vllm.sh` builds `.venv-vllm`), and
each engine is a subprocess of that venv's Python running `launch_vllm.py serve ...`. The tests
talk to the engines over HTTP (OpenAI API, /metrics) and ZMQ (KV events), as the gateway does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq

from tests.support.servers import free_port
from tests.support.waiting import wait_for

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LAUNCHER = HERE / "launch_vllm.py"
MAKE_MODEL = HERE / "make_tiny_model.py"
ENV_VAR = "CONDUCTOR_VLLM_PYTHON"
DEFAULT_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MODEL_NAME = "tiny"
BLOCK_SIZE = 32  # the CPU attention backend wants a multiple of 32
# PYTHONHASHSEED of the mixed engines, told to the gateway as kv.vllm_hash_seed: with the xxhash
# algorithm vLLM otherwise seeds its first block's parent with random bytes per process, and no
# gateway (nor the other engine) could reproduce a single hash.
HASH_SEED = "20261130"
GEN = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True}
TIMINGS: list[str] = []  # one line per engine start and model build, printed at the end of the run

# Engine flags shared by every engine of these tests, each with why beside it (the timings were
# measured on this project's 2-core CI machine); vLLM's CPU build is described in its installation
# guide, https://docs.vllm.ai/en/latest/getting_started/installation/cpu.html
COMMON_ARGS = (
    "--served-model-name",
    MODEL_NAME,
    "--enforce-eager",  # no torch.compile: starts in ~40 s instead of ~75 s
    "--block-size",
    str(BLOCK_SIZE),
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "16",
    # float32, not bfloat16: with bf16 KV and 32-token blocks vLLM's CPU attention takes its AMX
    # kernel wherever the CPU advertises AMX, and on a VM that advertises it without enabling it
    # the decode engine dies of SIGILL on its first step after receiving KV (seen on a Sapphire
    # Rapids guest: exit code -4 in cpu_attention_with_kv_cache). float32 takes the AVX kernel
    # everywhere; what these tests check (wire formats, block hashes, cached tokens) is the same.
    "--dtype",
    "float32",
    # 128 MiB of KV cache, 131,072 tokens of this model (4,096 blocks: the tests' prompts use a few
    # hundred). The CPU engine allocates and touches it all at start-up, and a NIXL engine
    # registers it with UCX: 1 GiB (VLLM_CPU_KVCACHE_SPACE=1, the smallest that variable allows)
    # took 37.7 s of "init engine" for a NIXL engine against 3.0 s for 64 MiB on this machine
    "--kv-cache-memory-bytes",
    "128M",
    "--enable-prefix-caching",
    # usage.prompt_tokens_details.cached_tokens: what the gateway's hash agreement compares with
    "--enable-prompt-tokens-details",
)


def _launch_environ() -> Mapping[str, str]:
    """The environment pytest was started with.

    tests/conftest.py deletes every CONDUCTOR_* variable from os.environ so that no test reads a
    developer's gateway settings; CONDUCTOR_VLLM_PYTHON is not a gateway setting but a pointer to
    the engines' interpreter, so it is read back from where conftest keeps it (E2E_ + its name,
    which pytest-xdist's workers inherit) or from the process's initial environment (Linux).
    """
    if ENV_VAR in os.environ:
        return os.environ
    if (kept := os.environ.get("E2E_" + ENV_VAR)) is not None:
        return {ENV_VAR: kept}
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return os.environ
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


@dataclass(frozen=True)
class VllmPython:
    """The interpreter that imports vLLM, or why there is none.

    path: the interpreter; None when unusable. explicit: named by CONDUCTOR_VLLM_PYTHON (then an
    unusable one is an error, not a skip: whoever set it expects the engines to run).
    """

    path: str | None
    reason: str
    explicit: bool


_found: VllmPython | None = None


def find_vllm_python() -> VllmPython:
    """CONDUCTOR_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python, if `import vllm` works there (cached)."""
    global _found
    if _found is not None:
        return _found
    named = _launch_environ().get(ENV_VAR, "").strip()
    candidate = named or str(DEFAULT_PYTHON)
    if not named and not DEFAULT_PYTHON.exists():
        _found = VllmPython(
            None, f"no vLLM: {ENV_VAR} is unset and {DEFAULT_PYTHON} does not exist (bash .ci/vllm.sh builds it)", False
        )
        return _found
    try:
        probe = subprocess.run(
            [candidate, "-c", "import importlib.metadata as m, vllm; print(m.version('vllm-cpu'))"],
            capture_output=True,
            text=True,
            timeout=180,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        _found = VllmPython(None, f"no vLLM: {candidate} cannot run: {exc!r}", bool(named))
        return _found
    if probe.returncode != 0:
        tail = probe.stderr.strip().splitlines()[-1:] or ["(no output)"]
        _found = VllmPython(None, f"no vLLM: `import vllm` fails under {candidate}: {tail[0]}", bool(named))
        return _found
    _found = VllmPython(candidate, f"vllm-cpu {probe.stdout.strip()} under {candidate}", bool(named))
    return _found


def python_imports(python: str, module: str) -> str | None:
    """None when `module` imports under `python`, else the last line of the error."""
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    if probe.returncode == 0:
        return None
    return (probe.stderr.strip().splitlines()[-1:] or ["(no output)"])[0]


def make_tiny_model(python: str, out: Path) -> Path:
    """Write the tiny random model and its tokenizer to `out` (under vLLM's Python: torch lives there)."""
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    started = time.monotonic()
    done = subprocess.run(
        [python, str(MAKE_MODEL), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny model failed:\n{done.stderr[-3000:]}")
    TIMINGS.append(f"tiny model built in {time.monotonic() - started:.1f} s")
    return out


@dataclass
class Engine:
    """One vLLM engine subprocess (a process group of its own: API server, engine core, worker)."""

    name: str
    python: str
    model_dir: Path
    workdir: Path
    core: int  # VLLM_CPU_OMP_THREADS_BIND: the two engines of a pair get a core each
    hash_algo: str = "sha256"
    hash_seed: str | None = None  # PYTHONHASHSEED: vLLM's NONE_HASH seed (needed for xxhash)
    kv_events: bool = False
    kv_transfer_config: Mapping[str, Any] | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()  # more `vllm serve` flags
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    # the endpoints exactly as in the engine's --kv-events-config (vLLM binds "tcp://*:PORT")
    @property
    def events_endpoint(self) -> str:
        return f"tcp://*:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://*:{self.replay_port}"

    def command(self) -> list[str]:
        cmd = [
            self.python,
            str(LAUNCHER),
            "serve",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *COMMON_ARGS,
            "--prefix-caching-hash-algo",
            self.hash_algo,
        ]
        if self.kv_events:
            cmd += [
                "--kv-events-config",
                json.dumps(
                    {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": self.events_endpoint,
                        "replay_endpoint": self.replay_endpoint,
                        "topic": "kv-events",
                    }
                ),
            ]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer_config))]
        return cmd + list(self.extra_args)

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "CONDUCTOR_"))}
        env.pop("PYTHONHASHSEED", None)
        env.update(
            {
                "VLLM_TARGET_DEVICE": "cpu",  # the CPU platform, whatever the version string says
                "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
                "VLLM_CACHE_ROOT": str(self.workdir / "vllm-cache"),
                "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",  # no usage report leaves the machine
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
                "E2E_VLLM_PARENT_PID": str(os.getpid()),
            }
        )
        if self.hash_seed is not None:
            env["PYTHONHASHSEED"] = self.hash_seed
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.started_at = time.monotonic()
        # a new session: the API server, engine core and worker processes can be stopped together
        # (by stop(), or by launch_vllm.py itself should this test process die without its teardown)
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.environ(),
            cwd=self.workdir,
            start_new_session=True,
            preexec_fn=_yield_cpu,
        )
        log.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        # one client for every poll (httpx.get() would build one, and load the CA bundle, per call:
        # CPU taken from the engines starting beside it)
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"engine {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        self.ready_after_s = time.monotonic() - self.started_at
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise RuntimeError(f"engine {self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def restart(self, timeout_s: float = 420) -> None:
        """Stop the engine and start it again on the same ports with the same settings."""
        self.stop()
        self.start()
        self.wait_ready(timeout_s)
        TIMINGS.append(f"{self.name}: restarted, ready {self.ready_after_s:.1f} s after start")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass

    # ---- reading the engine ------------------------------------------------------------------

    def post(self, path: str, body: Mapping[str, Any], timeout: float = 120) -> dict[str, Any]:
        r = httpx.post(self.url + path, json=dict(body), timeout=timeout)
        assert r.status_code == 200, f"{self.name} {path}: {r.status_code} {r.text[:500]}"
        out: dict[str, Any] = r.json()
        return out

    def reset_prefix_cache(self, timeout: float = 60.0) -> None:
        """Empty the engine's prefix cache (VLLM_SERVER_DEV_MODE). vLLM refuses while any block is
        in use; a P/D producer keeps a finished request's blocks until the decode's NIXL
        notification that it has read them arrives, a moment after the answer, so try again."""
        answers: list[dict[str, Any]] = []

        def emptied() -> bool:
            answers.append(self.post("/reset_prefix_cache", {}))
            return answers[-1] == {"success": True}

        assert wait_for(emptied, timeout, interval=0.2), f"{self.name}: {answers[-1]}"

    def metric(self, name: str, **labels: str) -> float:
        """Sum of one metric's samples whose labels include `labels` (0 when none)."""
        return metric_sum(httpx.get(self.url + "/metrics", timeout=10).text, name, **labels)

    def prompt_tokens_by_source(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {
            src: metric_sum(text, "vllm:prompt_tokens_by_source_total", source=src)
            for src in ("local_compute", "local_cache_hit", "external_kv_transfer")
        }


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        have = dict(_LABEL.findall(m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def pd_connector(protocol: str, role: str, **extra: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """--kv-transfer-config and environment of one engine of a P/D pair on one CPU host; `extra`:
    the connector's kv_connector_extra_config. The connectors' documented setups, brought to
    loopback TCP: vLLM's NixlConnector usage guide (docs.vllm.ai, features/nixl_connector_usage)
    and Mooncake's "Disaggregated Prefill-Decode with MooncakeConnector"
    (kvcache-ai.github.io/Mooncake, deployment/integrations/vllm/disagg-prefill-decode); the
    variables are read in vllm/envs.py (VLLM_NIXL_SIDE_CHANNEL_HOST/_PORT, VLLM_MOONCAKE_BOOTSTRAP_PORT).
    vLLM 0.32 deprecates kv_both for NixlConnector (a warning in nixl/connector.py): producer and
    consumer it is."""
    if protocol == "nixl":
        config: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": role}
        if extra:
            config["kv_connector_extra_config"] = extra
        # the side channel's host as the engine advertises it in kv_transfer_params (vLLM's default
        # "localhost" leaves the address family to the resolver)
        return (
            config,
            {
                "VLLM_HOST_IP": "127.0.0.1",
                "UCX_TLS": "tcp,self,sm",
                "UCX_NET_DEVICES": "lo",
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            },
        )
    return (
        {
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp", **extra},
        },
        {
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port()),
            # the connector asks torch for the accelerator's index; launch_vllm.py answers 0 on a CPU torch
            "E2E_VLLM_CPU_DEVICE_INDEX": "1",
        },
    )


@dataclass
class MixedEngines:
    """Two mixed engines with KV events on, prefix caching with `hash_algo` and PYTHONHASHSEED HASH_SEED."""

    engines: dict[str, Engine]  # by gateway instance name: mixed-0, mixed-1
    hash_algo: str


def _yield_cpu() -> None:
    """In the engine's process, after its setsid: give way to the rest of the suite for CPU.

    With the kernel's autogroup scheduling (on by default, and on these machines), every session
    is a group with an equal share of the CPU, so ten engines in sessions of their own held ten
    shares against one for the whole pytest run: while they started, the other xdist worker's
    gateways, stand-ins and emulators were starved for tens of seconds (CI failed on 5 s connect
    timeouts, a first health probe, a 2 s stream stall; load average 25-60 on two cores). A nice
    of 10 on the session's group and on the process puts each engine at about a tenth of a share."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("10")
    except OSError:  # no autogroup (or not allowed): the process's own nice still applies
        pass
    os.nice(10)


def start_all(engines: Sequence[Engine], timeout_s: float = 420) -> None:
    """Start engines side by side and wait for all (the first start on a fresh box is the slow one)."""
    for e in engines:
        e.start()
    try:
        for e in engines:
            for attempt in range(3):
                try:
                    e.wait_ready(timeout_s)
                    break
                except RuntimeError:
                    # free_port() hands out a port that is free *now*; the other engine's processes
                    # bind ephemeral ports of their own meanwhile and can take it first
                    if attempt == 2 or "Address already in use" not in e.log_tail(200):
                        raise
                    e.stop()
                    e.port, e.events_port, e.replay_port = free_port(), free_port(), free_port()
                    TIMINGS.append(f"{e.name}: a port was taken before the engine bound it; restarted on new ports")
                    e.start()
    except BaseException:
        stop_all(engines)
        raise
    TIMINGS.extend(f"{e.name}: ready {e.ready_after_s:.1f} s after start" for e in engines)


def stop_all(engines: Iterable[Engine]) -> None:
    for e in engines:
        e.stop()


# ---- KV events, read independently of the gateway's decoder -----------------------------------


@dataclass
class EventLog:
    """What one engine's KV events say it holds: BlockStored adds, BlockRemoved and AllBlocksCleared take away."""

    held: set[int] = field(default_factory=set)
    stored: list[dict[str, Any]] = field(default_factory=list)  # every BlockStored, in order
    cleared: int = 0
    batches: int = 0
    last_seq: int | None = None
    gaps: int = 0
    restarts: int = 0  # the sequence went back: a new publisher, whose cache starts empty


class EventCollector:
    """A ZMQ SUB socket on an engine's KV events, on a thread of its own.

    Decodes the wire format with msgspec straight from vLLM's definition (three frames: topic,
    8-byte big-endian sequence number, msgpack EventBatch [ts, events, dp_rank] whose events are
    maps tagged by "type"), so a change there fails these tests even if the gateway's decoder
    were changed to match it.
    """

    def __init__(self, port: int, topic: str = "kv-events") -> None:
        self.port = port
        self.topic = topic
        self.log = EventLog()
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.connect(f"tcp://127.0.0.1:{port}")
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kv-events-{port}")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                self.errors.append(repr(exc))
                return
            try:
                self._apply(frames)
            except Exception as exc:  # recorded, and asserted empty by the tests
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def _apply(self, frames: list[bytes]) -> None:
        assert len(frames) == 3, f"{len(frames)} frames"
        topic, seq_bytes, payload = frames
        assert topic == self.topic.encode(), topic
        assert len(seq_bytes) == 8, seq_bytes
        seq = int.from_bytes(seq_bytes, "big")
        ts, events, *_rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and isinstance(events, list)
        with self._lock:
            log = self.log
            if log.last_seq is not None and seq <= log.last_seq:
                log.restarts += 1
                log.held.clear()
            elif log.last_seq is not None and seq != log.last_seq + 1:
                log.gaps += 1
            log.last_seq = seq
            log.batches += 1
            for ev in events:
                kind = ev["type"]
                if kind == "BlockStored":
                    assert all(isinstance(h, int) for h in ev["block_hashes"]), ev["block_hashes"]
                    log.stored.append(ev)
                    log.held.update(ev["block_hashes"])
                elif kind == "BlockRemoved":
                    log.held.difference_update(ev["block_hashes"])
                elif kind == "AllBlocksCleared":
                    log.held.clear()
                    log.cleared += 1

    def snapshot(self) -> EventLog:
        with self._lock:
            log = self.log
            return EventLog(set(log.held), list(log.stored), log.cleared, log.batches, log.last_seq, log.gaps, log.restarts)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()


# ---- prompts and answers ------------------------------------------------------------------------


def words(seed: int, n: int) -> str:
    """n words of the tiny vocabulary (w0..w479), a different sequence for each seed: every test
    writes prompts that no other test shares, so their blocks never meet in a cache."""
    return " ".join(f"w{(seed * 7919 + i * 104729 + (i * i) % 97) % 480}" for i in range(n))


def choice_outputs(answer: Mapping[str, Any]) -> list[tuple[int, str, list[int] | None, str | None]]:
    """(index, text, token ids, finish reason) of each choice, in index order: what must match."""
    out = []
    for c in sorted(answer["choices"], key=lambda c: c["index"]):
        text = c["message"]["content"] if "message" in c else c["text"]
        out.append((c["index"], text, c.get("token_ids"), c.get("finish_reason")))
    return out


def sse_events(raw: str) -> list[str]:
    """The data fields of a server-sent event stream, in order."""
    return [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]


def stream_result(raw: str) -> tuple[dict[int, str], dict[str, Any] | None, list[str]]:
    """(text per choice index, the usage chunk's usage, every data field) of a completions or chat stream."""
    data = sse_events(raw)
    texts: dict[int, str] = {}
    usage = None
    for item in data:
        if item == "[DONE]":
            continue
        chunk = json.loads(item)
        for c in chunk.get("choices") or []:
            piece = c.get("text")
            if piece is None:
                piece = (c.get("delta") or {}).get("content") or ""
            texts[c["index"]] = texts.get(c["index"], "") + piece
        if chunk.get("usage"):
            usage = chunk["usage"]
    return texts, usage, data
