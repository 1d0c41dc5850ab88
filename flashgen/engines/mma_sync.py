"""The mma.sync engine: the FlashAttention-2 family of the seed (cp.async, ldmatrix, mma.sync; sm_80+)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..dsl.config import ConfigError, DType, KernelConfig, default_configs, tuning_space
from ..emit.source import KernelSource
from ..targets import AMPERE, Target
from .base import BackwardKernels, Engine

if TYPE_CHECKING:
    from ..dsl.plan import KernelPlan


class MmaSyncBackward(BackwardKernels):
    """The backward on mma.sync: one CTA per key block, dQ by fp32 reductions (modules loaded on first use)."""

    def make_plan(self, cfg: Any, mods: Any = None) -> Any:
        from ..dsl.backward_plan import make_backward_plan

        return make_backward_plan(cfg, mods)

    def emit(self, plan: Any) -> KernelSource:
        from ..emit.backward_kernel import emit_backward

        return emit_backward(plan)

    def coverage(self, plan: Any) -> dict:
        from ..sim.backward_cta import backward_coverage

        return backward_coverage(plan)

    def simulate(self, plan: Any, q: Any, k: Any, v: Any, do: Any, **mask: Any) -> Any:
        from ..sim.backward_cta import simulate_backward

        return simulate_backward(plan, q, k, v, do, **mask)

    def verify_checks(self, plan: Any) -> tuple:
        from ..sim.verify import backward_checks

        return backward_checks(plan)

    def report(self, plan: Any, verification: dict, cta: bool = True) -> dict[str, Any]:
        from ..sim.backward_report import simulate_backward_report

        return simulate_backward_report(plan, verification, cta=cta)

    def default_config(self, dtype: DType, d_head: int, mask: str = "none", target: Target | None = None) -> Any:
        from ..dsl.backward_config import BackwardConfig

        if target is None:
            return BackwardConfig.default(dtype, d_head, mask)
        return BackwardConfig.default(dtype, d_head, mask, smem_limit=target.smem_per_block)

    def fallback(self, cfg: Any) -> Any:
        """The head size's former default shape (no split scores; the fewest registers its mods were seen to
        need) for a kernel whose mods did not fit."""
        from ..dsl.backward_config import lightest_default

        return lightest_default(cfg)

    def tuning_space(self, dtype: DType, d_head: int, mask: str = "none") -> list:
        from ..dsl.backward_config import tuning_space

        return tuning_space(dtype, d_head, mask)


#: The query rows of the default past the head sizes whose accumulators fit 128 rows (4 warps).
SMALL_B_R = 64


class MmaSyncEngine(Engine):
    name = "mma_sync"
    instructions = AMPERE
    rank = 0
    backward = MmaSyncBackward()

    @property
    def target(self) -> Target:
        """The emitter's target (its module is imported on first use: asking whether a GPU runs the
        engine needs only :attr:`instructions`)."""
        from ..emit import kernel

        return kernel.TARGET

    def make_plan(self, cfg: KernelConfig, mods: Any = None) -> "KernelPlan":
        from ..dsl.plan import make_plan

        return make_plan(cfg, mods)

    def emit(self, plan: "KernelPlan") -> KernelSource:
        from ..emit.kernel import emit

        return emit(plan)

    def verify_checks(self, plan: "KernelPlan") -> tuple:
        from ..sim.verify import mma_sync_checks

        return mma_sync_checks(plan)

    def check_schedule(self, plan: "KernelPlan", n_blocks: int = 3, **kw: Any) -> list[str]:
        from ..sim.cta import check_schedule

        return check_schedule(plan, n_blocks=n_blocks, **kw)

    def simulate(self, plan: "KernelPlan", verification: dict, cta: bool = True) -> dict[str, Any]:
        from ..sim.report import simulate_mma_sync

        return simulate_mma_sync(plan, verification, cta=cta)

    def tuning_space(self, dtypes: Sequence[str] | None = None) -> list[KernelConfig]:
        return tuning_space() if dtypes is None else tuning_space(dtypes)

    def default_config(self, dtype: DType, d_head: int) -> KernelConfig:
        """The seed's default of the dtype at ``d_head``; where its 128 query rows leave the O and S
        accumulators too few registers (d_head 192 and up), the same with 64 (16 rows per warp)."""
        base = next(c for c in default_configs() if c.dtype == dtype)
        if base.d_head == d_head:
            return base
        try:
            return base.replace(d_head=d_head)
        except ConfigError:
            return base.replace(d_head=d_head, B_r=SMALL_B_R)

    def bench_configs(self) -> list[KernelConfig]:
        return default_configs()
