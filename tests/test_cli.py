"""The ``flashgen`` command line: help, emit (files, manifest, determinism, errors), check, delegation."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from procs import children, needs_proc, running, signal_masks, wait_for

from flashgen.cli import build_parser, main
from flashgen.dsl.config import KernelConfig
from flashgen.dsl.notation import parse_config

REPO = Path(__file__).resolve().parents[1]
SMALL = "(FP16, 128, 64, 64, 4): async+load_0_0_0_tiles"
COMMANDS = ("emit", "check", "simulate", "bench", "tune")

SWEEP = """\
# 4 combinations: Q=2 with K=0 is invalid, 3 kernels remain
dtype: fp16
B_r: 64
B_c: 64
Q_mma_load_K_tiles: [0, 2]
K_mma_load_K_tiles: [0, 2]
mma_double_buffer_loads: false
"""


def sweep_configs() -> list[KernelConfig]:
    base = dict(dtype="fp16", B_r=64, B_c=64, mma_double_buffer_loads=False)
    return [KernelConfig(**base, Q_mma_load_K_tiles=q, K_mma_load_K_tiles=k) for q, k in ((0, 0), (0, 2), (2, 2))]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def tree(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def assert_clean_error(rc: int, err: str, *words: str) -> None:
    assert rc != 0
    assert err.startswith("flashgen: error: ") or "\nflashgen: error: " in err, err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err


# ---- help ------------------------------------------------------------------------------------


def test_top_level_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("emit", "check", "simulate", "bench", "tune"):
        assert cmd in out
    assert "defaults, progression, progression-all, tuning-space" in " ".join(out.split())


@pytest.mark.parametrize("cmd", COMMANDS)
def test_subcommand_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: flashgen {cmd}")
    if cmd in ("emit", "check", "simulate"):
        assert "named set" in out
    if cmd == "emit":
        assert "--force" in out and "kernels_out" in out
    if cmd == "check":
        assert "--arch" in out and "sm_90a" in out and "--json" in out and "-j N" in out


def _help(capsys, *argv: str) -> str:
    """What ``flashgen ARGV --help`` prints, with argparse's line breaks undone."""
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # a break may follow a hyphen


@pytest.mark.parametrize("argv", [(), ("emit",), ("check",), ("simulate",)])
def test_help_lists_the_named_sets_of_the_registry(argv, capsys, monkeypatch):
    from flashgen.dsl import sets

    monkeypatch.setitem(sets.NAMED_SETS, "my-new-set", lambda: [])
    assert "defaults, progression, progression-all, tuning-space, hopper, backward, my-new-set" in _help(capsys, *argv)


def test_help_names_only_files_that_exist(capsys):
    text = " ".join(_help(capsys, *argv) for argv in [(), *((c,) for c in COMMANDS)])
    named = set(re.findall(r"[\w./-]+\.md\b|examples/[\w.-]+", text))  # documents, examples
    assert "examples/tuning_space.yaml" in named
    assert [f for f in named if not (REPO / f).exists()] == []


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    assert "usage: flashgen" in capsys.readouterr().err


# ---- emit ------------------------------------------------------------------------------------


