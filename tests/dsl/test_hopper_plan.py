"""The Hopper plan's objects against independent models: TMA placement (byte rule) vs the tile
layouts, descriptor reads (ISA address models) vs the tiles, the P-from-S table vs the fragment
maps, output staging banks, barrier/shared-memory placement, and the wgmma config notation.

References used here: ``flashgen.sim.hopper.tma_fill`` (written from the 128B-swizzle byte rule),
``descriptor_addresses`` / ``descriptor_addresses_mn`` (written from the ISA canonical layouts),
the PTX ISA fragment formulas restated below, and ``flashgen.sim.hardware``'s bank model.
"""
from __future__ import annotations

import functools
import hashlib
import json

import numpy as np
import pytest

from flashgen.dsl.atoms.hopper import SmemDescriptor, descriptor_addresses, descriptor_addresses_mn
from flashgen.dsl.config import (
    HOPPER_KNOBS, KNOBS, SMEM_LIMIT_BYTES, ConfigError, KernelConfig, default_configs, tuning_space,
)
from flashgen.dsl.hopper_plan import make_hopper_plan
from flashgen.dsl.steps import Guard
from flashgen.dsl.notation import parse_config
from flashgen.sim import hardware as hw
from flashgen.sim.hopper import tma_fill, tma_read
from flashgen.sim.layout_eval import offsets

W = KernelConfig.wgmma
CONFIGS = [
    W("fp16"),  # d128, B_c 128, 2 stages, pingpong + intra
    W("bf16", d_head=64, B_c=64, stages=1, pingpong=False, intra_overlap=False),
    W("fp16", d_head=256, B_c=64, stages=1, mask="causal"),
    W("bf16", d_head=64, B_c=176, stages=3, mask="window"),
    W("fp16", d_head=128, B_r=64, B_c=176, stages=2, pingpong=False),
    W("fp16", d_head=192, B_c=64, stages=2, intra_overlap=False),
    W("bf16", d_head=64, B_r=192, B_c=64, stages=3, pingpong=False),
    W("fp16", d_head=64, B_c=128, stages=4, pingpong=True, intra_overlap=False),
    W("bf16", persistent=True),  # the output tile apart from Q, a q_empty barrier
    W("fp16", B_c=160, persistent=True),  # the long-sequence default: 230 KB of shared memory
    W("fp16", d_head=64, B_c=176, stages=3, pingpong=False, intra_overlap=False, persistent=True, mask="causal"),
]
IDS = [c.mangle() for c in CONFIGS]


@functools.lru_cache(maxsize=None)
def _layout_elems(layout) -> np.ndarray:
    """``[row, col]`` element offsets of a rank-2 (row, col) layout, every coordinate."""
    rows, cols = layout.layout[0].size, layout.layout[1].size
    out = offsets(layout).reshape(cols, rows).T.copy()  # flat index = row + rows * col
    out.flags.writeable = False
    return out


def _tiles(plan):
    """(name, TmaTile, stage) for Q and every stage of K and V."""
    for name in ("Q", "K", "V"):
        for st in range(plan.tiles[name].stages):
            yield name, plan.loads[name], st


