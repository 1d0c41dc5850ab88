"""CPU simulation of a kernel plan (Numba): the project's oracle, no torch or GPU needed.

Layers, each using only the ones above it:

* ``layout_eval``  -- Layout / Swizzle objects evaluated over every coordinate (their own numpy
  evaluation, as writable copies);
* ``hardware``     -- instruction semantics written from the PTX ISA alone (ldmatrix,
  mma.m16n8k16 fragments and numerics, shared-memory banks, fp32 helpers);
* ``copies``       -- a plan's copies evaluated for every thread/warp/value/loop index:
  coordinates, smem offsets, byte addresses, bank wavefronts, coverage checks;
* ``fragments``    -- g2s -> ldmatrix -> mma of the plan, bit-exact against numpy;
* ``block_mask``   -- a mask_mod's block mask in numpy (the emitted ``mask_blocks`` kernels' twin), the
  row a tile reads and the key-block clip;
* ``cta``          -- one CTA's forward pass through ``plan.schedule``, with the async
  copy / barrier hazard tracker;
* ``hopper``       -- one CTA of the wgmma forward (TMA fills, mbarrier rings, wgmma groups, pingpong);
* ``backward_cta`` -- the mma.sync backward's CTAs and a whole backward pass (``BwdPass``: the inputs,
  preprocess and dQ conversion both backward simulators share);
* ``hopper_backward_cta`` / ``hopper_backward`` -- the wgmma backward's CTA (producer, consumers, dS^T
  handoff, vector-clock ordering) and its whole pass, coverage and report; ``hopper_backward_checks``
  -- its descriptor, dS^T handoff and barrier proofs;
* ``verify``       -- the proofs of the verification step (``flashgen.verify``, cached per config by
  :mod:`flashgen.engines`): what the plan derived and the emitters rely on (address splits,
  fragment-map patterns, P-from-S registers);
* ``report``       -- each engine's report (``simulate_mma_sync(plan)``, ``simulate_wgmma(plan)``)
  and ``format_report(results)``: what ``flashgen simulate`` prints (``flashgen.engines.simulate_config``).
"""