def test_emit_sweep_writes_kernels_and_manifest(tmp_path, capsys):
    cfg_file = tmp_path / "sweep.yaml"
    cfg_file.write_text(SWEEP)
    out = tmp_path / "kernels"
    rc, stdout, err = run_cli(capsys, "emit", cfg_file, "-o", out, "-j", "1", "-v")
    assert rc == 0, err
    cfgs = sweep_configs()
    names = [c.mangle() for c in cfgs]
    assert set(tree(out)) == {f"{n}.cu" for n in names} | {"manifest.json"}
    doc = json.loads((out / "manifest.json").read_text())
    assert [k["name"] for k in doc["kernels"]] == names
    for cfg, k in zip(cfgs, doc["kernels"]):
        assert KernelConfig.from_dict(k["config"]) == cfg
        assert k["short_form"] == cfg.short_form() and k["hash"] == cfg.content_hash()
        assert k["threads"] == cfg.threads and k["smem_bytes"] == cfg.smem_bytes
        assert k["grid"] == "(ceil(seq_q / 64), heads, batch)"
        assert k["files"] == {"kernel": f"{cfg.mangle()}.cu"}
        text = (out / k["files"]["kernel"]).read_text()
        assert f'extern "C" int {k["launcher"]}(' in text and cfg.short_form() in text
    # what was written and (-v) each skipped combination, with its origin and reason
    for n in names:
        assert f"wrote {out / n}.cu" in stdout
    listed = stdout.split("skipped 1 combination(s):\n")[1].splitlines()
    assert f"{cfg_file}:2" in listed[0] and "Q_mma_load_K_tiles=2" in listed[0]
    assert "must equal the K tile count" in listed[0]
    assert listed[1].startswith("emitted ")  # one line per skipped combination, then the summary
    assert "3 kernel(s)" in stdout and "1 invalid combination(s) skipped" in stdout
    assert "emitting 3 kernel(s)" in err  # progress on stderr

    # again, in a fresh process with another hash seed: byte-identical output
    out2 = tmp_path / "again"
    env = dict(os.environ, PYTHONHASHSEED="4242")
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from flashgen.cli import main; sys.exit(main())",
         "emit", str(cfg_file), "-o", str(out2), "-j", "1", "-q"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert tree(out2) == tree(out)

    # and into the same folder: nothing changes
    rc, stdout, _ = run_cli(capsys, "emit", cfg_file, "-o", out, "-j", "1")
    assert rc == 0 and "wrote" not in stdout
    assert len([l for l in stdout.splitlines() if l.startswith("unchanged ")]) == 4  # three .cu files and the manifest


def test_emit_a_short_form_replaces_the_previous_emit(tmp_path, capsys):
    out = tmp_path / "k"
    assert run_cli(capsys, "emit", SMALL, "-o", out, "-j", "1")[0] == 0
    other = parse_config(SMALL).replace(swizzled=True)
    rc, stdout, _ = run_cli(capsys, "emit", other.short_form(), "-o", out, "-j", "1")
    assert rc == 0
    assert set(tree(out)) == {f"{other.mangle()}.cu", "manifest.json"}
    assert f"removed {out / parse_config(SMALL).mangle()}.cu" in stdout


