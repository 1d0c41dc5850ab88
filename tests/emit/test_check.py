"""flashgen.check without a GPU: ptxas report parsing, failures with a repro command, tables.

A stand-in ``nvcc`` (a shell script named by ``$FLASHGEN_NVCC``) replays fixed ptxas
output or fails, so these run where no CUDA toolkit is installed.
"""
from __future__ import annotations

import json
import re
import shlex
import stat
from pathlib import Path

import pytest

from flashgen import check
from flashgen.check import CheckError, check_configs, format_table
from flashgen.ptxas import parse_ptxas

from ptxas_logs import LOG_BACKWARD_STATIC, LOG_SERIALIZED, LOG_SERIALIZED_READ, LOG_SM80, LOG_SM90  # tests/ is on sys.path (pytest's prepend mode)
from flashgen.dsl.notation import parse_config

CFG = parse_config("(FP16, 128, 64, 64, 4): async+load_0_0_0_tiles")

def test_parse_ptxas_entry_with_spills():
    (s,) = parse_ptxas(LOG_SM80)
    assert s.function == "_ZN3foo6kernelENS_6ParamsE"
    assert (s.registers, s.spill_stores, s.spill_loads, s.stack_frame, s.static_smem, s.barriers) == (255, 16, 24, 16, 0, 1)
    assert not s.clean


def test_parse_ptxas_ignores_device_functions_and_reads_static_smem():
    (s,) = parse_ptxas(LOG_SM90)
    assert (s.function, s.registers, s.spill_stores, s.stack_frame, s.static_smem) == ("k", 6, 0, 0, 400)
    assert s.clean




def test_parse_ptxas_marks_the_entry_whose_wgmma_ptxas_serialized():
    """sm_90a's C7512 remark names its function before that function's report: without local memory the kernel
    is still slow, and the table says so."""
    from flashgen.check import CheckResult
    from flashgen.ptxas import combined

    kernel, convert = parse_ptxas(LOG_SERIALIZED)
    assert kernel.serialized and kernel.clean and not convert.serialized
    assert combined([kernel, convert]).serialized and not combined([convert]).serialized
    res = CheckResult(CFG, "sm_90a", True, combined([kernel, convert]), Path("k.cu"), "nvcc", LOG_SERIALIZED, 0.0)
    assert "WGMMA SERIALIZED" in format_table([res]) and res.to_dict()["wgmma_serialized"] is True
    assert not parse_ptxas(LOG_SM90)[0].serialized


def test_parse_ptxas_marks_wgmma_serialized_for_any_reason_ptxas_gives():
    """C7514 (an instruction reading an in-flight accumulator) serializes the wgmma as C7512 does; an injected wait
    (C7517) alone does not, and an entry the remark does not name stays unmarked."""
    kernel, convert = parse_ptxas(LOG_SERIALIZED_READ)
    assert "C7514" in LOG_SERIALIZED_READ and kernel.serialized and not convert.serialized
    only_wait = "\n".join(line for line in LOG_SERIALIZED_READ.splitlines() if "C7514" not in line)
    assert not any(s.serialized for s in parse_ptxas(only_wait))


def test_the_shared_memory_per_block_is_the_main_kernels_not_the_sum_with_another_entrys_static_bytes():
    """A backward's dQ conversion keeps 40960 static bytes and launches without dynamic shared memory: a main
    kernel near the limit (the deterministic d_head 128 backward, whose dQ is staged) still fits, where the table
    showed it 40960 bytes over, and the table names no static bytes the main kernel does not have. Static bytes of
    the main kernel itself do count."""
    from flashgen.check import CheckResult
    from flashgen.ptxas import combined
    from flashgen.dsl.backward_config import BackwardConfig

    cfg = BackwardConfig.wgmma("bf16", 128).replace(deterministic=True)
    assert cfg.smem_bytes + 40960 > 232448 >= cfg.smem_bytes, "the config fills most of an sm_90a block"
    entries = parse_ptxas(LOG_BACKWARD_STATIC)
    res = CheckResult(cfg, "sm_90a", True, combined(entries), Path("k.cu"), "nvcc", LOG_BACKWARD_STATIC, 0.0, entries=tuple(entries))
    assert (res.smem_bytes, res.main_static_smem, res.fits_smem) == (cfg.smem_bytes, 0, True)
    row = format_table([res])
    assert "SMEM >" not in row and "static" not in row
    main_static = LOG_BACKWARD_STATIC.replace("used 16 barriers", "used 16 barriers, 1024 bytes smem")
    entries = parse_ptxas(main_static)
    res = CheckResult(cfg, "sm_90a", True, combined(entries), Path("k.cu"), "nvcc", main_static, 0.0, entries=tuple(entries))
    assert (res.smem_bytes, res.main_static_smem) == (cfg.smem_bytes + 1024, 1024)


def test_parse_ptxas_nothing():
    assert parse_ptxas("") == [] and parse_ptxas("error: something\n") == []


