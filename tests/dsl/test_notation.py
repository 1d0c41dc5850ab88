"""flashgen.dsl.notation: every notation round-trips through its str, and every
malformed or unbuildable text is refused with a message that says where and why."""
from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.dsl.config import (
    DEFAULTS,
    PROGRESSION,
    ConfigError,
    KernelConfig,
    kernel_progression,
    load_config,
    tuning_space,
)
from flashgen.dsl.layout import Layout
from flashgen.dsl.notation import (
    VALID_FLAGS,
    NotationError,
    parse_any_layout,
    parse_composed,
    parse_config,
    parse_layout,
    parse_swizzle,
)
from flashgen.dsl.swizzle import ComposedLayout, Swizzle

SEED_NAME = "(FP16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax"
VALID_FLAGS_TEXT = f"valid flags: {', '.join(VALID_FLAGS)}"


def _configs() -> list[KernelConfig]:
    return tuning_space() + kernel_progression(all_block_sizes=True)


# ---- short forms: round trips ------------------------------------------------------------


@pytest.mark.parametrize("text", PROGRESSION + DEFAULTS)
def test_seed_short_forms_reprint_identically(text):
    cfg = parse_config(text)
    assert cfg.short_form() == text
    assert str(cfg) == text
    assert parse_config(str(cfg)) == cfg


@pytest.mark.parametrize("cfg", _configs(), ids=str)
def test_enumerated_configs_round_trip(cfg):
    text = str(cfg)
    again = parse_config(text)
    assert again == cfg
    assert str(again) == text == cfg.short_form()


def test_enumerations_are_not_empty():
    assert len(tuning_space()) > 0
    assert len(kernel_progression(all_block_sizes=True)) > len(PROGRESSION)
    assert kernel_progression() == [parse_config(s) for s in PROGRESSION]


def test_seed_name_knobs():
    cfg = parse_config(SEED_NAME)
    assert cfg.to_dict() == {
        "dtype": "fp16",
        "d_head": 128,
        "B_r": 64,
        "B_c": 64,
        "n_warps": 4,
        "async_copy": True,
        "eager_load_blocks": True,
        "swizzled": True,
        "Q_mma_load_K_tiles": 0,
        "K_mma_load_K_tiles": 2,
        "V_mma_load_K_tiles": 2,
        "mma_double_buffer_loads": True,
        "optimized_softmax": True,
        "mask": "none",
    }


def test_absent_flags_are_false():
    cfg = parse_config("(BF16, 128, 64, 64, 4): load_0_0_0_tiles")
    assert cfg.flags == ("load_0_0_0_tiles",)
    assert not (cfg.async_copy or cfg.eager_load_blocks or cfg.swizzled)
    assert not (cfg.mma_double_buffer_loads or cfg.optimized_softmax)


def test_three_sizes_mean_d_head_128():
    cfg = parse_config("(BF16, 128, 64, 4): async+eager+swizzled+load_2_2_0_tiles+buffer+opt_softmax")
    assert (cfg.d_head, cfg.B_r, cfg.B_c, cfg.n_warps) == (128, 128, 64, 4)
    assert cfg == parse_config(DEFAULTS[3])
    assert str(cfg) == DEFAULTS[3]


def test_d_head_64_four_sizes():
    cfg = parse_config("(FP16, 64, 64, 64, 4): async+load_2_2_2_tiles")
    assert cfg.d_head == 64


@pytest.mark.parametrize(
    "text",
    [
        "(fp16,64,64,4):async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax",
        "  ( Fp16 , 128 , 64 , 64 , 4 ) :\tasync + eager + swizzled + load_0_2_2_tiles + buffer + opt_softmax  ",
        "(FP16, 128, 64, 64, 4):\n    async+eager+swizzled\n  + load_0_2_2_tiles+buffer+opt_softmax\n",
        "(FP16, 128, 64, 64, 4): opt_softmax+buffer+load_0_2_2_tiles+swizzled+eager+async",
    ],
)
def test_spacing_case_and_flag_order_do_not_matter(text):
    cfg = parse_config(text)
    assert cfg == parse_config(SEED_NAME)
    assert str(cfg) == SEED_NAME