def test_emit_with_mods_writes_their_kernels_and_describes_their_words(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "k"
    fwd, bwd = "(BF16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent", "bwd(BF16, 128, 64, 128, 12): wgmma+swizzled+stages_2"
    examples = REPO / "examples" / "mods.py"
    rc, stdout, _ = run_cli(capsys, "emit", fwd, bwd, "-o", out, "-j", "2",
                            "--score-mod", f"{examples}:alibi", "--mask-mod", f"{examples}:document_mask")
    assert rc == 0, stdout
    kernels = json.loads((out / "manifest.json").read_text())["kernels"]
    assert [k["kind"] for k in kernels] == ["forward", "backward"]
    suffixes = {k["name"].rsplit("_", 1)[1] for k in kernels}
    assert len(suffixes) == 1 and suffixes.pop().startswith("m")  # both built with the same mods
    for k in kernels:
        mods = k["mods"]
        assert "alibi" in mods["score_mod"] and "document_mask" in mods["mask_mod"]
        assert [w["variable"] for w in mods["mod_words"]] == ["slope", "doc"] and mods["n_mod_words"] == 4
        assert "score_mod_at(" in (out / k["files"]["kernel"]).read_text()
    plain = tmp_path / "plain"
    assert run_cli(capsys, "emit", fwd, "-o", plain, "-j", "1")[0] == 0
    assert "mods" not in json.loads((plain / "manifest.json").read_text())["kernels"][0]


@pytest.mark.parametrize("option, spec, words", [
    ("--score-mod", "examples/mods.py:document_mask", ["--score-mod", "takes 5 arguments"]),
    ("--mask-mod", "missing_file.py:fn", ["--mask-mod", "no file missing_file.py"]),
])
def test_emit_refuses_a_bad_mod_before_writing(option, spec, words, tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.chdir(REPO)
    out = tmp_path / "k"
    rc, _, err = run_cli(capsys, "emit", SMALL, "-o", out, option, spec)
    assert_clean_error(rc, err, *words)
    assert not out.exists()


@pytest.mark.parametrize(
    "text, words",
    [
        ("dtype: fp16\nB_r: [64, 128\n", ["invalid YAML", ":3:"]),
        ("dtype: fp16\nB_rr: 64\n", ["unknown config key 'B_rr'", ":2:", "valid keys"]),
        ("", ["empty"]),
        ("- 3\n", ["list item 1"]),
    ],
    ids=["bad-yaml", "unknown-key", "empty", "not-a-config"],
)
def test_emit_bad_files(text, words, tmp_path, capsys):
    f = tmp_path / "cfg.yaml"
    f.write_text(text)
    out = tmp_path / "out"
    rc, stdout, err = run_cli(capsys, "emit", f, "-o", out)
    assert_clean_error(rc, err, str(f), *words)
    assert not out.exists()


def test_emit_all_invalid_is_an_error(tmp_path, capsys):
    f = tmp_path / "cfg.yaml"
    f.write_text("dtype: fp16\nasync_copy: false\neager_load_blocks: true\nB_r: [64, 128]\n")
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "emit", f, "-o", out)
    assert_clean_error(rc, err, "no valid config", "all 2 combination(s) skipped", "2 eager_load_blocks needs async_copy")
    assert not out.exists()


@pytest.mark.parametrize(
    "arg, words",
    [
        ("(FP16, 128, 64, 4): eager+load_0_0_0_tiles", ["needs async_copy"]),
        ("(FP16, 128, 64, 4): turbo+load_0_0_0_tiles", ["unknown flag 'turbo'", "^"]),
        ("no-such-set", ["named set", "defaults"]),
        ("missing.yaml", ["no such config file"]),
    ],
)
def test_emit_bad_arguments(arg, words, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "emit", arg, "-o", tmp_path / "out")
    assert_clean_error(rc, err, *words)
    assert not (tmp_path / "out").exists()


def test_emit_unwritable_output(tmp_path, capsys):
    if os.geteuid() == 0:  # root writes through chmod: make the folder impossible instead
        blocker = tmp_path / "somefile"
        blocker.write_text("not a folder")
        out = blocker / "sub"
    else:
        out = tmp_path / "ro"
        out.mkdir()
        out.chmod(0o500)
    try:
        rc, stdout, err = run_cli(capsys, "emit", SMALL, "-o", out)
        assert_clean_error(rc, err, "cannot", "nothing was written")
        assert "wrote" not in stdout
    finally:
        if os.geteuid() != 0:
            out.chmod(0o700)
    if os.geteuid() == 0:
        assert blocker.read_text() == "not a folder"
    else:
        assert list(out.iterdir()) == []
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".flashgen-")]
    assert leftovers == []


def test_emit_refuses_a_foreign_folder_without_force(tmp_path, capsys):
    out = tmp_path / "src"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rc, _, err = run_cli(capsys, "emit", SMALL, "-o", out)
    assert_clean_error(rc, err, "notes.txt", "--force")
    assert tree(out) == {"notes.txt": b"mine"}


MIXED_SWEEP = """\
# 8 combinations: 4 without async_copy (eager needs it), 1 with Q=2, K=0; 3 kernels remain
dtype: fp16
B_r: 64
B_c: 64
async_copy: [false, true]
eager_load_blocks: true
Q_mma_load_K_tiles: [0, 2]
K_mma_load_K_tiles: [0, 2]
mma_double_buffer_loads: false
"""


