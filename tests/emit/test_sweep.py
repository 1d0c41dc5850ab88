"""Config files: one config, a list, a sweep; skipped combinations; errors with file and line."""
from __future__ import annotations

from pathlib import Path

import pytest

from flashgen.dsl.config import (
    ConfigError,
    KernelConfig,
    default_configs,
    is_tuning_candidate,
    kernel_progression,
    tuning_space,
)
from flashgen.dsl.notation import NotationError, parse_config
from flashgen.emit.sweep import SweepError, load_sweep, merge, parse_sweep, resolve

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BEST = "(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax"


def test_one_config_mapping():
    r = parse_sweep("dtype: bf16\nB_r: 64\nV_mma_load_K_tiles: 0\n")
    assert r.configs == (KernelConfig(dtype="bf16", B_r=64, V_mma_load_K_tiles=0),)
    assert r.skipped == () and r.duplicates == 0


def test_a_short_form_document_is_one_config():
    assert parse_sweep(f'"{BEST}"').configs == (parse_config(BEST),)


def test_sweep_is_the_product_of_the_lists_in_document_order():
    r = parse_sweep("B_c: [32, 64]\ndtype: [fp16, bf16]\nn_warps: 4\n")
    got = [(c.B_c, c.dtype.value) for c in r.configs]
    assert got == [(32, "fp16"), (32, "bf16"), (64, "fp16"), (64, "bf16")]  # first knob slowest


def test_invalid_combinations_are_skipped_with_the_rule():
    r = parse_sweep("dtype: fp16\nQ_mma_load_K_tiles: [0, 2]\nK_mma_load_K_tiles: [0, 2]\n", "s.yaml")
    assert [(c.Q_mma_load_K_tiles, c.K_mma_load_K_tiles) for c in r.configs] == [(0, 0), (0, 2), (2, 2)]
    (skip,) = r.skipped
    assert skip.knobs == {"dtype": "fp16", "Q_mma_load_K_tiles": 2, "K_mma_load_K_tiles": 0}
    assert skip.where == "s.yaml:1" and not skip.pruned
    assert "must equal the K tile count" in skip.reason
    assert "Q_mma_load_K_tiles=2" in skip.describe()


def test_bad_values_are_skipped_not_fatal():
    r = parse_sweep("dtype: [fp16, fp8]\nB_r: 128\n")
    assert len(r.configs) == 1
    assert "fp8" in r.skipped[0].reason


def test_list_of_mappings_sweeps_and_short_forms():
    text = f"""
- "{BEST}"
- dtype: bf16
  B_c: [32, 64]
- "(FP16, 128, 64, 4): eager+load_0_0_0_tiles"
- dtype: fp16          # the same as the first item
"""
    r = parse_sweep(text, "l.yaml")
    assert r.configs == (parse_config(BEST), KernelConfig(dtype="bf16", B_c=32), KernelConfig(dtype="bf16"))
    assert r.duplicates == 1
    (skip,) = r.skipped
    assert skip.where == "l.yaml:5" and "needs async_copy" in skip.reason
    assert skip.category == "eager_load_blocks needs async_copy"  # the rule, not the short form


def test_skips_by_one_rule_share_a_category_whatever_the_values():
    r = parse_sweep("dtype: fp16\nB_r: 64\nn_warps: [8, 16]\nmask: [diag, \"none\"]\n")
    assert len(r.skipped) == 4
    assert {s.category for s in r.skipped} == {"mask: expected one of none, causal, window",
                                               "B_r with n_warps: each warp owns B_r/n_warps rows, which must be "
                                               "a positive multiple of the MMA's 16 rows"}


def test_prune_seed_applies_the_tuning_heuristics_only():
    text = "dtype: fp16\nB_r: [64, 128]\nB_c: 64\nn_warps: [4, 8]\nQ_mma_load_K_tiles: [0, 2]\n"
    raw = parse_sweep(text)
    pruned = parse_sweep(text + "prune: seed\n")
    assert set(pruned.configs) == {c for c in raw.configs if is_tuning_candidate(c)}
    assert len(pruned.pruned) == len(raw.configs) - len(pruned.configs) > 0
    assert all("buildable" in s.reason for s in pruned.pruned)
    assert parse_sweep(text + "prune: none\n").configs == raw.configs


