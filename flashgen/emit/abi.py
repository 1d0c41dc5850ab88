"""The C ABI between an emitted kernel library and the launcher (:mod:`flashgen.launcher`).

Every kernel translation unit exports, with C linkage,

* ``int <name>_workspace(const <name>_args*, size_t* bytes, size_t* zeroed)``: the scratch
  memory a launch with these arguments needs (the first ``zeroed`` bytes zero at launch);
* ``int <name>_launch(const <name>_args*, void* stream)``: launch on a ``cudaStream_t``;

both returning a ``cudaError_t``. The argument struct below is the same for every kernel
(only its name differs), so one launcher calls them all.
"""
from __future__ import annotations


def args_struct(name: str) -> str:
    """The argument struct of `name`'s launcher; every kernel TU and the launcher embed this text."""
    return f"""// Arguments of {name}_launch. Strides are in elements; d_head is contiguous and rows
// 16-byte aligned. Tensors are (batch, seq, heads, d_head) or any strided view of one.
struct {name}_args {{
    const void* q; const void* k; const void* v; void* o;
    float* lse;                    // optional fp32 log-sum-exp, (batch, heads, seq_q), or nullptr
    int64_t q_stride[3];           // (batch, head, seq)
    int64_t k_stride[3], v_stride[3], o_stride[3];
    int64_t lse_stride[2];         // (batch, head); seq is contiguous
    int batch, heads, kv_heads;    // heads % kv_heads == 0 (GQA/MQA)
    int seq_q, seq_k;              // any lengths >= 1 (seq_k may be 0)
    float softmax_scale;
    int mask_offset;               // causal/window diagonal: 0 top-left, seq_k - seq_q bottom-right
    int window_left, window_right; // sliding-window sizes, -1 = unbounded
    void* workspace;               // scratch of {name}_workspace's size (its zeroed part zero), or nullptr
    const int64_t* mod_words;      // score_mod / mask_mod values (flashgen.mods.KernelMods' order), or nullptr
    int n_mod_words;               // how many; a kernel checks it is its mods' count (0 without mods)
    const int* block_mask;         // a mask_mod's block mask (<name>_mask_blocks), or nullptr: no block skipped
}};"""


#: The backward launcher's argument struct, field by field: (name, C type, array length or 0, comment).
#: The C struct is rendered from it; a caller without the headers (ctypes) can build its own from it.
BACKWARD_FIELDS: tuple[tuple[str, str, int, str], ...] = (
    *((n, "const void*", 0, "") for n in ("q", "k", "v", "o", "dout")),
    *((n, "void*", 0, "") for n in ("dq", "dk", "dv")),
    ("lse", "const float*", 0, "the forward's log-sum-exp, (batch, heads, seq_q), contiguous"),
    ("dlse", "const float*", 0, "the gradient of that lse, the same layout, or nullptr"),
    *((f"{n}_stride", "int64_t", 3, "(batch, head, seq)") for n in ("q", "k", "v", "o", "do", "dq", "dk", "dv")),
    *((n, "int", 0, "") for n in ("batch", "heads", "kv_heads", "seq_q", "seq_k")),
    ("softmax_scale", "float", 0, ""),
    *((n, "int", 0, "") for n in ("mask_offset", "window_left", "window_right")),
    ("workspace", "void*", 0, "<name>_workspace's bytes, the first `zeroed` of them zero"),
    ("mod_words", "const int64_t*", 0, "score_mod / mask_mod values (flashgen.mods.KernelMods' order), or nullptr"),
    ("n_mod_words", "int", 0, "how many; a kernel checks it is its mods' count (0 without mods)"),
    ("block_mask", "const int*", 0, "a mask_mod's block mask, transposed (the kernel's own block-mask kernels make it), or nullptr"),
)


def backward_args_struct(name: str) -> str:
    """The argument struct of a backward kernel's launcher ``name`` (:data:`BACKWARD_FIELDS`); the same
    for every backward kernel, so one launcher calls them all."""
    fields = [f"    {ctype} {field}{f'[{n}]' if n else ''};" + (f"  // {doc}" if doc else "")
              for field, ctype, n, doc in BACKWARD_FIELDS]
    return "\n".join([f"// Arguments of {name}_launch: (batch, seq, heads, d_head) tensors with element strides",
                      "// (batch, head, seq); d_head contiguous.", f"struct {name}_args {{", *fields, "};"])
