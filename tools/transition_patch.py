"""Session 12 probe: a cross-tile transition for persistent, unmasked wgmma kernels with Q in registers.

A text patch of the emitted kernel (not a product path: the probe decides whether the plan should
carry it). Two changes:

1. Q's buffer is released right after the tile's ldmatrix (Q lives in registers from then on), and
   the producer issues the *next* tile's Q after the current tile's second K/V block: the next Q
   lands about a tile ahead instead of one block ahead.
2. Between two whole tiles a consumer issues the next tile's first S GEMM together with this tile's
   last P V in one pingpong turn, runs the next tile's first softmax while that P V is in flight,
   and only then writes this tile's output: the epilogue leaves the tensor cores' critical path.

Use: `python tools/transition_patch.py SCRIPT [args]` runs SCRIPT (e.g. tools/energy_probe.py) with
flashgen.build.emit patched for every persistent unmasked config whose S GEMM reads Q from registers.
"""
import re
import runpy
import sys


def _one(pattern: str, text: str, flags: int = re.S) -> re.Match:
    found = list(re.finditer(pattern, text, flags))
    assert len(found) == 1, (pattern[:80], len(found))
    return found[0]


def patch(text: str) -> str:
    # ---- producer: the next tile's Q after the second K/V block of this one ----
    m = _one(r"( *)uint32_t kv_it = 0, q_it = 0;  // K/V ring slots.*?\n( *)return;\n", text)
    old = m.group(0)
    load_k = _one(r"\n( *tma_load_4d\(sK .*?)\n *mbar_wait\(bar_v_empty", old).group(1)
    load_v = _one(r"mbar_arrive_expect_tx\(bar_v_full \+ 8 \* st, KV_BYTES\);\n(.*?)\n *\}\n *kv_it", old).group(1)
    load_q = _one(r"mbar_arrive_expect_tx\(bar_q_full, Q_BYTES\);\n(.*?)\n *for \(int j", old).group(1)
    load_q = load_q.replace("q_row0", "x.q_row0").replace(", head,", ", x.head,").replace("batch)", "x.batch)")
    for name in ("kv_head", "batch"):
        load_k = load_k.replace(f", {name}", f", t.{name}")
        load_v = load_v.replace(f", {name}", f", t.{name}")
    producer = f"""            uint32_t kv_it = 0, q_it = 0;  // K/V ring slots and Q tiles issued so far (stage and phase)
            auto next_work = [&](int r, Tile* x) {{  // the CTA's next round with key blocks at or after r, or -1
                for (; cta_work(r, x); ++r)
                    if (x->j_begin < x->j_end) return r;
                return -1;
            }};
            auto issue_q = [&](const Tile& x) {{  // the consumers released the buffer after their ldmatrix
                mbar_wait(bar_q_empty, (q_it & 1u) ^ 1u);
                mbar_arrive_expect_tx(bar_q_full, Q_BYTES);
{load_q}
                ++q_it;
            }};
            Tile t, tn;
            int r = next_work(0, &t);
            if (r >= 0) issue_q(t);
            while (r >= 0) {{
                const int rn = next_work(r + 1, &tn);
                const int j_begin = t.j_begin, j_end = t.j_end;
                const int j_q = j_begin + 1 < j_end ? j_begin + 1 : j_begin;  // next Q once this tile has started
                for (int j = j_begin; j < j_end; ++j) {{
                    const uint32_t it = kv_it + uint32_t(j - j_begin), st = it % STAGES, ph = (it / STAGES) & 1u;
                    mbar_wait(bar_k_empty + 8 * st, ph ^ 1u);  // a fresh barrier passes parity 1 at once
                    mbar_arrive_expect_tx(bar_k_full + 8 * st, KV_BYTES);
{load_k}
                    mbar_wait(bar_v_empty + 8 * st, ph ^ 1u);
                    mbar_arrive_expect_tx(bar_v_full + 8 * st, KV_BYTES);
{load_v}
                    if (j == j_q && rn >= 0) issue_q(tn);
                }}
                kv_it += uint32_t(j_end - j_begin);
                t = tn;
                r = rn;
            }}
        }}
        return;
"""
    text = text.replace(old, producer)

    # ---- consumers ----
    text = re.sub(r"\n *// \[release Q\] last S retired: the producer may load the next tile's Q\n *if \(j \+ 1 == j_end\) \{\n"
                  r" *if \(lane == 0\) mbar_arrive\(bar_q_empty\);  // one arrival per warp\n *\}", "", text)
    assert "bar_q_empty);  // one arrival" not in text
    qload = _one(r"\n( *)mbar_wait\(bar_q_full, q_it & 1u\);\n(.*?wgmma_fence_operands\(q_frag\);  // the S GEMMs read them asynchronously)\n", text)
    ldsm = qload.group(2)
    text = text.replace(qload.group(0), f"""
            if (!carried) {{  // else the previous tile's transition loaded Q and ran the first block
            mbar_wait(bar_q_full, q_it & 1u);
{ldsm}
            if (lane == 0) mbar_arrive(bar_q_empty);  // Q lives in registers now: the next tile's may land
""")
    first = _one(r"\n( *)\{\n *const int j = j_begin;\n.*?first_block\(j, std::false_type\{\}\);\n *\}\n", text)
    text = text.replace(first.group(0), "\n" + first.group(0).strip("\n") + "\n            }  // !carried\n")
    # the auto first_block lambda sits inside the `if (!carried)` block: fine, it is only called there
    init = _one(r"\n( *)row_max\[0\] = row_max\[1\] = -INFINITY;\n *row_sum\[0\] = row_sum\[1\] = 0.f;\n *#pragma unroll\n *for \(uint32_t i = 0; i < D_HEAD / 2; \+\+i\) o_acc\[i\] = 0.f;\n", text)
    text = text.replace(init.group(0), "\n        trans = false;\n        if (!carried) {" + init.group(0) + "        }\n")
    # the gemm texts, to reuse in the transition
    gemm_s = _one(r"( *// \[gemm S j\] S = Q K_j\^T\n.*?wgmma_commit_group\(\);\n *wgmma_fence_operands\(s_acc\);\n)", text).group(1)
    last = _one(r"\n( *)\{\n *const int j = j_end;  // the last block's PV.*?\n *// \[release V last\]\n.*?\n *\}\n", text)
    gemm_o = _one(r"( *// \[gemm O last\].*?wgmma_commit_group\(\);\n *wgmma_fence_operands\(o_acc\);\n)", last.group(0)).group(1)
    epi = _one(r"\n( *// ---- epilogue: O /= l.*?bulk_commit_group\(\);\n *\}\n)", text).group(1)
    epi_t = epi.replace("row_sum[h]", "fin_sum[h]").replace("row_max[h]", "fin_max[h]")
    split = _one(r"\n *if \(t\.unit >= 0\) \{  // merged rows of a split tile.*?continue;\n *\}", epi_t)
    epi_t = epi_t.replace(split.group(0), "")  # a transition never ends a split part
    convert = _one(r"( *// \[convert_P\] P -> 16-bit A fragments\n.*?)\n *\};\n", text).group(1)
    transition = f"""
            Tile tn;
            trans = t.unit < 0 && cta_work(r + 1, &tn) && tn.unit < 0 && tn.j_begin < tn.j_end;
            if (trans) {{
                // ---- transition: the next tile's first S GEMM with this tile's last P V, then this tile's output ----
                {{
                    const int j = tn.j_begin;
                    const bool masked_first = block_needs_mask(j, tn.q_row0, p.seq_q, p.seq_k, p.mask_offset, p.window_left, p.window_right);
                    const uint32_t it = kv_it + uint32_t(j_end - j_begin), st = it % STAGES, ph = (it / STAGES) & 1u;
                    const uint32_t st_prev = (it + STAGES - 1) % STAGES, ph_prev = ((it + STAGES - 1) / STAGES - 1) & 1u;
                    mbar_wait(bar_q_full, (q_it + 1) & 1u);  // the next tile's Q, issued a tile ago
{ldsm}
                    if (lane == 0) mbar_arrive(bar_q_empty);
                    mbar_wait(bar_k_full + 8 * st, ph);
                    named_bar_sync(1 + cw, 2 * 128);
{gemm_s}
                    mbar_wait(bar_v_full + 8 * st_prev, ph_prev);
{gemm_o}
                    named_bar_arrive(1 + (cw + 1) % CONSUMERS, 2 * 128);
                    wgmma_wait_group<1>();
                    wgmma_fence_operands(s_acc);
                    if (lane == 0) mbar_arrive(bar_k_empty + 8 * st);
                    const float fin_max[2] = {{row_max[0], row_max[1]}}, fin_sum[2] = {{row_sum[0], row_sum[1]}};
                    row_max[0] = row_max[1] = -INFINITY;
                    row_sum[0] = row_sum[1] = 0.f;
                    if (masked_first) softmax(j, std::true_type{{}}, std::true_type{{}});
                    else softmax(j, std::false_type{{}}, std::true_type{{}});
                    wgmma_wait_group<0>();
                    wgmma_fence_operands(s_acc);
                    wgmma_fence_operands(o_acc); wgmma_fence_operands(p_frag);
                    if (lane == 0) mbar_arrive(bar_v_empty + 8 * st_prev);
{epi_t}
                    #pragma unroll
                    for (uint32_t i = 0; i < D_HEAD / 2; ++i) o_acc[i] = 0.f;
{convert}
                }}
            }} else
"""
    text = text.replace(last.group(0), transition + last.group(0).lstrip("\n"))
    merge = _one(r"\n( *)(if \(t\.unit >= 0\) \{\n *// a part of a split tail tile)", text)
    text = text.replace(merge.group(0), "\n        carried = trans;\n        if (trans) continue;  // this tile's output is written\n" + merge.group(1) + merge.group(2))
    loop = _one(r"\n( *)Tile t;\n( *)for \(int r = 0; cta_work\(r, &t\); \+\+r\) \{\n( *)const int q_row0", text)
    text = text.replace(loop.group(0), "\n    bool carried = false, trans = false;  // transition state\n" + loop.group(0).lstrip("\n"))
    return text


def applies(cfg) -> bool:
    return (cfg.is_wgmma and cfg.persistent and cfg.mask == "none" and cfg.pingpong and cfg.intra_overlap
            and cfg.q_in_registers and cfg.d_head == 128)


def install() -> None:
    import flashgen.build as fb

    orig = fb.emit

    def emit(cfg):
        src = orig(cfg)
        if not applies(cfg):
            return src
        import attrs
        return attrs.evolve(src, text=patch(src.text))

    fb.emit = emit


if __name__ == "__main__":
    install()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
