"""simulate_config (flashgen.engines) / format_report: the CLI's two entry points."""
from __future__ import annotations

import json

import pytest

from flashgen.dsl.config import default_configs, kernel_progression, tuning_space
from flashgen.engines import simulate_config
from flashgen.sim.report import format_report

COPY_KEYS = {
    "name", "kind", "atom", "per", "instructions_per_warp", "wavefronts_per_warp", "ideal_wavefronts_per_warp",
    "conflict_ratio", "bytes_per_cta", "coverage",
}


@pytest.fixture(scope="module")
def results():
    return [simulate_config(kernel_progression()[0]), simulate_config(default_configs()[0].to_dict())]


def test_result_shape_and_json(results):
    first, default = results
    json.dumps(results)  # --json
    assert first["config"] == str(kernel_progression()[0]) and first["ok"] and default["ok"]
    assert [c["name"] for c in first["copies"]] == ["g2s_Q", "g2s_K", "g2s_V", "s2r_Q", "s2r_K", "s2r_V", "r2s_O", "s2g_O"]
    for c in first["copies"]:
        assert COPY_KEYS <= set(c) and c["coverage"]["ok"]
    assert first["fragments"]["S"]["ok"] and first["fragments"]["O"]["ok"]
    assert first["schedule"]["ok"] and first["schedule"]["hazards"] == []
    assert first["cta"]["ok"]
    assert first["verification"]["ok"] and "address split s2r_K" in first["verification"]["checks"]


def test_numbers(results):
    first, default = results
    by = {c["name"]: c for c in first["copies"]}
    # (FP16, 128, 64, 64, 4), unswizzled: 64x128 tile = 1024 chunks over 128 threads -> 8 per thread
    assert by["g2s_K"]["instructions_per_warp"] == 8 and by["g2s_K"]["bytes_per_cta"] == 64 * 128 * 2
    assert by["g2s_K"]["conflict_ratio"] == 1.0 and by["s2r_K"]["conflict_ratio"] == 8.0
    # K: (B_c/16) x (d_head/16) ldmatrix.x4 per warp, each warp reads the whole tile
    assert by["s2r_K"]["instructions_per_warp"] == 4 * 8 and by["s2r_K"]["bytes_per_cta"] == 4 * 64 * 128 * 2
    assert by["s2r_Q"]["per"] == "cta" and by["s2r_K"]["per"] == "kv_block"
    assert by["s2r_K"]["wavefronts_per_warp"] == 8 * by["s2r_K"]["ideal_wavefronts_per_warp"]
    assert all(c["conflict_ratio"] == 1.0 for c in default["copies"])  # swizzled


def test_redundant_barrier_note(results):
    first, default = results
    assert first["schedule"]["redundant_barriers"] == []  # the non-eager body's last barrier was removed
    assert default["schedule"]["redundant_barriers"] == []


def test_format_report(results):
    text = format_report(results)
    for needle in ("g2s_Q", "s2r_V", "8.00x", "1.00x", "fragments: ok", "schedule", "CTA forward pass: ok", str(default_configs()[0]),
                   "verification (9 proofs, flashgen.sim.verify): ok"):
        assert needle in text
    assert "FAILED" not in text


def test_report_without_cta_run():
    res = simulate_config(str(default_configs()[3]), cta=False)
    assert "cta" not in res and res["ok"]


def test_a_failed_proof_fails_the_report(monkeypatch):
    """Both engines' reports carry the verification step's verdict and name the failing check."""
    from flashgen.dsl.config import KernelConfig
    from flashgen.sim.verify import Check, Verification

    failing = Verification("cfg", (Check("p_from_s", ("thread 3 step 0 A register 1 half 0: wrong",)),))
    monkeypatch.setattr("flashgen.engines.verify_config", lambda cfg: failing)
    for cfg in (default_configs()[0], KernelConfig.wgmma("fp16", B_c=64)):
        res = simulate_config(cfg, cta=False)
        assert not res["ok"] and res["verification"] == failing.to_dict()
        text = format_report([res])
        assert "FAILED" in text and "p_from_s: thread 3 step 0 A register 1 half 0: wrong" in text


@pytest.mark.slow
def test_every_tuning_config_simulates_clean():
    bad = [r["config"] for r in map(simulate_config, tuning_space()) if not r["ok"]]
    assert not bad, bad


def test_hopper_report_checks_the_wave_tail_split(monkeypatch):
    """wgmma configs (masked ones aligned bottom-right) also run one tile as two merged parts against
    float64; mma.sync configs have no split to check; a wrong merge fails the report."""
    from flashgen.dsl.config import KernelConfig
    from flashgen.sim import hopper

    causal = KernelConfig.wgmma("bf16", persistent=True, mask="causal")
    res = simulate_config(causal)
    assert res["ok"] and res["split"]["ok"] and res["split"]["max_abs_err"] <= res["split"]["bound"]
    assert "wave-tail split (2 parts merged): ok - seq_q 101, seq_k 549" in format_report([res])
    grid = simulate_config(KernelConfig.wgmma("fp16"))  # one CTA per tile: a launch of few tiles splits too
    assert grid["split"]["ok"] and "split" not in simulate_config(default_configs()[0])

    real = hopper.simulate_split_tile

    def corrupted(plan, q, k, v, parts, *args, **kw):  # a merge gone wrong: every output off by a factor
        o, lse, rep = real(plan, q, k, v, parts, *args, **kw)
        return o ^ 0x0400, lse, rep  # one exponent bit of each 16-bit value flipped
    monkeypatch.setattr(hopper, "simulate_split_tile", corrupted)
    bad = simulate_config(causal)
    assert not bad["split"]["ok"] and not bad["ok"] and "wave-tail split (2 parts merged): FAILED" in format_report([bad])