# ---------------------------------------------------------------------- TMA placement


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_tma_fill_matches_tile_layout(cfg):
    """Every element lands where ``tile.layout`` says, for Q and each K/V stage; nothing else is touched."""
    plan = make_hopper_plan(cfg)
    for name, tt, st in _tiles(plan):
        tile = tt.tile
        base = tile.stage_offset(st)
        smem = np.zeros(plan.smem_bytes, np.uint8)
        ids = (np.arange(tile.rows * tile.cols, dtype=np.int64) + 1).reshape(tile.rows, tile.cols)
        assert ids.max() < 1 << 16
        tma_fill(smem, tt, base, ids.astype(np.uint16))
        img = smem.view("<u2")
        elems = base // 2 + _layout_elems(tile.layout)
        np.testing.assert_array_equal(img[elems], ids, err_msg=f"{name} stage {st}")
        assert np.count_nonzero(img) == ids.size  # only the tile's own bytes were written
        assert img[base // 2: (base + tile.stage_bytes) // 2].all()


def _staged_ids(plan, o_stage_elems):
    """A shared-memory image with element id (row * cols + col + 1) staged at o_stage(row, col)."""
    o = plan.tiles["O"]
    smem = np.zeros(plan.smem_bytes, np.uint8)
    ids = (np.arange(o.rows * o.cols, dtype=np.int64) + 1).reshape(o.rows, o.cols) % (1 << 16)
    smem.view("<u2")[o.offset // 2 + o_stage_elems] = ids
    return smem, ids


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_tma_stores_read_what_each_consumer_staged(cfg):
    """The output's TMA store boxes of consumer w (its 64 rows) read, by the 128B-swizzle byte rule,
    exactly the rows it staged through ``o_stage``: the swizzled staging and the store agree."""
    plan = make_hopper_plan(cfg)
    st = plan.stores["O"]
    assert st.tile is plan.tiles["O"] and st.tma.box_rows == 64 and st.tma.box_cols * cfg.dtype.size == 128
    smem, ids = _staged_ids(plan, _layout_elems(plan.o_stage))
    for w in range(cfg.consumers):
        got = tma_read(smem, st, st.tile.offset, (64 * w, 64 * (w + 1)))
        np.testing.assert_array_equal(got[64 * w: 64 * (w + 1)], ids[64 * w: 64 * (w + 1)], err_msg=f"consumer {w}")
        assert not np.delete(got, np.s_[64 * w: 64 * (w + 1)], axis=0).any()  # only its own boxes


def test_unswizzled_staging_is_not_what_the_store_reads():
    """The check above can fail: row-major staging (no swizzle) is read back scrambled."""
    plan = make_hopper_plan(CONFIGS[0])
    o = plan.tiles["O"]
    plain = np.arange(o.rows * o.cols, dtype=np.int64).reshape(o.rows, o.cols)
    smem, ids = _staged_ids(plan, plain)
    assert not np.array_equal(tma_read(smem, plan.stores["O"], o.offset), ids)


@pytest.mark.parametrize("cfg", CONFIGS[:3], ids=IDS[:3])
def test_tma_fill_zero_fills_past_the_tensor(cfg):
    plan = make_hopper_plan(cfg)
    tt = plan.loads["K"]
    smem = np.full(plan.smem_bytes, 0xAB, np.uint8)
    rows = tt.tile.rows - 13
    tma_fill(smem, tt, tt.tile.offset, np.full((rows, tt.tile.cols), 0x3C00, np.uint16))
    vals = smem.view("<u2")[tt.tile.offset // 2 + _layout_elems(tt.tile.layout)]
    assert (vals[:rows] == 0x3C00).all() and (vals[rows:] == 0).all()


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_tma_boxes_and_transaction_bytes(cfg):
    plan = make_hopper_plan(cfg)
    for name, tt in plan.loads.items():
        tile = tt.tile
        assert tt.tma.dtype is cfg.dtype and tt.tma.box_cols * cfg.dtype.size == 128
        boxes = tt.boxes
        assert sum(tt.tma.bytes for _ in boxes) == tt.bytes == tile.stage_bytes == tile.rows * tile.cols * cfg.dtype.size
        assert sorted((b.row0, b.col0) for b in boxes) == [(r, c) for r in range(0, tile.rows, tt.tma.box_rows)
                                                          for c in range(0, tile.cols, tt.tma.box_cols)]
        assert all(b.smem_offset % 1024 == 0 for b in boxes)  # each box starts a 128B swizzle pattern


# ---------------------------------------------------------------------- descriptors


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_gemm_S_descriptors_read_their_tile_slices(cfg):
    """A = Q rows 64w.. (consumer w), B = all of K_stage; k16 step s covers columns 16s..16s+15.
    With Q's fragments in registers A has no descriptor (the fragment map is checked in the simulator's tests)."""
    plan = make_hopper_plan(cfg)
    g, dt = plan.gemm_S, cfg.dtype
    a_from = "regs" if cfg.q_in_registers else "smem"
    assert (g.a_from, g.trans_b, g.atom.N, g.k_steps) == (a_from, False, cfg.B_c, cfg.d_head // 16)
    assert (plan.q_load is not None, g.a is None) == (a_from == "regs",) * 2
    if a_from == "smem":
        q = plan.tiles["Q"]
        q_bytes = q.offset + 2 * _layout_elems(q.layout)
        seen = np.zeros(q_bytes.shape, int)
        for w in range(cfg.consumers):
            for s in range(g.k_steps):
                d = g.a.descriptor(q.offset, s, w)
                assert SmemDescriptor.decode(d.encode()) == d
                want = q_bytes[64 * w: 64 * (w + 1), 16 * s: 16 * (s + 1)]
                np.testing.assert_array_equal(descriptor_addresses(d, 64, 16, dt), want, err_msg=f"Q w={w} s={s}")
                seen[64 * w: 64 * (w + 1), 16 * s: 16 * (s + 1)] += 1
        assert (seen == 1).all()
    k = plan.tiles["K"]
    for st in range(k.stages):
        k_bytes = k.stage_offset(st) + 2 * _layout_elems(k.layout)
        for s in range(g.k_steps):
            d = g.b.descriptor(k.stage_offset(st), s)
            assert SmemDescriptor.decode(d.encode()) == d
            np.testing.assert_array_equal(descriptor_addresses(d, cfg.B_c, 16, dt), k_bytes[:, 16 * s: 16 * (s + 1)],
                                          err_msg=f"K stage {st} s={s}")


def test_q_goes_to_registers_where_the_fragments_fit():
    """Q's A fragments (d_head / 4 registers) join O, S and P where all fit a consumer's register budget."""
    for cfg in CONFIGS:
        need = cfg.fragment_regs + cfg.d_head // 4
        assert cfg.q_in_registers == (need <= cfg.register_budget), cfg
    assert W("fp16").q_in_registers and not W("fp16", B_c=160).q_in_registers  # d128: B_c 128 yes, 160 no
    assert not W("fp16", B_r=192, B_c=64).q_in_registers  # three consumers share the registers


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_gemm_O_descriptors_read_V_transposed(cfg):
    """B of O += P V is V read MN-major: element (n, kk) of step t is V[16t + kk, n]."""
    plan = make_hopper_plan(cfg)
    g, dt = plan.gemm_O, cfg.dtype
    assert (g.a_from, g.a, g.trans_b, g.atom.N, g.k_steps) == ("regs", None, True, cfg.d_head, cfg.B_c // 16)
    v = plan.tiles["V"]
    for st in range(v.stages):
        v_bytes = v.stage_offset(st) + 2 * _layout_elems(v.layout)
        for t in range(g.k_steps):
            d = g.b.descriptor(v.stage_offset(st), t)
            assert SmemDescriptor.decode(d.encode()) == d
            np.testing.assert_array_equal(descriptor_addresses_mn(d, cfg.d_head, 16, dt),
                                          v_bytes[16 * t: 16 * (t + 1), :].T, err_msg=f"V stage {st} t={t}")


# ---------------------------------------------------------------------- register maps


def _eval(tv) -> tuple[np.ndarray, np.ndarray]:
    rows = offsets(tv.row).reshape(tv.n_values, tv.n_threads).T
    cols = offsets(tv.col).reshape(tv.n_values, tv.n_threads).T
    return rows, cols


def _isa_a_fragment() -> tuple[np.ndarray, np.ndarray]:
    """PTX ISA, wgmma .m64nNk16 A (16-bit) from registers: a_i (i = 2*reg + half) of thread t:
    row = 16*warp + gid + 8*(reg % 2), col = 2*tig + half + 8*(reg / 2)."""
    t = np.arange(128)[:, None]
    i = np.arange(8)[None, :]
    reg, half = i // 2, i % 2
    return 16 * (t // 32) + (t % 32) // 4 + 8 * (reg % 2), 2 * (t % 4) + half + 8 * (reg // 2)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_p_from_s_matches_the_maps(cfg):
    """A register value (t, step, reg, half) is the S accumulator value the table names: same
    thread, same row, column 16*step + A column. Each S value feeds exactly one A value."""
    plan = make_hopper_plan(cfg)
    sr, sc = _eval(plan.gemm_S.atom.c_map)
    ar, ac = _eval(plan.gemm_O.atom.a_map)
    ir, ic = _isa_a_fragment()
    np.testing.assert_array_equal(ar, ir)
    np.testing.assert_array_equal(ac, ic)
    table = np.array(plan.p_from_s)
    assert table.shape == (cfg.B_c // 16, 4, 2)
    assert sorted(table.ravel().tolist()) == list(range(cfg.B_c // 2))
    for t in range(table.shape[0]):
        for reg in range(4):
            for half in range(2):
                i, v = table[t, reg, half], 2 * reg + half
                np.testing.assert_array_equal(sr[:, i], ar[:, v], err_msg=f"step {t} reg {reg} half {half}: row")
                np.testing.assert_array_equal(sc[:, i], 16 * t + ac[:, v], err_msg=f"step {t} reg {reg} half {half}: col")


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=IDS[:2])
def test_row_reduce_lanes_join_exactly_the_row_holders(cfg):
    plan = make_hopper_plan(cfg)
    rows, _ = _eval(plan.gemm_S.atom.c_map)
    group = {0}
    for m in plan.row_reduce_lanes:
        group |= {x ^ m for x in group}
    for t in range(128):
        same = {u for u in range(128) if set(rows[u]) == set(rows[t])}
        assert same == {t ^ x for x in group}


# ---------------------------------------------------------------------- output staging


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_o_stage_is_a_bijection_onto_its_tile(cfg):
    """(CTA row, col) -> sO element: onto the sO tile; consumer w's rows are Q rows 64w.. when sO
    aliases sQ (only w's own S GEMMs read those); stores and loads move 4 and 16 contiguous bytes."""
    plan = make_hopper_plan(cfg)
    o = plan.tiles["O"]
    assert (o.rows, o.cols, o.stages, o.stage_bytes) == (cfg.B_r, cfg.d_head, 1, cfg.B_r * cfg.d_head * cfg.dtype.size)
    assert o.layout == plan.o_stage
    el = o.offset // 2 + _layout_elems(plan.o_stage)
    assert el.shape == (cfg.B_r, cfg.d_head)
    assert sorted(el.ravel().tolist()) == list(range(o.offset // 2, (o.offset + o.stage_bytes) // 2))
    if o.offset == plan.tiles["Q"].offset:
        q_el = plan.tiles["Q"].offset // 2 + _layout_elems(plan.tiles["Q"].layout)
        for w in range(cfg.consumers):
            assert set(el[64 * w: 64 * (w + 1)].ravel().tolist()) == set(q_el[64 * w: 64 * (w + 1)].ravel().tolist())
    assert (el[:, 1::2] == el[:, 0::2] + 1).all()
    assert (el.reshape(cfg.B_r, -1, 8) == el.reshape(cfg.B_r, -1, 8)[:, :, :1] + np.arange(8)).all()


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_o_stage_accesses_are_bank_conflict_free(cfg):
    """Each warp's 4-byte accumulator stores (pair i, i+1 at c_map(t, i)) take one wavefront,
    and its 16-byte reads of consecutive row chunks take the ideal four."""
    plan = make_hopper_plan(cfg)
    el = plan.tiles["O"].offset // 2 + _layout_elems(plan.o_stage)
    rows, cols = _eval(plan.gemm_O.atom.c_map)
    chunks = cfg.d_head // 8
    for w in range(cfg.consumers):
        for warp in range(4):
            lanes = slice(32 * warp, 32 * (warp + 1))
            stores = 2 * el[64 * w + rows[lanes, 0::2], cols[lanes, 0::2]].T  # [store, lane]
            assert (hw.wavefronts_b32_many(stores) == 1).all(), f"consumer {w} warp {warp}"
            for v in range(64 * chunks // 128):
                idx = v * 128 + 32 * warp + np.arange(32)
                addr = 2 * el[64 * w + idx // chunks, idx % chunks * 8]
                assert hw.wavefronts_vec16(addr) == hw.ideal_wavefronts("vec16"), f"consumer {w} warp {warp} read {v}"


# ---------------------------------------------------------------------- shared memory and barriers


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_shared_memory_placement(cfg):
    """Tiles 1024-aligned and disjoint (sO may alias sQ exactly), mbarriers 8-byte aligned and
    disjoint, everything below smem_bytes - 1 KiB (the base-alignment slack), within 227 KiB."""
    plan = make_hopper_plan(cfg)
    assert plan.smem_bytes == cfg.smem_bytes <= SMEM_LIMIT_BYTES
    regions = []
    for name in ("Q", "K", "V", "O"):
        t = plan.tiles[name]
        if name == "O" and t.offset == plan.tiles["Q"].offset:
            assert t.stage_bytes == plan.tiles["Q"].stage_bytes  # O reuses Q's space exactly
            continue
        for st in range(t.stages):
            assert t.stage_offset(st) % 1024 == 0, f"{name} stage {st}: the 128B swizzle needs 1024-byte alignment"
            regions.append((t.stage_offset(st), t.stage_offset(st) + t.stage_bytes, f"{name}{st}"))
    assert {"q_full", "k_full", "v_full", "k_empty", "v_empty"} <= set(plan.barriers)
    for name, (bar, off, stages) in plan.barriers.items():
        assert off % 8 == 0, f"mbarrier {name} at {off} is not 8-byte aligned"
        assert bar.name == name
        assert stages == (1 if name.startswith("q_") else cfg.stages), name
        assert name != "q_empty" or cfg.persistent, "q_empty exists only in persistent plans"
        # full: the producer's one arrive_expect_tx; empty: one arrival per consumer warp
        assert bar.arrive_count == (1 if name.endswith("_full") else 4 * cfg.consumers), name
        regions.append((off, off + 8 * stages, name))
    regions.sort()
    for (a0, a1, an), (b0, b1, bn) in zip(regions, regions[1:]):
        assert a1 <= b0, f"{an} [{a0}, {a1}) overlaps {bn} [{b0}, {b1})"
    assert regions[-1][1] + 1024 <= plan.smem_bytes
    # persistent: O has its own space (the next tile's Q lands while O is stored), and Q is released
    assert (plan.tiles["O"].offset != plan.tiles["Q"].offset) == cfg.persistent
    assert ("q_empty" in plan.barriers) == cfg.persistent
    assert plan.threads == 128 * (1 + cfg.consumers) == 32 * cfg.n_warps


# ---------------------------------------------------------------------- config and notation


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_wgmma_short_form_round_trips(cfg):
    text = str(cfg)
    assert "+wgmma" not in text and text.split(": ")[1].startswith("wgmma+stages_")
    assert parse_config(text) == cfg
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert KernelConfig.from_yaml(cfg.to_yaml()) == cfg
    assert set(HOPPER_KNOBS) <= set(cfg.to_dict())


@pytest.mark.parametrize("text, knob", [
    ("(FP16, 96, 128, 128, 12): wgmma+stages_2", "d_head=96"),
    ("(FP16, 128, 256, 128, 20): wgmma+stages_2", "B_r=256"),
    ("(FP16, 128, 128, 128, 8): wgmma+stages_2", "n_warps=8"),
    ("(FP16, 128, 128, 128, 12): wgmma+stages_5", "stages=5"),
    ("(FP16, 64, 64, 64, 8): wgmma+stages_2+pingpong", "pingpong=true"),  # one consumer: no one to pass to
])
def test_bad_wgmma_configs_name_the_knob(text, knob):
    with pytest.raises(ConfigError, match=knob):
        parse_config(text)


@pytest.mark.parametrize("changes, knob", [
    (dict(d_head=96), "d_head"),
    (dict(stages=0), "stages"),
])
def test_bad_wgmma_knobs_name_the_knob(changes, knob):
    with pytest.raises(ConfigError, match=knob):
        W("fp16").replace(**changes)


def test_mma_sync_dicts_and_hashes_have_no_engine_keys():
    """The seed family's YAML, names and hashes stay as before the wgmma engine: only KNOBS."""
    for cfg in default_configs() + tuning_space()[:20]:
        d = cfg.to_dict()
        assert list(d) == list(KNOBS)
        assert not any(k + ":" in cfg.to_yaml() for k in HOPPER_KNOBS)
        blob = json.dumps({k: d[k] for k in KNOBS}, sort_keys=True).encode()
        assert cfg.content_hash() == hashlib.sha256(blob).hexdigest()[:16]
        assert "wgmma" not in cfg.mangle()


def test_wgmma_hashes_cover_the_engine_knobs():
    base = W("fp16")
    others = [base.replace(stages=3), base.replace(pingpong=False), base.replace(intra_overlap=False), base.replace(persistent=True)]
    assert len({c.content_hash() for c in [base] + others}) == 5
    assert len({c.mangle() for c in [base] + others}) == 5


def test_persistent_needs_room_for_the_output_tile():
    """The separate output tile costs B_r x d_head: d_head 256 with B_c 64 no longer fits."""
    assert W("fp16", d_head=256, B_c=64).smem_bytes <= SMEM_LIMIT_BYTES
    with pytest.raises(ConfigError, match="persistent=true stages the output apart from Q"):
        W("fp16", d_head=256, B_c=64, persistent=True)


@pytest.mark.parametrize("cfg", [W("fp16", persistent=True), W("fp16", persistent=True, intra_overlap=False)], ids=str)
def test_persistent_schedule_releases_q_once_after_the_last_S(cfg):
    """release Q is guarded to the last block and follows the wait that retires that block's S GEMM."""
    plan = make_hopper_plan(cfg)
    for part in (plan.prologue, plan.body):
        if not part:
            continue
        i = next(i for i, s in enumerate(part) if s.op == "release" and s.arg == "Q")
        assert part[i].guard == Guard(1, "==", "end")
        s_gemm = next(k for k, s in enumerate(part) if s.op == "gemm" and s.arg == "S")
        waits = [k for k in range(s_gemm, i) if part[k].op == "wgmma_wait"]
        assert waits, "Q released with no wgmma wait after its S GEMM"
    assert not any(s.arg == "Q" for s in make_hopper_plan(cfg.replace(persistent=False)).body)


def test_make_hopper_plan_refuses_mma_sync_configs():
    with pytest.raises(ValueError, match="mma.sync"):
        make_hopper_plan(default_configs()[0])


@pytest.mark.parametrize("producer", [24, 32, 40])
@pytest.mark.parametrize("consumers", [1, 2, 3])
def test_setmaxnreg_split_fits_the_ctas_launch_allocation(monkeypatch, consumers, producer):
    """setmaxnreg.inc waits until the CTA's pool holds what it asks for, and the pool is what the CTA
    launched with (ptxas: 168 registers x 384 threads for two consumers), not the SM's 65,536: a split
    past it hangs (a 32-register producer with 240-register consumers did, on an H100)."""
    from flashgen.dsl import config

    monkeypatch.setattr(config, "PRODUCER_REGS", producer)
    threads = 128 * (1 + consumers)
    per = config.consumer_regs(consumers)
    assert per % 8 == 0 and 24 <= per <= 256
    assert 128 * producer + 128 * consumers * per <= config.launch_regs(threads) * threads
    assert 128 * producer + 128 * consumers * (per + 8) > config.launch_regs(threads) * threads or per == 256


def test_shipped_register_split():
    """24 registers for the producer give two consumers 240 (the d_head-128 kernels' budget) and three 160."""
    from flashgen.dsl.config import PRODUCER_REGS, consumer_regs, launch_regs

    assert PRODUCER_REGS == 24 and launch_regs(384) == 168 and launch_regs(512) == 128
    assert (consumer_regs(2), consumer_regs(3)) == (240, 160)