def test_emit_counts_skipped_combinations_per_reason(tmp_path, capsys):
    f = tmp_path / "sweep.yaml"
    f.write_text(MIXED_SWEEP)
    rc, out, err = run_cli(capsys, "emit", f, "-o", tmp_path / "k", "-j", "1")
    assert rc == 0, err
    assert ("skipped 5 combination(s) (-v lists each):\n"
            "  4 eager_load_blocks needs async_copy\n"
            "  1 Q_mma_load_K_tiles, K_mma_load_K_tiles: a non-zero Q tile count must equal the K tile count\n") in out
    assert str(f) not in out  # no line per combination
    rc, out, _ = run_cli(capsys, "emit", f, "-o", tmp_path / "k", "-j", "1", "--verbose")
    listed = [line for line in out.splitlines() if line.startswith(f"  {f}:")]
    assert len(listed) == 5 and sum("async_copy=False" in line for line in listed) == 4


@pytest.mark.parametrize("cmd", ["emit", "simulate", "check"])
def test_quiet_leaves_stderr_to_errors(cmd, tmp_path, capsys, monkeypatch):
    f = tmp_path / "sweep.yaml"
    f.write_text(MIXED_SWEEP)  # skipped combinations (a note), 3 configs (progress)
    fake = types.ModuleType("flashgen.sim.report")
    fake.format_report = lambda reports: "REPORT"
    monkeypatch.setitem(sys.modules, "flashgen.sim.report", fake)
    monkeypatch.setattr("flashgen.engines.simulate_config", lambda cfg: {"name": cfg.mangle()})
    nvcc = tmp_path / "nvcc"  # prints a ptxas report and writes the object (the last argument)
    nvcc.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo fake; exit 0; fi\n'
                    'for a; do out="$a"; done\n: > "$out"\n'
                    "echo \"ptxas info    : Compiling entry function 'k' for 'sm_80'\" >&2\n"
                    "echo 'ptxas info    : Used 90 registers, 400 bytes smem' >&2\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("FLASHGEN_NVCC", str(nvcc))
    extra = {"emit": ["-o", tmp_path / "k"], "simulate": [], "check": ["--arch", "sm_80", "--workdir", tmp_path / "w"]}[cmd]
    rc, out, err = run_cli(capsys, cmd, f, "-j", "1", *extra) if cmd != "simulate" else run_cli(capsys, cmd, f)
    assert rc == 0 and "skipped 5" in out + err and "[3/3]" in err  # without -q: notes and progress
    rc, out, err = run_cli(capsys, cmd, f, "-q", *extra)
    assert rc == 0 and err == "" and out
    if cmd == "emit":
        assert out.splitlines() == [out.strip()] and out.startswith("emitted 3 kernel(s)")


@pytest.mark.parametrize("cmd", ["emit", "check"])
@pytest.mark.parametrize("jobs, words", [("0", "must be at least 1, got 0"), ("-3", "must be at least 1, got -3"),
                                         ("two", "expected a positive whole number, got 'two'")])
