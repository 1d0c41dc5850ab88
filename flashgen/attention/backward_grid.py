"""Which block of the backward's grid computes which key block, and in what order the blocks start.

A backward CTA owns key block ``kb`` of one kv head of one batch entry; under a causal mask its work
falls with ``kb`` (key block 0 meets every query block, top-left and bottom-right alike). The hardware
starts blocks in linear order (``blockIdx.x`` fastest, then ``.y``, then ``.z``), so the grid is
``(kv_heads, batch, key blocks)``: linear block ``(kb * batch + b) * kv_heads + h``. Every (kv head,
batch) pair's key block 0 starts before any pair's key block 1, so the longest CTAs start first and
the last wave is made of short ones (without a mask the CTAs are equal and the order changes nothing).

* **Grid** (:meth:`BackwardGrid.grid`): None past gridDim.y's and .z's limit of 65535 (batch entries,
  key blocks); gridDim.x takes any count of kv heads.
* **Decode** (:meth:`BackwardGrid.cta`): block ``(x, y, z)`` is key block ``z`` of kv head ``x`` of
  batch entry ``y``. Each is one block index, which ptxas reads again where it needs it instead of
  keeping it in a register: folding the pairs into ``x`` and the key blocks into ``y`` and ``z`` (to
  take more than 65535 of either) costs a division and a multiply-add whose results stay live across
  the query-block loop (3 to 8 more registers in 10 of the 24 shipped mma.sync kernels, near the cap).
* **Order** (:meth:`BackwardGrid.dispatch_order`): the CTAs in linear block order. A lower key block
  of the same pair has a lower linear index, so it starts no later: the ordered dQ adds
  (``deterministic``), where a key block waits for the lower ones of its pair, are free of deadlock
  because of it.

:meth:`BackwardGrid.to_cpp` renders ``bwd_grid`` (the launchers') and ``bwd_cta`` (the kernels', callable
on the host too); tests compile them for the host and compare them with these methods
(tests/attention/test_backward_grid.py).
"""
from __future__ import annotations

import attrs

#: gridDim.x's and gridDim.y's / .z's largest values
MAX_X, MAX_YZ = 2**31 - 1, 65535


@attrs.frozen
class BackwardGrid:
    """The grid rule of the backward's main kernel (both engines)."""

    #: the comment on a wait for the lower key blocks' dQ adds (both engines' ordered adds)
    WAIT_NOTE = ("// deadlock-free only because a lower key block of the same (kv head, batch) has a lower linear block index",
                 "// (bwd_cta) and so is dispatched no later than this CTA, and the lowest unfinished one never waits")
    #: the launch's grid argument (after :meth:`launch_check_cpp`)
    LAUNCH_DIMS = "dim3(grid[0], grid[1], grid[2])"

    # ---- the rule in Python (the simulators' and the tests') ----------------------------------

    def grid(self, key_blocks: int, kv_heads: int, batch: int) -> "tuple[int, int, int] | None":
        """(gridDim.x, .y, .z) of a launch of ``key_blocks`` per (kv head, batch entry); None where no grid holds it."""
        if kv_heads > MAX_X or batch > MAX_YZ or key_blocks > MAX_YZ:
            return None
        return kv_heads, batch, key_blocks

    def cta(self, x: int, y: int, z: int) -> tuple[int, int, int]:
        """(key block, kv head, batch entry) of block ``(x, y, z)``."""
        return z, x, y

    def dispatch_order(self, key_blocks: int, kv_heads: int, batch: int) -> list[tuple[int, int, int]]:
        """The (key block, kv head, batch entry) of every CTA, in linear block order."""
        dims = self.grid(key_blocks, kv_heads, batch)
        if dims is None:
            raise ValueError(f"{key_blocks} key blocks of {kv_heads} kv heads x {batch} batch entries: no grid holds them")
        gx, gy, gz = dims
        return [self.cta(x, y, z) for z in range(gz) for y in range(gy) for x in range(gx)]

    # ---- the rule in C++ ----------------------------------------------------------------------

    def to_cpp(self) -> str:
        """``BwdCta``, ``bwd_grid`` (host: the launch's grid; false where none holds it) and ``bwd_cta`` (a
        block's key block, kv head and batch entry, unsigned: the kernels' 64-bit address math widens them
        without a sign)."""
        return f"""// the backward's grid (flashgen.attention.backward_grid): key blocks slowest, so that every (kv head, batch)
// pair's key block 0 starts before any pair's key block 1 (a causal mask's longest CTAs first)
struct BwdCta {{ uint32_t kb, kv_head, batch; }};
// grid (kv heads, batch, key blocks); false past gridDim.y's and .z's {MAX_YZ} (gridDim.x holds any int)
static inline bool bwd_grid(int64_t key_blocks, int64_t kv_heads, int64_t batch, uint32_t grid[3]) {{
    if (kv_heads > {MAX_X} || batch > {MAX_YZ} || key_blocks > {MAX_YZ}) return false;
    grid[0] = uint32_t(kv_heads);
    grid[1] = uint32_t(batch);
    grid[2] = uint32_t(key_blocks);
    return true;
}}
// block (x, y, z): key block z of kv head x of batch entry y. Each one block index, which the kernel reads again
// where it needs it (a value computed from them would stay live in a register across the query-block loop)
__host__ __device__ __forceinline__ BwdCta bwd_cta(uint32_t x, uint32_t y, uint32_t z) {{
    return BwdCta{{z, x, y}};
}}"""

    def kernel_cpp(self) -> list[str]:
        """The main kernel's lines naming this CTA's ``cta`` (unsigned) and ``kb``, ``kv_head``, ``batch`` (ints)."""
        return ["const BwdCta cta = bwd_cta(blockIdx.x, blockIdx.y, blockIdx.z);  // this CTA's key block, kv head, batch entry",
                "const int kb = int(cta.kb), kv_head = int(cta.kv_head), batch = int(cta.batch);"]

    def launch_check_cpp(self, args: str = "a") -> str:
        """The launcher's size check, which fills ``grid`` (``uint32_t grid[3]``): true where no grid holds the
        launch. Needs the kernel's ``B_c``."""
        return f"!bwd_grid((int64_t({args}->seq_k) + B_c - 1) / B_c, {args}->kv_heads, {args}->batch, grid)"

    def described(self, B_c: int) -> str:
        """The grid in words (the files' headers and manifests)."""
        return f"(kv_heads, batch, ceil(seq_k / {B_c}))"
