"""The knob table: every knob round-trips through the short form, dicts, YAML and the mangled name;
a knob or flag of another engine, and an unknown flag, are refused naming it; the CLI lists every knob."""
from __future__ import annotations

import pytest

from flashgen.cli import main
from flashgen.dsl import knobs
from flashgen.dsl.config import ConfigError, KernelConfig, load_config
from flashgen.dsl.notation import NotationError, parse_config

MMA = KernelConfig(dtype="fp16")
WG = KernelConfig.wgmma("fp16")
BASES = {knobs.MMA_SYNC: MMA, knobs.WGMMA: WG}

#: Per knob, valid configs in which it differs from its engine's base config (other knobs changed
#: only where a rule needs them). A new knob needs an entry: test_every_knob_has_variants says so.
VARIANTS: dict[str, list[KernelConfig]] = {
    "dtype": [MMA.replace(dtype="bf16"), WG.replace(dtype="bf16")],
    "d_head": [MMA.replace(d_head=64), WG.replace(d_head=64)],
    "B_r": [MMA.replace(B_r=64), WG.replace(B_r=64, n_warps=8, pingpong=False)],
    "B_c": [MMA.replace(B_c=32), WG.replace(B_c=64)],
    "n_warps": [MMA.replace(n_warps=8)],
    "async_copy": [MMA.replace(async_copy=False, eager_load_blocks=False)],
    "eager_load_blocks": [MMA.replace(eager_load_blocks=False)],
    "swizzled": [MMA.replace(swizzled=False)],
    "Q_mma_load_K_tiles": [MMA.replace(Q_mma_load_K_tiles=0)],
    "K_mma_load_K_tiles": [MMA.replace(Q_mma_load_K_tiles=0, K_mma_load_K_tiles=4)],
    "V_mma_load_K_tiles": [MMA.replace(V_mma_load_K_tiles=0), MMA.replace(V_mma_load_K_tiles=4, mma_double_buffer_loads=False)],
    "mma_double_buffer_loads": [MMA.replace(mma_double_buffer_loads=False)],
    "optimized_softmax": [MMA.replace(optimized_softmax=False)],
    "mask": [base.replace(mask=m) for base in (MMA, WG) for m in ("causal", "window")],
    "engine": [WG],
    "stages": [WG.replace(stages=1), WG.replace(stages=3)],
    "pingpong": [WG.replace(pingpong=False)],
    "intra_overlap": [WG.replace(intra_overlap=False)],
    "persistent": [WG.replace(persistent=True)],
}
CASES = [(name, cfg) for name, cfgs in VARIANTS.items() for cfg in cfgs]
ALL = list(BASES.values()) + [cfg for _, cfg in CASES]
SPECIFIC = [k for k in knobs.TABLE if not k.common]


def test_every_knob_has_variants():
    assert set(VARIANTS) == set(knobs.KNOB)


@pytest.mark.parametrize("name, cfg", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_knob_round_trips(name, cfg):
    base = MMA if name == "engine" else BASES[cfg.engine]
    assert getattr(cfg, name) != getattr(base, name)
    assert parse_config(cfg.short_form()) == cfg
    assert parse_config(str(cfg)).short_form() == cfg.short_form()
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert KernelConfig.from_yaml(cfg.to_yaml()) == cfg
    assert load_config(cfg.to_dict()) == load_config(cfg.short_form()) == cfg
    assert cfg.mangle().isidentifier() and cfg.mangle() != base.mangle()
    assert cfg.content_hash() != base.content_hash()


def test_names_and_hashes_tell_every_variant_apart():
    assert len({c.mangle() for c in ALL}) == len({c.content_hash() for c in ALL}) == len(set(ALL))


def test_dicts_list_the_knobs_of_the_engine():
    """mma.sync dicts (so the seed family's YAML and hashes) hold no wgmma knob; wgmma dicts hold all."""
    for cfg in ALL:
        d = cfg.to_dict()
        if cfg.engine == knobs.DEFAULT_ENGINE:
            assert "engine" not in d and all(k.name not in d for k in SPECIFIC if cfg.engine not in k.engines)
        else:
            assert list(d) == list(knobs.KNOB)


def _other_value(knob: knobs.Knob):
    return (not knob.off) if knob.type is bool else knob.off + 2


@pytest.mark.parametrize("knob", SPECIFIC, ids=lambda k: k.name)
def test_a_knob_of_another_engine_is_refused_naming_it(knob):
    owner = knobs.engine(knob.engines[0]).label
    for engine, base in BASES.items():
        if engine in knob.engines:
            continue
        value = _other_value(knob)
        for build in (lambda: base.replace(**{knob.name: value}),
                      lambda: KernelConfig.from_dict({**base.to_dict(), knob.name: value})):
            with pytest.raises(ConfigError) as err:
                build()
            assert f"{knob.name}={value!r} is " in str(err.value) and f"{owner} knob" in str(err.value)
            assert f"engine={engine} config fixes it at {knob.off!r}" in str(err.value)


def _engine_flags() -> dict[str, knobs.Spelled]:
    """Every engine-specific flag word that the variants write, with its spelling."""
    out = {}
    for cfg in ALL:
        for word in cfg.flags:
            group, _ = knobs.read_flag(word)
            if not group.common:
                out[word] = group
    return out


def test_the_variants_write_every_engine_specific_flag():
    assert {id(g.spelling) for g in _engine_flags().values()} == {id(k.flag) for k in SPECIFIC}


@pytest.mark.parametrize("word, group", _engine_flags().items(), ids=str)
def test_a_flag_of_another_engine_is_refused_naming_it(word, group):
    owner = knobs.engine(group.engines[0]).label
    for engine, base in BASES.items():
        if engine in group.engines:
            continue
        head, flags = base.short_form().split(": ")
        text = f"{head}: {flags}+{word}"
        with pytest.raises(NotationError) as err:
            parse_config(text)
        assert f"flag '{word}' needs the {owner} engine" in str(err.value)
        assert err.value.column == len(text) - len(word) + 1


@pytest.mark.parametrize("word", ["asyncx", "Async", "stages", "load_1_2_tiles", "mma_sync", "none", "pp", "fp16"])
def test_an_unknown_flag_is_refused_naming_it_and_the_valid_ones(word):
    with pytest.raises(NotationError) as err:
        parse_config(f"(FP16, 128, 128, 64, 4): load_2_2_2_tiles+{word}")
    assert f"unknown flag '{word}'" in str(err.value)
    valid = str(err.value).split("valid flags: ")[1].split("\n")[0].split(", ")
    assert valid == list(knobs.FLAG_WORDS)
    for cfg in ALL:  # every flag a config writes is among them (patterns by their shown name)
        assert all(knobs.read_flag(w)[0].words()[0] in valid for w in cfg.flags)


def test_cli_help_lists_every_knob(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for knob in knobs.TABLE:
        assert f" {knob.name} " in text, knob.name
        assert knob.help.split()[0] in text
    for word in knobs.FLAG_WORDS:
        assert word in text, word


def test_left_out_knobs_take_the_defaults_of_the_engine():
    """A dict naming only dtype (and the engine) gives the engine's base config; the short form's
    absent switches are false instead."""
    assert KernelConfig.from_dict({"dtype": "fp16"}) == MMA
    assert KernelConfig.from_dict({"dtype": "fp16", "engine": "wgmma"}) == WG
    assert WG.n_warps == 4 * (1 + WG.B_r // 64)
    bare = parse_config("(FP16, 128, 128, 128, 12): wgmma")
    assert (bare.stages, bare.pingpong, bare.intra_overlap, bare.persistent) == (1, False, False, False)