def test_jobs_must_be_a_positive_number(cmd, jobs, words, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, SMALL, "-o" if cmd == "emit" else "--workdir", str(tmp_path / "out"), "-j", jobs])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"flashgen {cmd}: error: argument -j/--jobs: {words}" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arg, close", [("default", "'defaults'"), ("hopper.yaml", "'hopper'")])
def test_a_near_miss_of_a_named_set_gets_a_suggestion(arg, close, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_cli(capsys, "emit", arg)
    assert_clean_error(rc, err, f"did you mean {close}?")


def _first_line_with(stream, text: str) -> str:
    for line in stream:
        if text in line:
            return line
    raise AssertionError(f"the command ended without printing {text!r}")


#: flashgen's command line with every kernel's emission made slow, so that a signal always finds the emit
#: running (a real one takes a few milliseconds: 192 are done before a signal sent at the first can arrive).
#: A spawned worker runs its parent's main file as ``__mp_main__``: the workers' emit is the slow one.
SLOW_EMIT_MAIN = """
import sys, time

import flashgen.emit.writer as writer

_emit = writer.emit_named


def _slow_emit(cfg, mods):
    time.sleep(%(seconds)r)
    return _emit(cfg, mods)


writer.emit_named = _slow_emit

if __name__ == "__main__":
    from flashgen.cli import main

    sys.exit(main())
"""


@needs_proc
@pytest.mark.parametrize("how, status, word", [("ctrl-c", 130, "interrupted"), ("sigterm", 143, "terminated")])
def test_a_signal_stops_a_parallel_emit_at_once(how, status, word, tmp_path):
    """Ctrl-C (SIGINT to the terminal's whole process group) or SIGTERM (to flashgen alone) in the
    middle of a 192-kernel emit (made to take 0.25 s a kernel: ~24 s in 2 processes): flashgen ends within a
    few seconds, with "flashgen: interrupted" or "terminated" last and no traceback, writes nothing and
    leaves no process behind."""
    sweep = tmp_path / "big.yaml"
    sweep.write_text((REPO / "examples" / "tuning_space.yaml").read_text().replace("prune: seed", "prune: none"))
    out = tmp_path / "out"
    cli = tmp_path / "slow_flashgen.py"
    cli.write_text(SLOW_EMIT_MAIN % {"seconds": 0.25})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # A Ctrl-C reaches a terminal's foreground job, whose SIGINT is not ignored; these tests may themselves run
    # as a background job of a script (`cmd &` ignores SIGINT), which flashgen would inherit and rightly keep.
    proc = subprocess.Popen([sys.executable, str(cli), "emit", str(sweep), "-j", "2", "-o", str(out)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL))
    watchdog = threading.Timer(60, proc.kill)  # the test fails rather than hangs
    watchdog.start()
    try:
        _first_line_with(proc.stderr, "] emitted ")  # the workers run
        workers = children(proc.pid)
        masks = signal_masks(proc.pid)
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert took < 3, f"took {took:.1f} s; signal masks when it was sent: {masks}; stderr:\n{err[-3000:]}"
    assert proc.returncode == status
    *before, last = err.splitlines()
    assert last == f"flashgen: {word}"
    assert all(re.fullmatch(r"flashgen: \[\d+/192\] emitted \w+", line) for line in before), err  # no traceback
    assert len(workers) >= 2
    assert wait_for(lambda: not any(running(p) for p in workers), timeout=2)
    assert not out.exists()


# ---- check -----------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["--fail-on-spill"], ["--json"]])
def test_check_refuses_an_arch_no_config_can_be_compiled_for(extra, capsys):
    rc, out, err = run_cli(capsys, "check", REPO / "examples" / "hopper.yaml", "--arch", "sm_80", *extra)
    assert_clean_error(rc, err, "nothing to compile for --arch sm_80", "wgmma kernels need sm_90a (2 config(s))")
    assert rc == 1 and out == ""


@pytest.mark.nvcc
def test_check_one_config(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "check", SMALL, "--arch", "sm_90a", "--workdir", tmp_path, "--json")
    assert rc == 0, err
    (res,) = json.loads(out)
    assert res["ok"] and res["arch"] == "sm_90a" and res["short_form"] == SMALL
    assert res["registers"] > 0 and res["spill_stores"] == 0 and res["stack_frame"] == 0
    assert res["smem_bytes"] == parse_config(SMALL).smem_bytes
    assert "[1/1] sm_90a" in err
    rc, out, _ = run_cli(capsys, "check", SMALL, "--arch", "sm_90a", "--workdir", tmp_path)  # cached: instant
    assert rc == 0
    header, rule, row = out.splitlines()
    assert header.split()[:3] == ["config", "arch", "regs"]
    assert row.startswith(SMALL) and f" {res['registers']} " in row and row.endswith("ok")


def test_check_failure_prints_source_and_command(tmp_path, capsys, monkeypatch):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo fake; exit 0; fi\n'
                    'echo "x.cu(3): error: expected a \\";\\"" >&2\nexit 1\n')
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("FLASHGEN_NVCC", str(nvcc))
    rc, out, err = run_cli(capsys, "check", SMALL, "--arch", "sm_80", "--workdir", tmp_path / "w")
    assert rc == 1
    assert "FAILED" in out
    assert "source:" in err and str(tmp_path / "w") in err and ".cu" in err
    assert f"reproduce: {nvcc} -O3 -std=c++17 --expt-relaxed-constexpr -Xptxas -v -c -gencode=arch=compute_80,code=sm_80" in err
    assert "error: expected" in err and "1 of 1 compile(s) failed" in err


