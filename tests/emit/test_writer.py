"""The output folder: file names, manifest, replacement of the previous emit, atomicity.

These use small hand-made KernelSources (the writer only moves text), so they are fast;
tests/test_cli.py runs the same path end to end with real kernels.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flashgen.emit import writer
from flashgen.emit.source import KernelSource
from flashgen.emit.writer import MANIFEST, WriteError, check_output_folder, render, write_files


def fake(name: str, body: str = "") -> KernelSource:
    meta = {"name": name, "short_form": f"({name})", "config": {"dtype": "fp16"}, "hash": "0" * 16, "threads": 128,
            "smem_bytes": 1024, "grid": "(seq_q / 64, heads, batch)", "launcher": f"{name}_launch", "requires": {}}
    return KernelSource(name, f"// {name} kernel {body}\n", meta)


def tree(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_render_names_and_manifest():
    files = render([fake("k1"), fake("k0")])
    assert list(files) == ["k1.cu", "k0.cu", MANIFEST]
    doc = json.loads(files[MANIFEST])
    assert [k["name"] for k in doc["kernels"]] == ["k1", "k0"]  # emission order, not sorted
    k1 = doc["kernels"][0]
    assert k1["files"] == {"kernel": "k1.cu"}
    for field in ("short_form", "config", "hash", "threads", "smem_bytes", "grid", "launcher"):
        assert field in k1
    import hashlib

    assert k1["sha256"]["k1.cu"] == hashlib.sha256(files["k1.cu"]).hexdigest()
    text = files[MANIFEST].decode()
    assert text == json.dumps(doc, indent=2, sort_keys=True) + "\n"  # sorted keys, stable


def test_write_new_folder(tmp_path):
    out = tmp_path / "a" / "kernels"
    rep = write_files(render([fake("k0")]), out)
    assert tree(out).keys() == {"k0.cu", MANIFEST}
    assert set(rep.written) == set(tree(out)) and rep.unchanged == rep.removed == ()
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["kernels"]  # no temporary folder left


def test_rewrite_is_a_no_op_and_keeps_mtimes(tmp_path):
    files = render([fake("k0"), fake("k1")])
    write_files(files, tmp_path / "o")
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "o").iterdir()}
    rep = write_files(files, tmp_path / "o")
    assert rep.written == () and set(rep.unchanged) == set(files)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "o").iterdir()} == before


def test_a_new_emit_replaces_the_previous_one(tmp_path):
    out = tmp_path / "o"
    write_files(render([fake("k0"), fake("k1")]), out)
    (out / "README.md").write_text("kept")
    rep = write_files(render([fake("k1", "v2"), fake("k2")]), out)
    assert set(rep.removed) == {"k0.cu"}
    assert tree(out).keys() == {"k1.cu", "k2.cu", MANIFEST, "README.md"}
    assert b"v2" in (out / "k1.cu").read_bytes()
    assert {"k1.cu", "k2.cu"} <= set(rep.written)
    again = write_files(render([fake("k1", "v2"), fake("k2")]), out)
    assert not again.written and {"k1.cu", "k2.cu", MANIFEST} <= set(again.unchanged)


def test_foreign_files_need_force(tmp_path):
    out = tmp_path / "src"
    out.mkdir()
    (out / "main.cpp").write_text("mine")
    with pytest.raises(WriteError, match=r"did not write \(main.cpp\).*--force"):
        write_files(render([fake("k0")]), out)
    assert tree(out) == {"main.cpp": b"mine"}
    write_files(render([fake("k0")]), out, force=True)
    assert (out / "main.cpp").read_text() == "mine" and (out / "k0.cu").exists()


def test_not_a_folder(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(WriteError, match="not a folder"):
        write_files(render([fake("k0")]), f)
    with pytest.raises(WriteError, match="not a folder"):
        write_files(render([fake("k0")]), f / "sub")
    assert f.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_folder(tmp_path):
    out = tmp_path / "ro"
    write_files(render([fake("k0")]), out)
    before = tree(out)
    out.chmod(0o500)
    try:
        with pytest.raises(WriteError, match="not writable"):
            check_output_folder(out)
        with pytest.raises(WriteError):
            write_files(render([fake("k0", "new")]), out)
        assert tree(out) == before
    finally:
        out.chmod(0o700)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]


def test_unwritable_folder_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """The permission check itself, whoever runs the tests (root passes os.access for real)."""
    out = tmp_path / "ro"
    write_files(render([fake("k0")]), out)
    before = tree(out)
    real_access = os.access
    monkeypatch.setattr(writer.os, "access", lambda p, mode: False if Path(p) == out else real_access(p, mode))
    with pytest.raises(WriteError, match="not writable; nothing was written"):
        write_files(render([fake("k0", "new")]), out)
    with pytest.raises(WriteError, match=f"cannot create {out / 'sub'}: {out} is not writable"):
        write_files(render([fake("k0")]), out / "sub")
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]


def test_a_failed_move_restores_the_folder(tmp_path, monkeypatch):
    """os.replace fails on the third file: the two already moved are put back; nothing else changes."""
    out = tmp_path / "o"
    write_files(render([fake("k0"), fake("k1")]), out)
    before = tree(out)
    real_replace = os.replace
    calls = []

    def flaky_replace(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(writer.os, "replace", flaky_replace)
    with pytest.raises(WriteError, match="No space left on device.*nothing was changed"):
        write_files(render([fake("k0", "v2"), fake("k1", "v2"), fake("k9")]), out)
    monkeypatch.setattr(writer.os, "replace", real_replace)
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
