"""The wgmma engine: TMA producer warpgroup, K/V ring on mbarriers, wgmma consumer warpgroups (sm_90a)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..dsl.config import ConfigError, DType, KernelConfig, hopper_configs
from ..emit.source import KernelSource
from ..targets import HOPPER, Target, named as target_named
from .base import BackwardKernels, Engine

if TYPE_CHECKING:
    from ..dsl.hopper_plan import HopperPlan

#: Key block size of the default kernel per d_head (registers: O + S + P per consumer; shared memory:
#: Q + 2 stages of K and V). Every length, masked or not, takes it: a larger key block for long unmasked
#: d_head-128 sequences (B_c 160, the most that fits beside the persistent kernel's output tile) no longer
#: pays on an H100 or an H200 (docs/results/block_size.txt).
DEFAULT_B_C = {64: 128, 128: 128, 192: 96, 256: 64}
#: Shared memory per block of the wgmma engine's target (the default's bound where no GPU is named).
HOPPER_SMEM = target_named("sm_90a").smem_per_block
#: The head size whose defaults ``flashgen bench`` times.
BENCH_D_HEAD = 128


class WgmmaBackward(BackwardKernels):
    """The backward on wgmma (sm_90a): TMA producer, consumers of 64 key rows, dQ by fp32 reductions."""

    def make_plan(self, cfg: Any, mods: Any = None) -> Any:
        from ..dsl.hopper_backward_plan import make_hopper_backward_plan

        return make_hopper_backward_plan(cfg, mods)

    def emit(self, plan: Any) -> KernelSource:
        from ..emit.hopper_backward_kernel import emit_hopper_backward

        return emit_hopper_backward(plan)

    def coverage(self, plan: Any) -> dict:
        from ..sim.hopper_backward import hopper_backward_coverage

        return hopper_backward_coverage(plan)

    def simulate(self, plan: Any, q: Any, k: Any, v: Any, do: Any, **mask: Any) -> Any:
        from ..sim.hopper_backward import simulate_hopper_backward

        return simulate_hopper_backward(plan, q, k, v, do, **mask)

    def verify_checks(self, plan: Any) -> tuple:
        from ..sim.verify import hopper_backward_checks

        return hopper_backward_checks(plan)

    def report(self, plan: Any, verification: dict, cta: bool = True) -> dict[str, Any]:
        from ..sim.hopper_backward import hopper_backward_report

        return hopper_backward_report(plan, verification, cta=cta)

    def default_config(self, dtype: DType, d_head: int, mask: str = "none", target: Target | None = None) -> Any:
        """:meth:`BackwardConfig.wgmma` where it fits the target's shared memory; else None."""
        from ..dsl.backward_config import BackwardConfig

        cfg = BackwardConfig.wgmma(dtype, d_head, mask)
        limit = target.smem_per_block if target is not None else HOPPER_SMEM
        return cfg if cfg is not None and cfg.smem_bytes <= limit else None

    def with_mods(self, cfg: Any, mods: Any = None) -> Any:
        """Query blocks of 64 rows (without ``exp_first``, which they do not take), but for a mask_mod alone at
        d_head 64 without ordered dQ adds, which keeps 128. At 128 rows (d_head 64) the recompute pass holds S^T
        and dP^T of 64 values each beside dK and dV, and ptxas spilled 68-148 bytes (softcap, relative_bias, ALiBi
        with ordered dQ adds) or serialized the wgmma (prefix_lm, sliding_window_sinks with ordered adds) with the
        mods' code there; every example mask_mod alone compiles clean there without ordered adds (document, prefix
        LM, sliding window with sinks, block-local; unmasked and causal). At 80 (d_head 128) ptxas spilled 12 bytes
        with softcap and serialized the wgmma with ALiBi and with the sliding window with sinks. Under ``exp_first``
        alike: 80-148 bytes at 128 rows (softcap, relative_bias, ALiBi; 16 with ordered adds for prefix_lm, causal),
        12-124 at 80, every mask_mod alone clean at 128 rows without ordered adds. A user's mask_mod that does not
        fit 128 rows either falls back to 64 when built (:meth:`fallback`)."""
        mask_only = mods is not None and mods.score is None and mods.mask is not None
        if cfg.B_r > 64 and not (mask_only and cfg.d_head == 64 and not cfg.deterministic):
            return cfg.replace(B_r=64, exp_first=False)
        return cfg

    def fallback(self, cfg: Any) -> Any:
        """64-row query blocks (the fewest registers) for a kernel of more rows whose mods did not fit."""
        return cfg.replace(B_r=64, exp_first=False) if cfg.B_r > 64 else None

    def tuning_space(self, dtype: DType, d_head: int, mask: str = "none") -> list:
        """The shipped shape with two and one ring stages, and each with the head size's other query block size
        (64 rows where it ships 128 at d_head 64; 80 where it ships 64 at d_head 128), each past 64 rows followed
        by its ``exp_first`` variant (:func:`_times_exp_first`); the other knobs are fixed by the head size."""
        from ..dsl.backward_config import WGMMA_B_RS, BackwardConfig

        shipped = [c.replace(exp_first=False) for c in (BackwardConfig.wgmma(dtype, d_head, mask, stages)
                                                        for stages in (2, 1)) if c is not None]
        shapes = [v for c in shipped for v in [c] + [c.replace(B_r=b) for b in WGMMA_B_RS[d_head] if b != c.B_r]]
        return [v for c in shapes for v in [c] + ([c.replace(exp_first=True)] if _times_exp_first(c) else [])]


