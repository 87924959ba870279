"""The store tier against a real mooncake_master: objects put by an engine-like client are found."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from adapters.mooncake_store import MooncakeStoreProbe, MooncakeStoreSettings
from conductor.core.block_keys import VllmKeys
from conductor.core.errors import ConfigError
from tests.support.ci import require, require_import
from tests.support.ports import free_port


@pytest.fixture(scope="module")
def master() -> Iterator[tuple[str, str]]:
    # the test extra installs the wheel (Linux x86_64) and .ci/run its system libraries: under CI
    # a missing one fails the test
    binary = shutil.which("mooncake_master")
    require(binary is not None, "mooncake_master not installed (pip extra 'mooncake' or 'test', + libibverbs1)")
    assert binary is not None
    require_import("mooncake.store", "mooncake.store does not import (libibverbs1 and ibverbs-providers: bash .ci/apt.sh)")
    rpc, metrics, http = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={rpc}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={metrics}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}",
            "--default_kv_lease_ttl=5000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", rpc), timeout=0.2).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "mooncake_master did not start"
            time.sleep(0.05)
    try:
        yield f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_store_probe_reports_leading_blocks_put_into_a_real_store(master: tuple[str, str]) -> None:
    from mooncake.store import MooncakeDistributedStore

    rpc, metadata = master
    settings = MooncakeStoreSettings(master=rpc, metadata_server=metadata, key_scheme="vllm", model="tiny", timeout_s=5.0)
    probe = MooncakeStoreProbe(settings)
    await probe.start()
    # an engine-like writer with a segment of its own, naming objects as vLLM's store connector does
    writer = MooncakeDistributedStore()
    assert writer.setup("127.0.0.1", metadata, 32 << 20, 16 << 20, "tcp", "", rpc) == 0
    try:
        tokens = list(range(10 * 16))
        hashes = [d.hex() for d in VllmKeys(16, "sha256_cbor", "0").digests(tokens)]
        names = probe.object_names(hashes)
        assert names[0] == f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{hashes[0]}"
        assert await probe.leading_blocks(hashes) == 0
        for name in names[:4] + names[5:7]:  # block 4 missing: the usable prefix ends there
            assert writer.put(name, b"kv" * 64) == 0
        assert await probe.leading_blocks(hashes) == 4
        assert await probe.leading_blocks(hashes[5:]) == 2
    finally:
        writer.close()
        await probe.close()


def test_key_schemes() -> None:
    lm = MooncakeStoreProbe(MooncakeStoreSettings(key_scheme="lmcache", model="m", world_size=2), store=object())
    assert lm.object_names(["ab"]) == ["m@2@0@ab@bfloat16"]
    custom = MooncakeStoreProbe(MooncakeStoreSettings(key_scheme="custom", key_template="kv/{key}/{hash}"), store=object())
    assert custom.object_names(["ab"], [255]) == ["kv/00000000000000ff/ab"]
    with pytest.raises(ConfigError):
        MooncakeStoreProbe(MooncakeStoreSettings(key_scheme="custom", key_template="no-hash"))