def _fake_nvcc(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "nvcc"
    script.write_text("#!/bin/sh\n" 'if [ "$1" = "--version" ]; then echo "Cuda compilation tools, fake"; exit 0; fi\n' + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.fixture
def fake_ok(tmp_path, monkeypatch):
    log = tmp_path / "ptxas.txt"
    log.write_text(LOG_SM90)
    # the object file is the last argument: create it, print the report on stderr
    nvcc = _fake_nvcc(tmp_path, f'for a; do out="$a"; done\n: > "$out"\ncat {shlex.quote(str(log))} >&2\n')
    monkeypatch.setenv("FLASHGEN_NVCC", str(nvcc))
    return nvcc


@pytest.fixture
def fake_failing(tmp_path, monkeypatch):
    nvcc = _fake_nvcc(tmp_path, 'echo "kernel.cu(12): error: identifier \\"oops\\" is undefined" >&2\nexit 2\n')
    monkeypatch.setenv("FLASHGEN_NVCC", str(nvcc))
    return nvcc


def test_check_with_a_stand_in_compiler(fake_ok, tmp_path):
    res = check_configs([CFG], ("sm_80", "sm_90a"), jobs=2, workdir=tmp_path / "w")
    assert [(r.arch, r.ok) for r in res] == [("sm_80", True), ("sm_90a", True)]
    r = res[1]
    assert r.stats.registers == 6
    assert r.smem_bytes == CFG.smem_bytes + 400  # static (ptxas) + dynamic (config)
    argv = shlex.split(r.command)
    assert argv[0] == str(fake_ok)
    # the first arch compiles the host code too; the second the device code alone
    assert shlex.split(res[0].command)[1:7] == ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xptxas", "-v", "-c"]
    assert argv[1:7] == ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xptxas", "-v", "-cubin"]
    assert "-gencode=arch=compute_90a,code=sm_90a" in argv and str(r.cu_path) in argv
    assert r.cu_path.read_text() == check.source_of(CFG).text
    again = check_configs([CFG], ("sm_90a",), workdir=tmp_path / "w")
    assert again[0].cached and again[0].stats == r.stats
    fresh = check_configs([CFG], ("sm_90a",), workdir=tmp_path / "w", use_cache=False)
    assert not fresh[0].cached
    table = format_table(res)
    assert CFG.short_form() in table and "sm_80" in table and "sm_90a" in table
    assert "regs" in table.splitlines()[0] and "spill st" in table.splitlines()[0]


def test_a_failing_compile_is_a_result_with_its_repro(fake_failing, tmp_path):
    (r,) = check_configs([CFG], ("sm_80",), workdir=tmp_path / "w")
    assert not r.ok and r.stats is None
    report = check.failure_report(r)
    assert str(r.cu_path) in report and r.command in report and "oops" in report
    assert "-gencode=arch=compute_80,code=sm_80" in r.command
    assert "FAILED" in format_table([r])
    assert json.loads(json.dumps(r.to_dict()))["ok"] is False


def test_missing_nvcc_and_unknown_arch(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHGEN_NVCC", str(tmp_path / "no-nvcc"))
    with pytest.raises(CheckError, match="nvcc not found"):
        check_configs([CFG], ("sm_80",), workdir=tmp_path)
    monkeypatch.delenv("FLASHGEN_NVCC")
    with pytest.raises(CheckError, match="unknown arch 'sm_75'"):
        check_configs([CFG], ("sm_75",), workdir=tmp_path)


def test_cli_fail_on_spill(tmp_path, monkeypatch, capsys):
    from flashgen.cli import main

    log = tmp_path / "ptxas.txt"
    log.write_text(LOG_SM80)
    nvcc = _fake_nvcc(tmp_path, f'for a; do out="$a"; done\n: > "$out"\ncat {shlex.quote(str(log))} >&2\n')
    monkeypatch.setenv("FLASHGEN_NVCC", str(nvcc))
    args = ["check", CFG.short_form(), "--arch", "sm_80", "--workdir", str(tmp_path / "w")]
    assert main(args) == 0
    out, _ = capsys.readouterr()
    row = out.splitlines()[2].split()
    assert row[-6:] == ["16", "24", "16", str(CFG.smem_bytes), "LOCAL", "MEMORY"]  # spill st/ld, stack, smem, status
    assert "LOCAL MEMORY" in out
    assert main(args + ["--fail-on-spill"]) == 1
    assert "use local memory" in capsys.readouterr().err


def test_cli_says_which_configs_an_arch_cannot_take(fake_ok, tmp_path, capsys):
    from flashgen.cli import main

    wgmma = parse_config("(BF16, 64, 128, 64, 12): wgmma+stages_2+pingpong+intra+causal")
    args = ["check", CFG.short_form(), wgmma.short_form(), "--arch", "sm_80", "--workdir", str(tmp_path / "w")]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "1 config(s) not compiled for sm_80: wgmma kernels need sm_90a" in err
    rows = out.splitlines()[2:]
    assert len(rows) == 1 and rows[0].startswith(CFG.short_form())
    assert main(args + ["-v"]) == 0
    assert f"not compiled for sm_80: {wgmma.short_form()}: wgmma kernels need sm_90a" in capsys.readouterr().err


def test_a_kernel_over_an_archs_shared_memory_is_marked_for_that_arch(fake_ok, tmp_path):
    from flashgen.dsl.backward_config import BackwardConfig

    big = BackwardConfig("fp16", d_head=256, n_warps=8, d_split=2, stages=2)  # 205,824 bytes: above sm_80's 163 KiB
    res = {r.arch: r for r in check_configs([big], ("sm_80", "sm_90a"), workdir=tmp_path / "w")}
    assert not res["sm_80"].fits_smem and res["sm_90a"].fits_smem
    table = format_table(list(res.values()))
    assert f"SMEM > {res['sm_80'].smem_limit}" in table and table.count("SMEM >") == 1
    assert res["sm_80"].to_dict()["fits_smem"] is False and res["sm_90a"].to_dict()["smem_limit_bytes"] > big.smem_bytes


def test_cli_notes_a_kernel_that_cannot_launch_on_an_arch(fake_ok, tmp_path, capsys):
    from flashgen.cli import main

    big = "bwd(FP16, 256, 64, 64, 8): swizzled+d_split_2+stages_2"
    assert main(["check", big, "--arch", "sm_80", "sm_90a", "--workdir", str(tmp_path / "w")]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"needs \d+ bytes of shared memory per block; sm_80 gives \d+: it compiles but cannot launch there", err)
    assert "sm_90a gives" not in err