def test_load_config_reads_short_forms():
    assert load_config(SEED_NAME) == parse_config(SEED_NAME)


# ---- short forms: syntax errors ----------------------------------------------------------


def _notation_error(parse, text) -> NotationError:
    with pytest.raises(NotationError) as info:
        parse(text)
    return info.value


@pytest.mark.parametrize(
    "text, line, column, words",
    [
        # missing opening paren
        ("FP16, 128, 64, 64, 4): async+load_0_0_0_tiles", 1, 1, ["unexpected 'FP16'", "expected '('"]),
        # missing closing paren
        ("(FP16, 128, 64, 64, 4: async+load_0_0_0_tiles", 1, 22, ["unexpected ':'", "expected ')'"]),
        ("(FP16, 128, 64, 64: async+load_0_0_0_tiles", 1, 19, ["expected ',' or ')'"]),
        # missing colon
        ("(FP16, 128, 64, 64, 4) async+load_0_0_0_tiles", 1, 24, ["unexpected 'async'", "expected ':'"]),
        # bad dtype
        ("(FP32, 128, 64, 64, 4): async+load_0_0_0_tiles", 1, 2, ["unknown dtype 'FP32'", "FP16 or BF16"]),
        ("(, 128, 64, 64, 4): load_0_0_0_tiles", 1, 2, ["unexpected ','", "expected a dtype"]),
        # two sizes, six sizes
        ("(FP16, 64, 64): load_0_0_0_tiles", 1, 14, ["unexpected ')'", "expected ','"]),
        ("(FP16, 128, 128, 64, 64, 4): load_0_0_0_tiles", 1, 24, ["unexpected ','", "expected ')'"]),
        # a size that is not an integer
        ("(FP16, 128, 6x4, 64, 4): load_0_0_0_tiles", 1, 14, ["unexpected 'x4'", "expected ','"]),
        # trailing '+', empty flags, leading '+'
        ("(FP16, 128, 64, 64, 4): async+load_0_0_0_tiles+", 1, 48, ["unexpected end of input", "expected a flag"]),
        ("(FP16, 128, 64, 64, 4):", 1, 24, ["unexpected end of input", "expected a flag"]),
        ("(FP16, 128, 64, 64, 4):   ", 1, 24, ["unexpected end of input", "expected a flag"]),
        ("(FP16, 128, 64, 64, 4): +async+load_0_0_0_tiles", 1, 25, ["unexpected '+'", "expected a flag"]),
        ("(FP16, 128, 64, 64, 4): async++load_0_0_0_tiles", 1, 31, ["unexpected '+'", "expected a flag"]),
        # empty text
        ("", 1, 1, ["unexpected end of input", "expected '('"]),
    ],
)
def test_malformed_short_forms(text, line, column, words):
    err = _notation_error(parse_config, text)
    assert (err.line, err.column) == (line, column)
    for w in words:
        assert w in str(err)
    assert isinstance(err, ValueError) and not isinstance(err, ConfigError)


@pytest.mark.parametrize(
    "flag, column",
    [
        ("swizzle", 31),
        ("asyncx", 31),
        ("opt", 31),
        ("ASYNC", 31),
        ("load_2_2_tiles", 31),
        ("load_a_b_c_tiles", 31),
        ("buffered", 31),
    ],
)
def test_unknown_flags_list_the_valid_ones(flag, column):
    text = f"(FP16, 128, 64, 64, 4): async+{flag}+load_0_0_0_tiles"
    err = _notation_error(parse_config, text)
    assert (err.line, err.column) == (1, column)
    assert f"unknown flag '{flag}' at column {column}; {VALID_FLAGS_TEXT}" in str(err)


def test_unknown_flag_on_a_later_line():
    err = _notation_error(parse_config, "(FP16, 128, 64, 64, 4):\n  async+\n  bogus")
    assert (err.line, err.column) == (3, 3)
    assert "unknown flag 'bogus' at line 3, column 3" in str(err)