@pytest.mark.parametrize(
    "text, where, words",
    [
        ("", "x.yaml", "empty"),
        ("# only a comment\n", "x.yaml", "empty"),
        ("dtype: fp16\nB_r: [64, 128\n", "x.yaml:3", "invalid YAML"),
        ("dtype: fp16\n  B_r: 64\n", "x.yaml:2", "invalid YAML"),
        ("dtype: fp16\nB_rr: 64\n", "x.yaml:2", "unknown config key 'B_rr'"),
        ("- dtype: fp16\n- dtype: bf16\n  swizle: true\n", "x.yaml:3", "unknown config key 'swizle'"),
        ("dtype: fp16\ndtype: bf16\n", "x.yaml:2", "duplicate key 'dtype'"),
        ("42\n", "x.yaml", "expected a config mapping, a list of configs, or a sweep"),
        ("- 3\n", "x.yaml:1", "list item 1 is a number"),
        ("[]\n", "x.yaml:1", "empty"),
        ("dtype: fp16\nB_r: []\n", "x.yaml:2", "an empty list sweeps nothing"),
        ("dtype: fp16\nB_r: [[64]]\n", "x.yaml:2", "must be a scalar"),
        ("dtype: fp16\nB_r: {a: 1}\n", "x.yaml:2", "got a mapping"),
        ("dtype: fp16\nprune: yes-please\n", "x.yaml:2", "prune must be one of none, seed"),
        ("- '(FP16, 128, 64, 4): asyncx+load_0_0_0_tiles'\n", "x.yaml:1", "unknown flag 'asyncx'"),
        ("dtype: fp16\n---\ndtype: bf16\n", "x.yaml", "2 YAML documents"),
    ],
)
def test_malformed_files_are_errors_with_file_and_line(text, where, words):
    with pytest.raises(SweepError) as err:
        parse_sweep(text, "x.yaml")
    msg = str(err.value)
    assert msg.startswith(where + ":") or msg.startswith(where + " "), msg
    assert words in msg
    assert isinstance(err.value, ConfigError)  # the CLI reports both the same way


def test_load_sweep_file_errors(tmp_path):
    with pytest.raises(SweepError, match="no such config file"):
        load_sweep(tmp_path / "missing.yaml")
    with pytest.raises(SweepError, match="is a directory"):
        load_sweep(tmp_path)
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SweepError, match="UTF-8"):
        load_sweep(bad)


