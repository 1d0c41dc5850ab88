"""Where the wgmma backward's dS stores land (flashgen.sim.hopper_backward_smem), at every accumulator value."""
from __future__ import annotations

import numpy as np
import pytest

from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.hopper_backward_plan import make_hopper_backward_plan
from flashgen.sim.hopper import c_table
from flashgen.sim.hopper_backward_smem import ds_store_targets, tile_table


@pytest.mark.parametrize("d_head, B_r", [(64, 128), (128, 64), (128, 80)])
def test_each_ds_value_lands_at_its_layout_element(d_head, B_r):
    """Value (key row 64 w + row, query column col) of S^T's accumulator map goes to layout(key, query) of a
    [key][query] tile, or layout(query, key) of the [query][key] tile of 80-row blocks; every element once."""
    plan = make_hopper_backward_plan(BackwardConfig.wgmma("bf16", d_head).replace(B_r=B_r))
    tile, cs = plan.tiles["dS"], c_table(plan.gemms["S"].atom)
    table = tile_table(tile)
    seen = []
    for w in range(plan.consumers):
        key, query = 64 * w + cs.rows, cs.cols
        want = table[query, key] if plan.ds_store.trans else table[key, query]
        got = ds_store_targets(plan, w)
        assert (got == want).all()
        seen.append(got.ravel())
    assert plan.ds_store.trans == (B_r == 80)
    assert sorted(np.concatenate(seen)) == list(range(tile.rows * tile.cols))