@pytest.mark.parametrize(
    "flags, column, words",
    [
        ("async+async+load_0_0_0_tiles", 31, ["duplicate flag 'async'", "already given at column 25"]),
        ("async+load_0_0_0_tiles+opt_softmax+opt_softmax", 60, ["duplicate flag 'opt_softmax'"]),
        ("load_0_0_0_tiles+load_2_2_2_tiles", 42, ["duplicate flag 'load_2_2_2_tiles'", "'load_0_0_0_tiles'"]),
        ("load_2_2_2_tiles+load_2_2_2_tiles", 42, ["duplicate flag 'load_2_2_2_tiles'"]),
    ],
)
def test_duplicate_flags(flags, column, words):
    err = _notation_error(parse_config, f"(FP16, 128, 64, 64, 4): {flags}")
    assert (err.line, err.column) == (1, column)
    for w in words:
        assert w in str(err)


@pytest.mark.parametrize(
    "text, first, second",
    [
        ("(FP16, 128, 64, 64, 4): causal+window+load_0_0_0_tiles", "causal", "window"),
        ("(BF16, 64, 128, 64, 12): wgmma+window+stages_2+causal", "window", "causal"),
    ],
)
def test_causal_and_window_exclude_each_other(text, first, second):
    err = _notation_error(parse_config, text)
    assert (err.line, err.column) == (1, text.rindex(second) + 1)  # the caret under the second one
    assert f"{first} and {second} exclude each other" in str(err)
    assert "one score mask" in str(err) and "duplicate" not in str(err)


def test_a_mask_flag_twice_is_a_duplicate():
    err = _notation_error(parse_config, "(FP16, 128, 64, 64, 4): window+load_0_0_0_tiles+window")
    assert "duplicate flag 'window'" in str(err)


@pytest.mark.parametrize("flags", ["async", "async+eager+swizzled+buffer+opt_softmax"])
def test_missing_load_flag(flags):
    text = f"(FP16, 128, 64, 64, 4): {flags}"
    err = _notation_error(parse_config, text)
    assert (err.line, err.column) == (1, len(text) + 1)
    assert "missing load_Q_K_V_tiles flag" in str(err)
    assert "exactly once" in str(err)


def test_message_shows_the_text_with_a_caret():
    text = "(FP16, 128, 64, 64, 4): async+swizzle+load_0_0_0_tiles"
    lines = str(_notation_error(parse_config, text)).split("\n")
    assert lines[1] == "    " + text
    assert lines[2] == "    " + " " * 30 + "^"
    assert lines[3].startswith("  expected form: (DTYPE, d_head, B_r, B_c, n_warps): flag+flag+...")


def test_notation_error_pickles():
    err = _notation_error(parse_config, "(FP16, 64, 64): load_0_0_0_tiles")
    again = pickle.loads(pickle.dumps(err))
    assert (again.line, again.column, str(again)) == (err.line, err.column, str(err))


def test_not_a_string():
    with pytest.raises(TypeError, match="str"):
        parse_config(None)


# ---- short forms: well formed, but not a kernel that can be built ---------------------------


@pytest.mark.parametrize(
    "text, words",
    [
        ("(FP16, 128, 64, 64, 4): eager+load_0_0_0_tiles", ["eager_load_blocks=true needs async_copy=true"]),
        (
            "(FP16, 128, 64, 64, 4): async+load_2_4_0_tiles",
            ["Q_mma_load_K_tiles=2, K_mma_load_K_tiles=4", "must equal the K tile count"],
        ),
        ("(FP16, 128, 64, 64, 4): async+load_3_3_3_tiles", ["Q_mma_load_K_tiles=3", "power of two"]),
        ("(FP16, 128, 64, 64, 4): async+load_6_6_0_tiles", ["Q_mma_load_K_tiles=6", "power of two"]),
        ("(FP16, 128, 64, 64, 4): async+load_0_0_3_tiles", ["V_mma_load_K_tiles=3", "power of two"]),
        ("(FP16, 128, 64, 64, 4): async+load_16_16_0_tiles+buffer", ["Q_mma_load_K_tiles=16", "at most 8"]),
        ("(FP16, 128, 64, 60, 4): async+load_0_0_0_tiles", ["B_c=60"]),
        ("(BF16, 100, 64, 64, 4): async+load_0_0_0_tiles", ["d_head=100"]),
        ("(FP16, 128, 64, 64, 3): async+load_0_0_0_tiles", ["n_warps=3"]),
    ],
)
def test_unbuildable_configs_raise_config_error_naming_the_short_form(text, words):
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    msg = str(info.value)
    assert not isinstance(info.value, NotationError)
    assert f"invalid kernel config '{text}'" in msg
    for w in words:
        assert w in msg


