"""FlexAttention-style score and mask functions that flashgen traces and compiles (flashgen.mods).

Each factory returns a plain function with FlexAttention's signature; numbers and tensors it
captures become kernel arguments, so e.g. ``softcap(20.0)`` and ``softcap(50.0)`` share one kernel.
Factories that capture a tensor take ``device``: put it where q lives (``device="cuda"``), or each
call copies it there.
``EXAMPLES`` maps a name to ``(kind, factory)``; the tests trace, compile and check every entry.

    python examples/mods.py              # every example: its kernel key and captured arguments
    python examples/mods.py alibi --cpp  # one example's C++
"""
from __future__ import annotations

import argparse

import torch


def softcap(cap: float = 30.0):
    """Gemma-2 / Grok logit soft-capping: scores squashed smoothly into (-cap, cap)."""
    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap_mod


def alibi(heads: int = 8, device=None):
    """ALiBi, causal form: a per-head linear penalty on the distance to earlier keys
    (slopes 2^(-8 i / heads), i = 1..heads). Keys after the query get a bonus here, so pair it
    with a causal mask as ALiBi's decoders do."""
    slope = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device=device)

    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score - slope[h] * (q_idx - kv_idx)
    return alibi_mod


def relative_bias(max_len: int = 64, seed: int = 0, device=None):
    """A learned relative-position bias table, one entry per distance in [-max_len, max_len]
    (sequences of at most max_len + 1 tokens)."""
    bias = (torch.randn(2 * max_len + 1, generator=torch.Generator().manual_seed(seed)) * 0.5).to(device)

    def relative_bias_mod(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx - kv_idx + max_len]
    return relative_bias_mod


def document_mask(lengths=(5, 11, 3, 9), device=None):
    """Packed sequences: a token sees only tokens of its own document."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)

    def document_mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    return document_mask_mod


def uneven_lengths(total: int) -> list[int]:
    """Document lengths of a packed sequence of ``total`` tokens, uneven (7 to 47 tokens, the last one cut to fit):
    for ``document_mask`` on sequences of any length."""
    out, left, k = [], total, 0
    while left:
        out.append(min(left, 7 + 13 * k % 41))
        left -= out[-1]
        k += 1
    return out


def prefix_lm(prefix: int = 6):
    """Prefix LM: the first ``prefix`` tokens are seen by all, the rest causally."""
    def prefix_lm_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix)
    return prefix_lm_mod


def sliding_window_sinks(window: int = 4, sinks: int = 2):
    """Causal sliding window of ``window`` earlier keys plus ``sinks`` always-visible first tokens
    (StreamingLLM's attention sinks)."""
    def sliding_window_sinks_mod(b, h, q_idx, kv_idx):
        in_window = (kv_idx <= q_idx) & (q_idx - kv_idx <= window)
        return in_window | (kv_idx < sinks)
    return sliding_window_sinks_mod


def causal():
    """Causal masking written as a mask_mod."""
    def causal_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx
    return causal_mod


def block_local(block: int = 5):
    """Tokens attend within their own block of ``block`` tokens (floor division on the indices)."""
    def block_local_mod(b, h, q_idx, kv_idx):
        return q_idx // block == kv_idx // block
    return block_local_mod


EXAMPLES = {
    "softcap": ("score", softcap),
    "alibi": ("score", alibi),
    "relative_bias": ("score", relative_bias),
    "document_mask": ("mask", document_mask),
    "prefix_lm": ("mask", prefix_lm),
    "sliding_window_sinks": ("mask", sliding_window_sinks),
    "causal": ("mask", causal),
    "block_local": ("mask", block_local),
}


def main(argv=None) -> None:
    from flashgen.mods import prepare

    parser = argparse.ArgumentParser(description="Trace the example score/mask functions with flashgen.mods.")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"examples to show (default: all): {', '.join(EXAMPLES)}")
    parser.add_argument("--cpp", action="store_true", help="print each example's rendered C++ function")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in EXAMPLES]
    if unknown:
        parser.error(f"unknown example(s) {', '.join(unknown)}; choose from {', '.join(EXAMPLES)}")
    for name in args.names or EXAMPLES:
        kind, factory = EXAMPLES[name]
        mod, values = prepare(factory(), kind)
        shown = ", ".join(f"{a.name}={a.source.name}" for a in mod.scalars + mod.tensors) or "none"
        print(f"{name}: {kind}_mod key {mod.key}, arguments: {shown}")
        if args.cpp:
            print(mod.to_cpp())


if __name__ == "__main__":
    main()