def test_resolve_named_sets_short_forms_and_files(tmp_path):
    assert list(resolve("defaults").configs) == default_configs()
    assert list(resolve("progression").configs) == kernel_progression()
    assert list(resolve("progression-all").configs) == kernel_progression(all_block_sizes=True)
    assert list(resolve("tuning-space").configs) == tuning_space()
    assert resolve(BEST).configs == (parse_config(BEST),)
    f = tmp_path / "one.yaml"
    f.write_text("dtype: bf16\n")
    assert resolve(str(f)).configs == (KernelConfig(dtype="bf16"),)
    with pytest.raises(SweepError, match="named set") as e:
        resolve("no-such-set")
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize(
    "text, close",
    [("default", "'defaults'"), ("tuning_space", "'tuning-space'"), ("Hopper", "'hopper'"),
     ("progresion", "'progression' or 'progression-all'"), ("hopper.yaml", "'hopper'")],
)
def test_resolve_suggests_close_named_sets(text, close, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no file of that name
    with pytest.raises(SweepError, match=f"did you mean {close}\\?$"):
        resolve(text)
    with pytest.raises(NotationError):
        resolve("(FP16, 128, 64, 4): nope")
    with pytest.raises(ConfigError, match="needs async_copy"):
        resolve("(FP16, 128, 64, 4): eager+load_0_0_0_tiles")


def test_merge_deduplicates_across_inputs():
    r = merge([resolve("defaults"), resolve(BEST), parse_sweep("dtype: [fp16, fp8]")])
    assert list(r.configs) == default_configs()
    assert r.duplicates == 2 and len(r.skipped) == 1


# ---- the shipped examples ------------------------------------------------------------------


def test_example_best_is_the_defaults():
    assert list(load_sweep(EXAMPLES / "best.yaml").configs) == default_configs()


def test_example_progression():
    r = load_sweep(EXAMPLES / "progression.yaml")
    assert list(r.configs) == kernel_progression() and r.skipped == ()


def test_example_tuning_space():
    r = load_sweep(EXAMPLES / "tuning_space.yaml")
    assert list(r.configs) == tuning_space()
    assert len(r.invalid) == 64 and len(r.pruned) == 112  # as its comment says
    assert len({s.category for s in r.invalid}) == len({s.category for s in r.pruned}) == 1
    assert len(r.invalid) + len(r.pruned) + len(r.configs) == 2**8


def test_example_tuning_space_without_pruning_keeps_every_valid_config():
    text = (EXAMPLES / "tuning_space.yaml").read_text().replace("prune: seed", "prune: none")
    r = parse_sweep(text)
    assert len(r.configs) == 192 and r.pruned == ()
    assert set(tuning_space()) < set(r.configs)


def test_example_hopper_is_the_sm90_default():
    from flashgen.tune import hopper_default

    r = load_sweep(EXAMPLES / "hopper.yaml")
    assert [c.is_wgmma for c in r.configs] == [True, True]
    assert list(r.configs) == [hopper_default(c.dtype, 128) for c in r.configs]
    assert [c.dtype.value for c in r.configs] == ["fp16", "bf16"]


def test_wgmma_knobs_sweep_and_default_like_the_constructor():
    from flashgen.emit.sweep import SweepError

    r = parse_sweep("engine: wgmma\ndtype: fp16\nstages: [2, 3]\npersistent: [false, true]\n")
    base = KernelConfig.wgmma("fp16")
    # B_c etc. as KernelConfig.wgmma; stages 3 + persistent is over the shared-memory limit: skipped, with why
    assert list(r.configs) == [base, base.replace(persistent=True), base.replace(stages=3)]
    assert len(r.skipped) == 1 and r.skipped[0].knobs == {"engine": "wgmma", "dtype": "fp16", "stages": 3, "persistent": True}
    assert "persistent=true stages the output apart from Q" in r.skipped[0].reason
    with pytest.raises(SweepError, match="unknown config key 'stage'"):
        parse_sweep("engine: wgmma\ndtype: fp16\nstage: 2\n")


def test_example_single():
    (cfg,) = load_sweep(EXAMPLES / "single.yaml").configs
    assert cfg == KernelConfig(dtype="fp16") == parse_config(BEST)


# ---- backward configs --------------------------------------------------------------------------


def test_a_kind_backward_mapping_sweeps_the_backward_knobs():
    from flashgen.dsl.backward_config import BackwardConfig

    r = parse_sweep("- {kind: backward, dtype: fp16, d_head: [64, 128, 264], mask: causal}\n"
                    "- 'bwd(BF16, 128, 64, 64, 4): swizzled'\n- {dtype: fp16}\n", "b.yaml")
    assert r.configs == (BackwardConfig("fp16", d_head=64, mask="causal"), BackwardConfig("fp16", d_head=128, mask="causal"),
                         BackwardConfig("bf16", d_head=128), KernelConfig("fp16"))
    (skip,) = r.skipped
    assert skip.where == "b.yaml:1" and skip.knobs["d_head"] == 264 and "d_head=264" in skip.reason


@pytest.mark.parametrize("text, words", [
    ("kind: backward\ndtype: fp16\nasync_copy: true\n", ["s.yaml:3", "unknown backward config key 'async_copy'", "swizzled"]),
    ("kind: backward\ndtype: fp16\nprune: seed\n", ["s.yaml:3", "a backward sweep has none"]),
    ("kind: sideways\ndtype: fp16\n", ["s.yaml:1", "kind must be one of forward, backward"]),
])
def test_a_backward_mapping_with_a_forward_key_is_an_error_with_its_line(text, words):
    with pytest.raises(SweepError) as err:
        parse_sweep(text, "s.yaml")
    for w in words:
        assert w in str(err.value)


def test_resolve_reads_the_backward_set_and_backward_names():
    from flashgen.dsl.sets import backward_configs

    assert list(resolve("backward").configs) == backward_configs()
    (cfg,) = resolve("bwd(FP16, 64, 128, 128, 8): swizzled+causal+d_split_2+split_scores+stages_2").configs
    assert cfg == backward_configs()[1]