def test_config_error_names_a_multiline_short_form_on_one_line():
    with pytest.raises(ConfigError, match=r"'\(FP16, 128, 64, 64, 4\): eager \+ load_0_0_0_tiles'"):
        parse_config("(FP16, 128, 64, 64, 4):\n  eager +\n  load_0_0_0_tiles")


# ---- layouts, swizzles, composed layouts -------------------------------------------------


LAYOUTS = [
    Layout(8, 1),
    Layout(1, 0),
    Layout((8,), (1,)),
    Layout((64, 128), (128, 1)),
    Layout((64, 128), (1, 64)),
    Layout(((8, 8), (64, 2)), ((64, 512), (1, 4096))),
    Layout((2, (3, (4, 5))), (0, (2, (6, 24)))),
    Layout(((2, 2), 8), ((1, 16), 2)),
    Layout((32, 4), (4, 1)),
]
SWIZZLES = [Swizzle(3, 3, 3), Swizzle(0, 4, 3), Swizzle(2, 4, 3), Swizzle(2, 4, -3), Swizzle(1, 0, 1), Swizzle(3, 4, 3)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_layout_round_trip(layout):
    assert parse_layout(str(layout)) == layout
    assert parse_any_layout(str(layout)) == layout


@pytest.mark.parametrize(
    "text, layout",
    [
        ("(64,128):(128,1)", Layout((64, 128), (128, 1))),
        ("((8,8),(64,2)):((64,512),(1,4096))", Layout(((8, 8), (64, 2)), ((64, 512), (1, 4096)))),
        ("8:1", Layout(8, 1)),
        ("(8):(1)", Layout((8,), (1,))),
        (" ( 64 , 128 ) :\n( 128 , 1 ) ", Layout((64, 128), (128, 1))),
    ],
)
def test_layout_texts(text, layout):
    assert parse_layout(text) == layout


@pytest.mark.parametrize("swizzle", SWIZZLES, ids=str)
def test_swizzle_round_trip(swizzle):
    assert parse_swizzle(str(swizzle)) == swizzle


@pytest.mark.parametrize("swizzle", SWIZZLES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS[3:6], ids=str)
def test_composed_round_trip(swizzle, layout):
    composed = ComposedLayout(swizzle, layout)
    assert parse_composed(str(composed)) == composed
    assert parse_any_layout(str(composed)) == composed


def test_composed_text():
    assert parse_composed("Sw<3,3,3> o (64,64):(64,1)") == ComposedLayout(Swizzle(3, 3, 3), Layout((64, 64), (64, 1)))
    assert parse_swizzle(" Sw < 2 , 4 , -3 > ") == Swizzle(2, 4, -3)
    assert isinstance(parse_any_layout("Sw<3,3,3> o 8:1"), ComposedLayout)
    assert isinstance(parse_any_layout("8:1"), Layout)


def _shapes() -> st.SearchStrategy:
    return st.recursive(
        st.integers(1, 64),
        lambda inner: st.lists(inner, min_size=1, max_size=3).map(tuple),
        max_leaves=8,
    )


@st.composite
def _layouts(draw) -> Layout:
    shape = draw(_shapes())

    def stride_like(s):
        if isinstance(s, int):
            return draw(st.integers(0, 1 << 16))
        return tuple(stride_like(e) for e in s)

    return Layout(shape, stride_like(shape))


@settings(max_examples=200, deadline=None)
@given(_layouts(), st.sampled_from(["", " ", "\n"]))
def test_layout_round_trip_hypothesis(layout, space):
    text = str(layout)
    assert parse_layout(text) == layout
    spaced = text.replace(",", f"{space},{space}").replace(":", f"{space}:{space}")
    assert parse_layout(spaced) == layout


@settings(max_examples=100, deadline=None)
@given(_layouts(), st.integers(0, 4), st.integers(0, 6), st.integers(0, 6), st.booleans())
def test_composed_round_trip_hypothesis(layout, b, m, extra, negative):
    s = b + extra
    swizzle = Swizzle(b, m, -s if negative else s)
    composed = ComposedLayout(swizzle, layout)
    assert parse_swizzle(str(swizzle)) == swizzle
    assert parse_any_layout(str(composed)) == composed


@pytest.mark.parametrize(
    "parse, text, line, column, words",
    [
        (parse_layout, "(64,128:(128,1)", 1, 8, ["unexpected ':'", "expected ',' or ')'"]),
        (parse_layout, "(64,128)(128,1)", 1, 9, ["unexpected '('", "expected ':'"]),
        (parse_layout, "(64,128):", 1, 10, ["unexpected end of input", "expected a non-negative integer or '('"]),
        (parse_layout, "(64,-1):(1,64)", 1, 5, ["unexpected '-'"]),
        (parse_layout, "(64,):(1,)", 1, 5, ["unexpected ')'"]),
        (parse_layout, "():()", 1, 2, ["unexpected ')'"]),
        (parse_layout, "8:1 o", 1, 5, ["unexpected 'o'", "expected end of input"]),
        (parse_layout, "Sw<3,3,3> o 8:1", 1, 1, ["unexpected 'Sw'"]),
        (parse_layout, "(64,128):\n(128;1)", 2, 5, ["unexpected ';'", "line 2, column 5"]),
        (parse_swizzle, "Sw<3,3>", 1, 7, ["unexpected '>'", "expected ','"]),
        (parse_swizzle, "Sw<3,-3,3>", 1, 6, ["unexpected '-'"]),
        (parse_swizzle, "Swizzle<3,3,3>", 1, 3, ["unexpected 'izzle'", "expected '<'"]),
        (parse_composed, "Sw<3,3,3> (64,64):(64,1)", 1, 11, ["unexpected '('", "expected 'o'"]),
        (parse_composed, "Sw<3,3,3> o", 1, 12, ["unexpected end of input"]),
        (parse_composed, "(64,64):(64,1)", 1, 1, ["unexpected '('", "expected 'Sw'"]),
        (parse_any_layout, "o 8:1", 1, 1, ["unexpected 'o'"]),
    ],
)
def test_malformed_layouts(parse, text, line, column, words):
    err = _notation_error(parse, text)
    assert (err.line, err.column) == (line, column)
    for w in words:
        assert w in str(err)


@pytest.mark.parametrize(
    "parse, text, line, column, words",
    [
        (parse_layout, "(64,2):1", 1, 1, ["invalid layout", "not congruent"]),
        (parse_layout, " (8,8):(1,(2,3))", 1, 2, ["invalid layout", "not congruent"]),
        (parse_layout, "(64,0):(1,64)", 1, 1, ["invalid layout", "shape entries must be >= 1"]),
        (parse_swizzle, "Sw<3,3,2>", 1, 1, ["invalid swizzle", "|S| >= B"]),
        (parse_composed, "Sw<3,3,3> o\n  (8,9):(1,2,3)", 2, 3, ["invalid layout", "line 2, column 3"]),
    ],
)
def test_well_formed_but_invalid_values(parse, text, line, column, words):
    err = _notation_error(parse, text)
    assert (err.line, err.column) == (line, column)
    for w in words:
        assert w in str(err)
