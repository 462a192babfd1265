"""`pagedkv cache`: every kind of entry counted, `--prune` removing the
stale ones (other builds' compiles, kernel packages and RoPE tables, copies
of GGUFs that are gone, old leftovers) and nothing this version reads."""

from __future__ import annotations

import os
import time

from pagedkv.cli.main import main


def _write(path, data: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_prune_removes_what_this_version_never_reads_and_nothing_else(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    from pagedkv._ops.compile_cache import artifact_dir
    from pagedkv._ops.kernels import kernel_package_path
    from pagedkv.graphs.decoder import rope_dir

    kept = [
        artifact_dir() / "a.mef",
        kernel_package_path(),
        rope_dir() / "k.cos.npy",
        tmp_path / "models" / "m" / "m.gguf",
        # A leftover younger than an hour may still be written.
        artifact_dir() / "b.123.partial",
    ]
    stale = [
        tmp_path / "compiled" / "0" / "a.mef",
        tmp_path / "0" / "mojo_ops.mojoc",
        tmp_path / "rope" / "0" / "k.cos.npy",
        tmp_path / "rope" / "k.cos.npy",
        tmp_path / "unpacked" / "g-0" / "key" / "model.json",
        tmp_path / "models" / "m" / "m.unpacked" / "key" / "model.json",
    ]
    leftovers = [
        artifact_dir() / "c.123.partial",
        rope_dir() / ".k.sin.npy.123",
        tmp_path / "rope" / ".k.sin.npy.123",  # before the tables had a folder a version
    ]
    for i, path in enumerate(kept + stale + leftovers):
        _write(path, bytes(range(i + 1)))
    hour_ago = time.time() - 3700
    for path in leftovers:
        os.utime(path, (hour_ago, hour_ago))

    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    rows = {line[:17].strip(): line[17:].split() for line in out.splitlines()[2:-1]}
    # entries, MB, stale, stale MB
    assert rows["models"][0::2] == ["1", "0"]
    assert rows["compiled graphs"][0::2] == ["2", "1"]
    assert rows["kernel packages"][0::2] == ["2", "1"]
    assert rows["RoPE tables"][0::2] == ["3", "2"]
    assert rows["unpacked GGUFs"][0::2] == ["2", "2"]
    assert rows["leftovers"][0::2] == ["3", "3"]
    assert "`pagedkv cache --prune` removes the 9 stale entries" in out
    assert all(p.exists() for p in stale + leftovers)

    assert main(["cache", "--prune"]) == 0
    assert "removed 9 stale entries" in capsys.readouterr().out
    for i, path in enumerate(kept):
        assert path.read_bytes() == bytes(range(i + 1))
    assert not any(p.exists() for p in stale + leftovers)
    assert not (tmp_path / "compiled" / "0").exists()
    main(["cache"])
    assert "stale entries" not in capsys.readouterr().out


def test_a_cache_directory_not_made_yet_is_empty(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "none"))
    assert main(["cache", "--prune"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "removed 0 stale entries, 0.0 MB"
    assert not (tmp_path / "none").exists()
