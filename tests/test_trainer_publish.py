"""Weight publishing: atomic versioned directories, checksums, keep-K, HTTP transport (real aiohttp)."""

from __future__ import annotations

import json
import os

import aiohttp
import pytest
import torch
from safetensors.torch import load_file

from asyncrl.core.weights import (
    ChecksumError,
    PublishError,
    WeightFileServer,
    download_weights,
    list_versions,
    sha256_file,
    verify_weights_dir,
    write_weights,
)


def _sd(seed: float):
    return {"a.weight": torch.full((3, 2), seed), "b.bias": torch.arange(4, dtype=torch.float32) + seed}


def test_write_weights_atomic_checksum_keep_last(tmp_path):
    for v in (1, 2, 3, 4):
        path, checksum = write_weights(tmp_path, v, _sd(v), {"model_type": "llama", "dtype": "float32"}, keep_last=2)
        assert path.name == f"v{v:06d}"
        assert checksum == sha256_file(path / "model.safetensors")
        verify_weights_dir(path, checksum)
    assert list_versions(tmp_path) == [3, 4]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind
    loaded = load_file(tmp_path / "v000004" / "model.safetensors")
    assert torch.equal(loaded["a.weight"], torch.full((3, 2), 4.0))
    assert json.loads((tmp_path / "v000004" / "config.json").read_text())["model_type"] == "llama"
    lines = (tmp_path / "v000004" / "SHA256SUMS").read_text().splitlines()
    assert sorted(line.split()[1] for line in lines) == ["config.json", "model.safetensors"]


def test_published_versions_are_immutable(tmp_path):
    write_weights(tmp_path, 1, _sd(1), {})
    with pytest.raises(PublishError, match="immutable"):
        write_weights(tmp_path, 1, _sd(2), {})
    with pytest.raises(PublishError, match=">= 0"):
        write_weights(tmp_path, -1, _sd(2), {})


def test_verify_detects_corruption_and_wrong_announcement(tmp_path):
    path, checksum = write_weights(tmp_path, 1, _sd(1), {})
    with pytest.raises(ChecksumError, match="announced"):
        verify_weights_dir(path, "0" * 64)
    with open(path / "model.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x7f")
    with pytest.raises(ChecksumError, match="model.safetensors has sha256"):
        verify_weights_dir(path)
    (path / "SHA256SUMS").unlink()
    with pytest.raises(ChecksumError, match="no SHA256SUMS"):
        verify_weights_dir(path)


async def test_http_transport_download_verifies_and_installs(tmp_path):
    src = tmp_path / "trainer"
    path, checksum = write_weights(src, 7, _sd(7), {"dtype": "float32"})
    server = WeightFileServer(src).start()
    try:
        uri = server.uri_for(7)
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/weights/latest") as r:
                assert (await r.json()) == {"version": 7, "uri": uri}
            async with s.get(server.url + "/weights/v000007/..%2Fetc") as r:
                assert r.status == 404
            async with s.get(server.url + "/weights/v000008/model.safetensors") as r:
                assert r.status == 404
        local = await download_weights(uri, checksum, tmp_path / "worker")
        assert local == tmp_path / "worker" / "v000007"
        verify_weights_dir(local, checksum)
        assert torch.equal(load_file(local / "model.safetensors")["b.bias"], _sd(7)["b.bias"])
        # already present and valid: reused
        assert await download_weights(uri, checksum, tmp_path / "worker") == local
        # a wrong announced checksum installs nothing
        with pytest.raises(ChecksumError, match="announced"):
            await download_weights(uri, "f" * 64, tmp_path / "other")
        assert list_versions(tmp_path / "other") == [] and not any((tmp_path / "other").iterdir())
        # a file changed on the server after SHA256SUMS was written is caught
        (path / "config.json").write_text("{}")
        with pytest.raises(ChecksumError, match="config.json: downloaded sha256"):
            await download_weights(uri, checksum, tmp_path / "third")
        with pytest.raises(ValueError, match="version directory"):
            await download_weights(server.url + "/weights/", checksum, tmp_path / "x")
    finally:
        server.stop()


def test_extra_files_are_checksummed_and_names_checked(tmp_path):
    path, _ = write_weights(tmp_path, 1, _sd(1), {}, extra_files={"tokenizer.json": b"{}"})
    assert (path / "tokenizer.json").read_bytes() == b"{}"
    assert "tokenizer.json" in (path / "SHA256SUMS").read_text()
    for bad in ("../evil", ".hidden", "SHA256SUMS", "model.safetensors"):
        with pytest.raises(PublishError, match="not allowed"):
            write_weights(tmp_path, 2, _sd(2), {}, extra_files={bad: b"x"})
        assert list_versions(tmp_path) == [1] and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


async def test_http_transport_requires_the_bearer_token(tmp_path):
    """With ``security.api_key`` the weight server answers 401 to a request without the token or
    with a wrong one (and no file is installed); the rollout server's download sends it."""
    from pydantic import SecretStr

    src = tmp_path / "trainer"
    _, checksum = write_weights(src, 3, _sd(3), {})
    server = WeightFileServer(src, api_key=SecretStr("s3cret-token")).start()
    try:
        uri = server.uri_for(3)
        async with aiohttp.ClientSession() as s:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"}):
                for path in ("/weights/latest", "/weights/v000003/model.safetensors"):
                    async with s.get(server.url + path, headers=headers) as r:
                        assert r.status == 401, (headers, path)
                        assert "s3cret" not in await r.text()
        with pytest.raises(aiohttp.ClientResponseError, match="401"):
            await download_weights(uri, checksum, tmp_path / "no-key")
        with pytest.raises(aiohttp.ClientResponseError, match="401"):
            await download_weights(uri, checksum, tmp_path / "bad-key", api_key="wrong")
        assert not list_versions(tmp_path / "no-key") and not list_versions(tmp_path / "bad-key")
        local = await download_weights(uri, checksum, tmp_path / "worker", api_key=SecretStr("s3cret-token"))
        verify_weights_dir(local, checksum)
    finally:
        server.stop()


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_http_weight_server_refuses_every_interface(tmp_path, host):
    with pytest.raises(ValueError, match="weight_sync.http_host"):
        WeightFileServer(tmp_path, host=host)
