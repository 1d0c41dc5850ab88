"""Hopper PTX helpers compile for sm_90a with nvcc (CPU only; marked ``nvcc``).

One translation unit calls every helper from a ``__global__`` on run-time values (so
nothing is dead), is compiled once to PTX and once to a cubin (ptxas accepts it), and
the PTX must contain each instruction.
"""
from __future__ import annotations

import subprocess

import pytest

from flashgen.dsl.atoms.hopper import WGMMA_64xNx16
from flashgen.dsl.dtypes import DType
from flashgen.emit.ptx import hopper

pytestmark = pytest.mark.nvcc

ATOMS = (WGMMA_64xNx16(DType.FP16, 64), WGMMA_64xNx16(DType.BF16, 256), WGMMA_64xNx16(DType.FP16, 8))
GENCODE = "-gencode=arch=compute_90a,code=sm_90a"


def _kernel_source() -> str:
    calls = []
    for k, atom in enumerate(ATOMS):
        n = atom.c_regs
        name = hopper.wgmma_helper_name(atom)
        calls.append(f"""
    {{
        float d{k}[{n}];
#pragma unroll
        for (int i = 0; i < {n}; ++i) d{k}[i] = 0.f;
        wgmma_fence_operands(d{k});
        wgmma_fence();
        {name}(d{k}, desc_a, desc_b, scale_d);
        {name}(d{k}, desc_a + 2, desc_b + 2, 1);
        wgmma_commit_group();
        wgmma_wait_group<0>();
        wgmma_fence_operands(d{k});
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < {n}; ++i) acc += d{k}[i];
        out[{k} * 128 + threadIdx.x] = acc;
    }}""")
    tb = WGMMA_64xNx16(DType.FP16, 64)
    return f"""#include <cstdint>
#include <cuda.h>

{hopper.helpers(ATOMS)}
{hopper.wgmma(tb, trans_b=True)}

__global__ void __launch_bounds__(384, 1)
hopper_probe(const __grid_constant__ CUtensorMap tmap, float* out, uint64_t desc_a, uint64_t desc_b, int scale_d, int parity) {{
    extern __shared__ __align__(1024) unsigned char smem[];
    uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    uint32_t tile = bar + 1024;
    if (threadIdx.x == 0) {{
        mbar_init(bar, 1);
        mbar_init(bar + 8, 256);
    }}
    fence_proxy_async();
    __syncthreads();
    if (threadIdx.x / 128 == 2) {{
        setmaxnreg_dec<40>();
        if (threadIdx.x == 256) {{
            mbar_arrive_expect_tx(bar, 64 * 64 * 2);
            tma_load_2d(tile, &tmap, bar, scale_d * 64, parity * 64);
            mbar_wait(bar, parity);
            tma_store_4d(&tmap, tile, 0, parity * 64, scale_d, 0);
            bulk_commit_group();
            bulk_wait_group_read<0>();
            bulk_wait_group<0>();
        }}
    }} else {{
        setmaxnreg_inc<232>();
        mbar_wait(bar, parity);
        {"".join(calls)}
        {{
            float t[32];
#pragma unroll
            for (int i = 0; i < 32; ++i) t[i] = 0.f;
            wgmma_fence_operands(t);
            wgmma_fence();
            {hopper.wgmma_helper_name(tb, trans_b=True)}(t, desc_a, desc_b, 0);
            wgmma_commit_group();
            wgmma_wait_group<1>();
            wgmma_wait_group<0>();
            out[1024 + threadIdx.x] = t[0] + t[31];
        }}
        if (mbar_try_wait(bar + 8, parity ^ 1)) out[2048] = 1.f;
        mbar_arrive(bar + 8);
    }}
}}
"""


@pytest.fixture(scope="module")
def cu_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("hopper_ptx") / "hopper_probe.cu"
    path.write_text(_kernel_source())
    return path


def _nvcc(nvcc: str, cu_file, kind: str) -> subprocess.CompletedProcess:
    out = cu_file.with_suffix(f".{kind}")
    cmd = [nvcc, GENCODE, f"-{kind}", "-std=c++17", "-Xptxas=-v", "-o", str(out), str(cu_file)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def ptx(nvcc, cu_file) -> str:
    _nvcc(nvcc, cu_file, "ptx")
    return cu_file.with_suffix(".ptx").read_text()


@pytest.mark.parametrize(
    "instruction",
    [
        "mbarrier.init.shared::cta.b64",
        "mbarrier.arrive.expect_tx.shared::cta.b64",
        "mbarrier.arrive.shared::cta.b64",
        "mbarrier.try_wait.parity.shared::cta.b64",
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes",
        "fence.proxy.async.shared::cta",
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group",
        "cp.async.bulk.commit_group",
        "cp.async.bulk.wait_group.read 0",
        "cp.async.bulk.wait_group 0",
        "wgmma.fence.sync.aligned",
        "wgmma.commit_group.sync.aligned",
        "wgmma.wait_group.sync.aligned 0",
        "wgmma.wait_group.sync.aligned 1",
        "setmaxnreg.inc.sync.aligned.u32 232",
        "setmaxnreg.dec.sync.aligned.u32 40",
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16",
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16",
    ],
)
def test_ptx_contains(ptx, instruction):
    assert instruction in ptx


def test_wgmma_count(ptx):
    # two calls per atom plus the transposed-B one, each inlined once
    assert ptx.count("wgmma.mma_async.sync.aligned") == 2 * len(ATOMS) + 1
    assert ptx.count("p, 1, 1, 0, 1;") == 1


def test_cubin_ptxas_accepts_without_spills(nvcc, cu_file):
    res = _nvcc(nvcc, cu_file, "cubin")
    assert cu_file.with_suffix(".cubin").stat().st_size > 0
    assert "C7508" not in res.stderr, f"setmaxnreg ignored by ptxas:\n{res.stderr}"
    # C7519: ptxas had to inject a warpgroup.arrive because accumulator registers were
    # written between wgmma.fence and wgmma.mma_async; wgmma_fence_operands prevents it.
    assert "C7519" not in res.stderr, res.stderr
    assert "0 bytes spill stores" in res.stderr, res.stderr


def test_builders_are_deterministic():
    assert hopper.helpers(ATOMS) == hopper.helpers(ATOMS)
    text = hopper.wgmma(ATOMS[0])
    assert text.count('"+f"(d[') == 32 and "%32, %33, p" in text and "setp.ne.b32 p, %34, 0" in text