def _times_exp_first(cfg: Any) -> bool:
    """Whether the backward tuning space times ``cfg`` with ``exp_first`` as well: past 64 rows (the knob's rule),
    but for 128 rows with one stage."""
    # a tuned winner runs with the call's mask and, where asked, ordered dQ adds (flashgen.policy.backward_lookup),
    # and with one stage at 128 rows the window mask with ordered adds spilled 44-60 bytes under exp_first (sm_90a)
    return cfg.B_r > 64 and not (cfg.B_r == 128 and cfg.stages == 1)


class WgmmaEngine(Engine):
    name = "wgmma"
    instructions = HOPPER
    rank = 1
    backward = WgmmaBackward()
    hint = "use an engine=mma_sync config on this GPU"

    @property
    def target(self) -> Target:
        """The emitter's target (its module is imported on first use: asking whether a GPU runs the
        engine needs only :attr:`instructions`)."""
        from ..emit import hopper_kernel

        return hopper_kernel.TARGET

    def make_plan(self, cfg: KernelConfig, mods: Any = None) -> "HopperPlan":
        from ..dsl.hopper_plan import make_hopper_plan

        return make_hopper_plan(cfg, mods)

    def emit(self, plan: "HopperPlan") -> KernelSource:
        from ..emit.hopper_kernel import emit_hopper

        return emit_hopper(plan)

    def verify_checks(self, plan: "HopperPlan") -> tuple:
        from ..sim.verify import wgmma_checks

        return wgmma_checks(plan)

    def check_schedule(self, plan: "HopperPlan", n_blocks: int = 3, **kw: Any) -> list[str]:
        from ..sim.hopper import check_schedule

        return check_schedule(plan, n_blocks=n_blocks, **kw)

    def simulate(self, plan: "HopperPlan", verification: dict, cta: bool = True) -> dict[str, Any]:
        from ..sim.report import simulate_wgmma

        return simulate_wgmma(plan, verification, cta=cta)

    def tuning_space(self, dtypes: Sequence[str] | None = None) -> list[KernelConfig]:
        return hopper_configs() if dtypes is None else hopper_configs(dtypes)

    def default_config(self, dtype: DType, d_head: int) -> KernelConfig | None:
        """Persistent where the separate output tile fits in shared memory (d_head 64 and 128); the key
        block of :data:`DEFAULT_B_C`."""
        if d_head not in DEFAULT_B_C:
            return None
        cfg = KernelConfig.wgmma(dtype, d_head=d_head, B_c=DEFAULT_B_C[d_head])
        try:
            return cfg.replace(persistent=True)
        except ConfigError:
            return cfg

    def bench_configs(self) -> list[KernelConfig]:
        """The defaults at d_head :data:`BENCH_D_HEAD`, each dtype."""
        return [self.default_config(dt, BENCH_D_HEAD) for dt in DType]