def test_check_without_nvcc(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLASHGEN_NVCC", str(tmp_path / "absent"))
    rc, _, err = run_cli(capsys, "check", SMALL)
    assert_clean_error(rc, err, "nvcc not found")


# ---- simulate, bench, tune: delegation ---------------------------------------------------------


def test_simulate_delegates_to_the_simulator(monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("flashgen.sim.report")
    fake.format_report = lambda reports: "REPORT " + " ".join(r["name"] for r in reports)
    monkeypatch.setitem(sys.modules, "flashgen.sim.report", fake)
    monkeypatch.setattr("flashgen.engines.simulate_config", lambda cfg: seen.append(cfg) or {"name": cfg.mangle(), "conflicts": 0})
    rc, out, err = run_cli(capsys, "simulate", SMALL)
    assert rc == 0 and seen == [parse_config(SMALL)]
    assert out.strip() == f"REPORT {parse_config(SMALL).mangle()}"
    rc, out, _ = run_cli(capsys, "simulate", SMALL, "--json")
    assert json.loads(out) == [{"conflicts": 0, "name": parse_config(SMALL).mangle()}]


@pytest.mark.skipif(importlib.util.find_spec("flashgen.sim.report") is None, reason="flashgen.sim.report is not there yet")
def test_simulate_with_the_real_simulator(capsys):
    rc, out, err = run_cli(capsys, "simulate", SMALL, "--json")
    assert rc == 0, err
    (report,) = json.loads(out)
    assert isinstance(report, dict)


def test_simulate_a_wgmma_config(capsys, monkeypatch):
    """The wgmma engine's report: schedule hazards and a CTA with tails vs float64; a broken plan fails."""
    cfg = "(BF16, 64, 128, 64, 12): wgmma+stages_2+pingpong+intra+causal"
    rc, out, err = run_cli(capsys, "simulate", cfg, "--json")
    assert rc == 0, err
    (report,) = json.loads(out)
    assert report["engine"] == "wgmma" and report["schedule"]["ok"] and report["cta"]["ok"]
    assert report["cta"]["max_abs_err"] <= report["cta"]["bound"]
    # drop the wait for the previous block's V from the plan: the simulator must say so, the command must fail
    import attrs

    from flashgen.dsl import hopper_plan

    real = hopper_plan.make_hopper_plan

    def broken(c, mods=None):
        p = real(c, mods)
        return attrs.evolve(p, body=tuple(s for s in p.body if not (s.op == "wait_full" and s.arg == "V")))

    monkeypatch.setattr(hopper_plan, "make_hopper_plan", broken)
    rc, out, _ = run_cli(capsys, "simulate", cfg)
    assert rc == 1 and "hazard" in out and "[FAILED]" in out


@pytest.mark.parametrize("cmd, module", [("simulate", "flashgen.sim.report"), ("bench", "flashgen.bench"), ("tune", "flashgen.tune")])
def test_a_missing_module_is_a_clear_error(cmd, module, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)  # import raises ModuleNotFoundError
    rc, _, err = run_cli(capsys, cmd, SMALL)
    assert_clean_error(rc, err, f"'flashgen {cmd}' is not available", module)


def test_bench_and_tune_delegate(monkeypatch, capsys):
    calls = []
    for name in ("bench", "tune"):
        fake = types.ModuleType(f"flashgen.{name}")
        fake.add_arguments = lambda p: p.add_argument("--seqs", nargs="+", type=int)
        fake.main = lambda args, _n=name: calls.append((_n, args.seqs)) or 3
        monkeypatch.setitem(sys.modules, f"flashgen.{name}", fake)
    assert main(["bench", "--seqs", "512", "1024"]) == 3
    assert main(["tune", "--seqs", "4096"]) == 3
    assert calls == [("bench", [512, 1024]), ("tune", [4096])]
