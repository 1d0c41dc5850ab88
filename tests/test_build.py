"""The build cache on the CPU: keys without emitting, what changes a key, damaged entries, unusable folders.

The compile stage is replaced by a double that writes the entry's files (so no nvcc is
needed); ``test_launcher.py`` builds and loads real kernel libraries.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashgen import build as build_mod
from flashgen import cache
from flashgen.dsl.config import KernelConfig, default_configs

from ptxas_logs import LOG_SERIALIZED, LOG_SM80

REPO = Path(__file__).resolve().parents[1]
CFG = default_configs()[0]
SM90 = (9, 0)


class FakeCompiler:
    """Stands in for verify + emit + nvcc: writes ``<name>.cu`` and a ``<name>.so`` of known bytes."""

    def __init__(self, log: str = ""):
        self.calls = 0
        self.log = log  # what nvcc printed (ptxas's report)

    def __call__(self, cfg, name, capability, folder, final, mods=None):
        self.calls += 1
        (folder / f"{name}.cu").write_text(f"// {cfg.short_form()}\n")
        (folder / f"{name}.so").write_bytes(b"\x7fELF" + b"\0" * 4096)
        return self.log


@pytest.fixture
def compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHGEN_CACHE", str(tmp_path / "cache"))
    fake = FakeCompiler()
    monkeypatch.setattr(build_mod, "_compile", fake)
    return fake


def test_the_entry_keeps_ptxas_report_for_a_hit(monkeypatch, tmp_path):
    """What ptxas said about a build (spills, serialized wgmma) comes back with the kernel, built or found."""
    monkeypatch.setenv("FLASHGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build_mod, "_compile", FakeCompiler(LOG_SERIALIZED + LOG_SM80))
    built = build_mod.build(CFG, SM90)
    problems = built.register_problems()
    assert not built.cache_hit and len(problems) == 2
    assert "_ZN3foo6kernelENS_6ParamsE: 16 bytes of spill stores, 24 of spill loads, 16 of stack frame" in problems
    assert "_ZN3bwd6kernelENS_6ParamsE: wgmma serialized" in problems and not any("convert" in p for p in problems)
    hit = build_mod.build(CFG, SM90)
    assert hit.cache_hit and hit.ptxas == built.ptxas and hit.register_problems() == problems


def test_builds_say_what_ptxas_reported(monkeypatch, tmp_path, capsys):
    """A verbose build and the progress lines of ahead-of-time builds name a kernel's register problems."""
    monkeypatch.setenv("FLASHGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build_mod, "_compile", FakeCompiler(LOG_SM80))
    build_mod.build(CFG, SM90, verbose=True)
    assert "ptxas: _ZN3foo6kernelENS_6ParamsE: 16 bytes of spill stores, 24 of spill loads" in capsys.readouterr().err
    assert build_mod.build_jobs([(CFG, SM90)], workers=1) == {}  # one job runs here: the fake compile's entry, a hit
    line = capsys.readouterr().err
    assert "in the cache (ptxas: _ZN3foo6kernelENS_6ParamsE: 16 bytes of spill stores" in line


def test_a_clean_build_reports_no_problems(compiler):
    assert build_mod.build(CFG, SM90).register_problems() == []


def test_a_hit_neither_emits_nor_compiles(compiler, monkeypatch):
    first = build_mod.build(CFG, SM90)
    assert not first.cache_hit and compiler.calls == 1

    def no_emit(*args, **kwargs):
        raise AssertionError("emitted on a cache hit")

    monkeypatch.setattr("flashgen.build.emit", no_emit)
    again = build_mod.build(CFG, SM90)
    assert again.cache_hit and compiler.calls == 1 and again.directory == first.directory
    assert again.source().startswith("// " + CFG.short_form())  # the emitted source stays for inspection


def test_the_key_follows_the_config_and_the_arch():
    keys = {build_mod.cache_key(c, cap) for c in default_configs()[:3] for cap in ((8, 0), (8, 6), SM90)}
    assert len(keys) == 9
    assert build_mod.cache_key(CFG, SM90) == build_mod.cache_key(KernelConfig.from_dict(CFG.to_dict()), SM90)
    assert build_mod.cache_key(CFG, SM90) != build_mod.cache_key(CFG.replace(mask="causal"), SM90)


def _key_in_copy(root: Path, edit: "tuple[str, str] | None") -> str:
    """The cache key of CFG computed by a copy of the package at ``root``, after appending to one file."""
    if edit:
        path = root / "flashgen" / edit[0]
        path.write_text(path.read_text() + edit[1])
    code = ("import sys; from flashgen.build import cache_key; from flashgen.dsl.notation import parse_config; "
            "print(cache_key(parse_config(sys.argv[1]), (9, 0)))")
    out = subprocess.run([sys.executable, "-c", code, CFG.short_form()], cwd=root, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_the_key_changes_with_the_generator_source_and_nothing_else(tmp_path):
    shutil.copytree(REPO / "flashgen", tmp_path / "flashgen", ignore=shutil.ignore_patterns("__pycache__"))
    base = _key_in_copy(tmp_path, None)
    assert base == build_mod.cache_key(CFG, SM90)
    for outside in ("cli.py", "runtime.py", "bench.py"):
        assert _key_in_copy(tmp_path, (outside, "\n# a comment\n")) == base, outside
    assert _key_in_copy(tmp_path, ("emit/ptx/mma.py", "\n# a comment\n")) != base


def test_every_generator_package_counts(tmp_path):
    """Edits under each generator package change the key (checked on the fingerprint, no subprocess)."""
    shutil.copytree(REPO / "flashgen", tmp_path / "flashgen", ignore=shutil.ignore_patterns("__pycache__"))
    base = _key_in_copy(tmp_path, None)
    seen = {base}
    for package in build_mod.GENERATOR_PACKAGES:
        key = _key_in_copy(tmp_path, (f"{package}/__init__.py", "\n# an edit\n"))
        assert key not in seen, package
        seen.add(key)


@pytest.mark.parametrize("damage", ["truncate", "delete", "garble-record"])
def test_a_damaged_entry_is_reported_and_rebuilt(compiler, capsys, damage):
    built = build_mod.build(CFG, SM90)
    if damage == "truncate":
        built.library.write_bytes(built.library.read_bytes()[:100])
    elif damage == "delete":
        built.library.unlink()
    else:
        (built.directory / cache.DONE).write_text("{not json")
    again = build_mod.build(CFG, SM90)
    assert not again.cache_hit and compiler.calls == 2
    assert again.library.stat().st_size == 4100
    assert "damaged cache entry" in capsys.readouterr().err
    assert build_mod.build(CFG, SM90).cache_hit


def test_an_interrupted_build_leaves_no_entry(compiler, monkeypatch):
    def interrupted(*args, **kwargs):
        compiler(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(build_mod, "_compile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_mod.build(CFG, SM90)
    assert list(cache.root().iterdir()) == []
    monkeypatch.setattr(build_mod, "_compile", compiler)
    assert not build_mod.build(CFG, SM90).cache_hit


def test_an_unusable_cache_folder_is_refused_naming_flashgen_cache(monkeypatch, tmp_path, compiler):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FLASHGEN_CACHE", str(blocker / "cache"))  # a folder under a file cannot exist
    with pytest.raises(cache.CacheError, match="FLASHGEN_CACHE") as err:
        build_mod.build(CFG, SM90)
    assert str(blocker / "cache") in str(err.value)


def test_a_prebuilt_read_only_cache_is_enough_for_a_hit(compiler, monkeypatch):
    built = build_mod.build(CFG, SM90)

    def no_write(*args, **kwargs):
        raise AssertionError("a hit wrote to the cache")

    monkeypatch.setattr(cache, "writable_root", no_write)
    monkeypatch.setattr(cache, "staging", no_write)
    assert build_mod.build(CFG, SM90).directory == built.directory


def test_a_wgmma_kernel_is_refused_for_other_gpus():
    with pytest.raises(build_mod.BuildError, match="needs compute capability 9.0"):
        build_mod.build(KernelConfig.wgmma("bf16"), (8, 0))
    with pytest.raises(build_mod.BuildError, match=r"needs compute capability 8\.0 \(sm_80\) or newer, not 7\.5"):
        build_mod.build(CFG, (7, 5))


# ---- flashgen build ---------------------------------------------------------------------------


def test_build_command_refuses_what_it_cannot_build(capsys, monkeypatch, tmp_path):
    from flashgen.cli import main

    monkeypatch.setenv("FLASHGEN_CACHE", str(tmp_path / "cache"))
    assert main(["build", "hopper", "--arch", "sm_80"]) == 1
    assert "nothing to build for sm_80" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["build", "defaults", "--arch", "sm_80", "-j", "0"])
    assert exit_.value.code == 2 and "must be at least 1" in capsys.readouterr().err
    monkeypatch.setattr(build_mod, "_current_capability", lambda: (_ for _ in ()).throw(build_mod.BuildError("no GPU")))
    assert main(["build", "defaults"]) == 1
    assert "name the target with --arch" in capsys.readouterr().err


@pytest.mark.nvcc
def test_build_command_fills_the_cache_ahead_of_time(capsys, monkeypatch, tmp_path, nvcc):
    from flashgen.cli import main

    monkeypatch.setenv("FLASHGEN_CACHE", str(tmp_path / "cache"))
    cfgs = default_configs()[:2]
    short = [c.short_form() for c in cfgs]
    assert main(["build", *short, "hopper", "--arch", "sm_80", "-j", "2"]) == 0
    err = capsys.readouterr().err
    assert "skipped" in err and err.count("for sm_80: ") == 2  # the hopper set is not for sm_80: said once
    for cfg in cfgs:
        built = build_mod.build(cfg, (8, 0))
        assert built.cache_hit and built.library.read_bytes()[:4] == b"\x7fELF"
        assert any(cfg.mangle() in e.function for e in built.ptxas)
        assert built.register_problems() == []  # nvcc's own report, kept: the shipped defaults compile clean
    assert main(["build", *short, "--arch", "sm_80", "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_compile_without_a_gpu_names_a_way_that_works(monkeypatch):
    torch = pytest.importorskip("torch")
    import flashgen

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(build_mod.BuildError, match=r"flashgen build CFG --arch sm_90a.*capability=\(9, 0\)") as err:
        flashgen.compile(CFG)
    assert "--arch" in str(err.value)
