"""The backward kernels through the tools: ``flashgen emit / check / simulate / build`` of a backward
config (one of the ``backward`` set), and clear refusals where a forward config is needed."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from flashgen import build as build_mod
from flashgen import engines
from flashgen.cli import CommandError, main, resolve_configs
from flashgen.dsl import configs
from flashgen.dsl.config import ConfigError
from flashgen.dsl.sets import backward_configs
from flashgen.sim.verify import Check

CFG = backward_configs()[1]  # fp16, d_head 64, causal: the quickest to compile and simulate
NAME = CFG.short_form()


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_emit_writes_the_backward_kernels_and_their_manifest_entry(capsys, tmp_path):
    rc, out, _ = run_cli(capsys, "emit", NAME, "(FP16, 128, 64, 4): load_2_2_2_tiles", "-o", tmp_path / "out", "-j", "1")
    assert rc == 0 and "emitted 2 kernel(s)" in out
    backward, forward = json.loads((tmp_path / "out" / "manifest.json").read_text())["kernels"]
    assert (forward["kind"], backward["kind"]) == ("forward", "backward")
    assert configs.from_dict({"kind": backward["kind"], **backward["config"]}) == CFG
    assert (tmp_path / "out" / backward["files"]["kernel"]).read_text() == engines.emit(CFG).text
    assert backward["requires"]["mask"] == "causal" and backward["smem_bytes"] == CFG.smem_bytes


@pytest.mark.nvcc
def test_check_compiles_the_backward_kernels_and_reports_every_entry(capsys, tmp_path, nvcc):
    rc, out, _ = run_cli(capsys, "check", NAME, "--arch", "sm_80", "--json", "--workdir", tmp_path, "-q")
    (res,) = json.loads(out)
    assert rc == 0 and res["ok"] and res["short_form"] == NAME
    functions = res["functions"]
    assert len(functions) == 3  # preprocess, the main kernel, the dQ conversion
    assert res["registers"] == max(f["registers"] for f in functions)
    assert res["spill_stores"] == sum(f["spill_stores"] for f in functions)
    # the C symbols the manifest names are what the object file exports
    meta = engines.emit(CFG).meta
    obj = next(tmp_path.rglob("*.sm_80.o"))
    symbols = subprocess.run(["nm", "-g", "--defined-only", str(obj)], capture_output=True, text=True, check=True).stdout.split()
    assert meta["launcher"] in symbols and meta["workspace"] in symbols


def test_simulate_runs_the_backward_simulator(capsys):
    rc, out, _ = run_cli(capsys, "simulate", NAME, "--json", "-q")
    (rep,) = json.loads(out)
    assert rc == 0 and rep["ok"] and rep["kind"] == "backward" and rep["name"] == CFG.mangle()
    assert rep["coverage_ok"] and rep["verification"]["ok"] and rep["grads"]["ok"] and rep["schedule"]["ok"]
    assert {c["name"] for c in rep["copies"]} == {c.name for _, c in engines.kernels_of(CFG).make_plan(CFG).copies()}
    rc, text, _ = run_cli(capsys, "simulate", NAME, "-q")
    assert rc == 0 and "backward pass (dQ, dK, dV vs float64): ok" in text


def test_simulate_reports_the_split_scores_stores_per_query_block(capsys):
    name = "bwd(BF16, 128, 64, 64, 8): swizzled+d_split_4+split_scores+stages_2"
    rc, out, _ = run_cli(capsys, "simulate", name, "--json", "-q")
    (rep,) = json.loads(out)
    assert rc == 0 and rep["ok"] and rep["grads"]["ok"] and rep["schedule"]["ok"]
    per = {c["name"]: c["per"] for c in rep["copies"]}
    assert per["r2s_P"] == per["r2s_dS"] == per["s2r_Pt"] == "query_block" and per["r2s_dK"] == "cta"


def test_simulate_fails_a_backward_config_whose_proofs_fail(monkeypatch, capsys):
    monkeypatch.setattr("flashgen.sim.verify.backward_checks", lambda plan: (Check("address split g2s_Q", ("thread 3: off by 8",)),))
    engines.verify_config.cache_clear()
    try:
        rc, out, err = run_cli(capsys, "simulate", NAME, "-q")
    finally:
        engines.verify_config.cache_clear()
    assert rc == 1 and "address split g2s_Q: thread 3: off by 8" in out and f"simulation FAILED for {NAME}" in err


def test_the_build_key_names_the_kind(monkeypatch):
    forward_record = CFG.to_dict()  # what the key would hash without the kind
    monkeypatch.setattr(configs, "to_record", lambda cfg: forward_record)
    untagged = build_mod.cache_key(CFG, (8, 0))
    monkeypatch.undo()
    assert build_mod.cache_key(CFG, (8, 0)) != untagged


def test_a_backward_build_runs_the_proofs_first(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("flashgen.sim.verify.backward_checks", lambda plan: (Check("address split g2s_Q", ("broken",)),))
    monkeypatch.setattr(build_mod, "library_command", lambda *a: pytest.fail("compiled a kernel that fails verification"))
    engines.verify_config.cache_clear()
    try:
        with pytest.raises(build_mod.BuildError, match="failed verification, so it is not built"):
            build_mod.build(CFG, (8, 0))
    finally:
        engines.verify_config.cache_clear()


@pytest.mark.nvcc
def test_build_puts_a_backward_library_in_the_cache(capsys, monkeypatch, tmp_path, nvcc):
    monkeypatch.setenv("FLASHGEN_CACHE", str(tmp_path / "cache"))
    rc, out, err = run_cli(capsys, "build", NAME, "--arch", "sm_80", "-j", "1")
    assert rc == 0 and "1 of 1 kernel(s) in the cache" in out
    built = build_mod.build(CFG, (8, 0))
    assert built.cache_hit and built.library.read_bytes()[:4] == b"\x7fELF"
    record = json.loads(next(built.directory.glob("*.json")).read_text())
    assert configs.from_dict(record["config"]) == CFG


def test_forward_only_commands_refuse_backward_configs():
    first, more = re.escape(backward_configs()[0].short_form()), len(backward_configs()) - 1
    with pytest.raises(CommandError, match=rf"flashgen bench runs forward kernels; {first} \(and {more} more\) is a backward config"):
        resolve_configs(["defaults", "backward"], forward_only="flashgen bench")
    assert resolve_configs(["defaults"], forward_only="flashgen bench").configs


def test_compile_refuses_a_backward_config_clearly():
    import flashgen

    with pytest.raises(ConfigError, match=r"flashgen.compile runs forward attention; bwd\(.*run through autograd: compile a forward config"):
        flashgen.compile(CFG)
    with pytest.raises(ValueError, match="is a forward config; emit_backward takes a backward one"):
        engines.emit_backward("(FP16, 128, 64, 4): load_2_2_2_tiles")
