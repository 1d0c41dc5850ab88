"""Thread-value maps and partitions: the bulk tables equal the maps evaluated one coordinate at a time."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from flashgen.dsl.atoms.copy import ldmatrix_x4_rows_then_cols
from flashgen.dsl.atoms.mma import MMA_16x8x16
from flashgen.dsl.dtypes import DType
from flashgen.dsl.tiling import Loop, Partition, vector_copy_tv

MAPS = [MMA_16x8x16(DType.FP16).c_map, MMA_16x8x16(DType.FP16).a_map, ldmatrix_x4_rows_then_cols("ldsm"),
        vector_copy_tv("g2s", 64, 128, 128), vector_copy_tv("wide", 8, 512, 32)]


@pytest.mark.parametrize("tv", MAPS, ids=lambda tv: tv.name)
def test_tables_are_the_map_at_every_coordinate(tv):
    rows, cols = tv.tables()
    assert rows.shape == cols.shape == (tv.n_threads, tv.n_values)
    for t, v in itertools.product(range(tv.n_threads), range(tv.n_values)):
        assert (rows[t, v], cols[t, v]) == tv(t, v)


@pytest.mark.parametrize("part", [
    Partition(ldmatrix_x4_rows_then_cols("ldsm_A"), (Loop("mi", 2, 16, 0), Loop("kk", 3, 0, 16)), warp_row_step=32),
    Partition(MMA_16x8x16(DType.BF16).c_map, (Loop("nt", 4, 0, 8),), warp_row_step=16),
    Partition(vector_copy_tv("g2s", 32, 64, 64)),
    Partition(MMA_16x8x16(DType.FP16).c_map, (Loop("mi", 2, 16, 0), Loop("nt", 3, 0, 8)), 32, 24, 2),
], ids=["two loops", "one loop", "no loop", "warp grid"])
def test_coords_is_coord_at_every_point(part):
    threads = np.array([0, 5, part.tv.n_threads - 1, 3, 7])
    warps = np.array([0, 1, 2, 3, 5])
    rows, cols = part.coords(threads, warps)
    extents = [l.extent for l in part.loops]
    assert rows.shape == cols.shape == (len(threads), part.tv.n_values, *extents)
    for k, (t, w) in enumerate(zip(threads, warps)):
        for point in itertools.product(range(part.tv.n_values), *map(range, extents)):
            loops = {l.name: i for l, i in zip(part.loops, point[1:])}
            assert (rows[(k, *point)], cols[(k, *point)]) == part.coord(int(t), point[0], int(w), **loops)


def test_a_warp_grid_places_each_warp_tile_once():
    """Warps on a grid 2 wide with 32x24 tiles: the 8 warps' tiles are the 4x2 blocks of a 128x48
    tile, each covered by exactly one warp (the 16x8 C map, 2 x 3 fragments per warp)."""
    part = Partition(MMA_16x8x16(DType.FP16).c_map, (Loop("mi", 2, 16, 0), Loop("nt", 3, 0, 8)), 32, 24, 2)
    lanes = np.repeat(np.arange(32), 8)
    warps = np.tile(np.arange(8), 32)
    rows, cols = part.coords(lanes, warps)
    count = np.zeros((128, 48), dtype=int)
    np.add.at(count, (rows.ravel(), cols.ravel()), 1)
    assert (count == 1).all()
    blocks = (rows // 32) * 2 + cols // 24  # which warp's block each element lies in
    assert (blocks == warps.reshape(-1, 1, 1, 1)).all()
