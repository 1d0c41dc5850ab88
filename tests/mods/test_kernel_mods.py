"""KernelMods: the launcher's words (``pack``) land in the fields ``fill_cpp`` fills (host-compiled
against a fake args struct: every scalar's value, every tensor's pointer and strides, the scale
fields, the word-count check); the kernel key and name follow the structure only; bad input is
refused with a clear error.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashgen.mods.kernel_mods import KernelMods, prepare_mods
from flashgen.mods.ranges import INDEX_LIMIT

from host import HEAD, build_and_run, f32, needs_gxx, words_cpp  # tests/mods is on sys.path (pytest's prepend mode)


def _mods():
    """A score_mod with float, int and bool scalars and three tensors (one strided, one 2-d); a mask_mod
    with an int scalar and a bool tensor: every kind of word, from both mods."""
    w, k, on = 0.375, 3, torch.tensor(True)
    table = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]  # strides (6, 2)
    idx = torch.arange(10, dtype=torch.int32) * 7
    gain = torch.linspace(0.5, 2.0, 5)
    limit, allowed = 5, torch.tensor([True, False, True, True, False, True, False, True])

    def score_mod(s, b, h, q, kv):
        return torch.where(on, s * w + table[h, kv % 3] + idx[q % k].float() * gain[b], s)

    def mask_mod(b, h, q, kv):
        return (kv - q < limit) & allowed[kv % 8]

    return score_mod, mask_mod


def _fill_program(mods: KernelMods, words: list[str], n_words: int, n_given: int) -> str:
    prints = []
    for m in mods.mods:
        for s in m.scalars:
            field = f"p.{m.kind}_args.{s.name}"
            prints.append(f'{{ float f = float({field}); unsigned u; std::memcpy(&u, &f, 4); std::printf("{field} %u\\n", u); }}'
                          if s.dtype == "fp32" else f'std::printf("{field} %d\\n", int({field}));')
    tensors = [(m, t) for m in mods.mods for t in m.tensors]
    for n, (m, t) in enumerate(tensors):
        field = f"p.{m.kind}_args.{t.name}"
        prints.append(f'std::printf("{field} %d\\n", int((const void*){field} == (const void*)tensor{n}));')
        prints += [f'std::printf("{field}_s{d} %d\\n", {field}_s{d});' for d in range(t.rank)]
    prints += ['{ unsigned u[3]; std::memcpy(u, &p.mod_scale, 4); std::memcpy(u + 1, &p.scale, 4); std::memcpy(u + 2, &p.scale_log2, 4);',
               '  std::printf("scales %u %u %u\\n", u[0], u[1], u[2]); }',
               'std::printf("block_mask %d\\n", int(p.block_mask == bm));']
    params = "\n".join("    " + l for l in mods.params_cpp())
    fill = "\n".join("    " + l for l in mods.fill_cpp())
    return f"""{HEAD}
{mods.to_cpp()}
struct Params {{
    float scale, scale_log2;
{params}
}};
struct Args {{ const long long* mod_words; int n_mod_words; float softmax_scale; const int* block_mask; int seq_q = 1, seq_k = 1; }};
static int fill(Params& p, const Args* a) {{
{fill}
    return 0;
}}
{chr(10).join(words)}
static const int bm[1] = {{0}};
int main() {{
    Params p{{}};
    const Args wrong{{words, {n_words + 1}, 1.f, bm}}, missing{{nullptr, {n_words}, 1.f, bm}};
    std::printf("wrong_count %d missing %d\\n", fill(p, &wrong), fill(p, &missing));
    const Args at_limit{{words, {n_words}, 1.f, bm, {INDEX_LIMIT}, {INDEX_LIMIT}}}, past{{words, {n_words}, 1.f, bm, 1, {INDEX_LIMIT + 1}}};
    std::printf("at_limit %d past_limit %d\\n", fill(p, &at_limit), fill(p, &past));
    const Args a{{words, {n_given}, {f32(0.0625)}, bm}};
    if (fill(p, &a)) return 3;
    {chr(10).join('    ' + l for l in prints)}
    return 0;
}}
"""


@needs_gxx
def test_fill_reads_every_field_from_the_packed_words(tmp_path):
    score_fn, mask_fn = _mods()
    mods, (sa, ma) = prepare_mods(score_fn, mask_fn)
    assert sorted(s.dtype for s in mods.score.scalars) == ["bool", "fp32", "int32"] and len(mods.score.tensors) == 3
    words, n_words = words_cpp(mods, sa, ma)
    assert n_words == mods.n_words
    out = build_and_run(tmp_path, _fill_program(mods, words, n_words, n_words))
    got = dict(zip(out[::2], out[1::2]))
    assert (got.pop("wrong_count"), got.pop("missing")) == ("1", "1")  # cudaErrorInvalidValue
    assert mods.index_limit is None and (got.pop("at_limit"), got.pop("past_limit")) == ("0", "0")  # any length
    want = {}
    for m, args in ((mods.score, sa), (mods.mask, ma)):
        for s, v in zip(m.scalars, args.scalars):
            field = f"p.{m.kind}_args.{s.name}"
            want[field] = str(np.float32(v).view(np.uint32)) if s.dtype == "fp32" else str(int(v))
        for t, v in zip(m.tensors, args.tensors):
            field = f"p.{m.kind}_args.{t.name}"
            want[field] = "1"  # the pointer of this very tensor: the order of both sides agrees
            want.update({f"{field}_s{d}": str(st) for d, st in enumerate(v.stride())})
    assert out[out.index("scales") + 1: out.index("scales") + 4] == [str(np.float32(x).view(np.uint32)) for x in (0.0625, 1.0, np.log2(np.e))]
    assert out[out.index("block_mask") + 1] == "1"
    assert {k: v for k, v in got.items() if k.startswith("p.")} == want
    assert any(t.stride() == (6, 2) for t in sa.tensors)  # the strided view travels with its own strides


def _mod(n):
    """Functions of one structure (scaled by a captured number) for any ``n``."""
    def score_mod(s, b, h, q, kv):
        return s * n
    return score_mod


def test_key_and_kernel_name_follow_the_structure_only():
    def bias_mod(s, b, h, q, kv):
        return s + (q - kv)

    def causal_mod(b, h, q, kv):
        return kv <= q

    a, _ = prepare_mods(_mod(2.0))
    b, (args, _) = prepare_mods(_mod(3.0))
    assert args.scalars == (3.0,)
    assert a.key == b.key and a.kernel_name("k") == b.kernel_name("k")
    assert a.kernel_name("k").startswith("k_m") and len(a.kernel_name("k")) == len("k_m") + 8
    others = [prepare_mods(bias_mod)[0], prepare_mods(_mod(2.0), causal_mod)[0], prepare_mods(mask_mod=causal_mod)[0]]
    names = {m.kernel_name("k") for m in [a] + others}
    assert len(names) == 4
    assert KernelMods(a.score, None) == a and hash(KernelMods(a.score, None)) == hash(a)


def test_errors():
    def causal_mod(b, h, q, kv):
        return kv <= q

    score, _ = prepare_mods(_mod(2.0))
    mask, _ = prepare_mods(mask_mod=causal_mod)
    with pytest.raises(ValueError, match="a score_mod given as the mask_mod"):
        KernelMods(None, score.score)
    with pytest.raises(ValueError, match="a mask_mod given as the score_mod"):
        KernelMods(mask.mask, None)
    with pytest.raises(ValueError, match="without a score_mod or a mask_mod"):
        KernelMods(None, None)
    with pytest.raises(TypeError, match="score_mod must be a function, got float"):
        prepare_mods(2.0)
    with pytest.raises(TypeError, match="mask_mod must be a function, got str"):
        prepare_mods(None, "causal")
    assert prepare_mods() == (None, (None, None))


@needs_gxx
def test_fill_refuses_sequences_past_a_split_conversions_limit(tmp_path):
    slope = torch.tensor([0.5, 0.25])
    mods, (sa, ma) = prepare_mods(lambda s, b, h, q, kv: s - slope[h] * (q - kv), lambda b, h, q, kv: kv <= q)
    assert mods.index_limit == INDEX_LIMIT
    words, n_words = words_cpp(mods, sa, ma)
    out = build_and_run(tmp_path, _fill_program(mods, words, n_words, n_words))
    assert out[out.index("at_limit") + 1] == "0" and out[out.index("past_limit") + 1] == "1"


@needs_gxx
def test_fill_of_a_bias_keeps_the_softmax_scale_and_refuses_a_scale_without_an_inverse(tmp_path):
    """A score_mod that adds a bias runs its softmax at the launch's scale (the accumulator holds the bias over it),
    so the fill leaves scale and scale_log2 as the launch set them and passes 1 / softmax_scale; a scale whose
    inverse is not a finite fp32 number is refused (cudaErrorInvalidValue), never launched."""
    slope = torch.tensor([0.5, 0.25])
    mods, (sa, ma) = prepare_mods(lambda s, b, h, q, kv: s - slope[h] * (q - kv), None)
    assert mods.bias is not None
    words, n_words = words_cpp(mods, sa, ma)
    fill = "\n".join("    " + l for l in mods.fill_cpp())
    source = f"""{HEAD}
{mods.to_cpp()}
struct Params {{
    float scale, scale_log2;
{chr(10).join('    ' + l for l in mods.params_cpp())}
}};
struct Args {{ const long long* mod_words; int n_mod_words; float softmax_scale; const int* block_mask; int seq_q = 1, seq_k = 1; }};
static int fill(Params& p, const Args* a) {{
    p.scale = a->softmax_scale; p.scale_log2 = a->softmax_scale * 1.4426950408889634f;  // the launch's own lines
{fill}
    return 0;
}}
{chr(10).join(words)}
int main() {{
    Params p{{}};
    const float refused[3] = {{0.f, 1e-39f, -0.f}};
    for (float s : refused) {{ const Args a{{words, {n_words}, s, nullptr}}; std::printf("%d\\n", fill(p, &a)); }}
    const Args a{{words, {n_words}, {f32(0.0625)}, nullptr}};
    if (fill(p, &a)) return 3;
    std::printf("%a %a %a %a\\n", p.scale, p.scale_log2, p.mod_scale, p.bias_scale);
    return 0;
}}
"""
    out = build_and_run(tmp_path, source)
    assert out[:3] == ["1", "1", "1"]
    scale, scale_log2, mod_scale, bias_scale = (float.fromhex(x) for x in out[3:7])
    assert (scale, mod_scale, bias_scale) == (0.0625, 0.0625, 16.0)
    assert scale_log2 == float(np.float32(0.0625) * np.float32(np.log2(np.e)))
    softcap, _ = prepare_mods(lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), None)
    assert softcap.bias is None and not any("bias_scale" in line for line in softcap.fill_cpp())
