"""flashgen with score_mod / mask_mod against torch's flex_attention (compiled), the same functions.

Per sequence length (batch x seq = --tokens, --heads heads, d_head --d-head), each case times
``compile("auto")`` called eagerly with the case's functions, flex_attention (``torch.compile``d, with
the block mask of the case's mask_mod made once, outside the timing), and flashgen's built-in kernel
without mods and with the built-in causal mask (the bars for a mod's cost). Rounds rotate the order;
each row reports the median TFLOP/s (causal-like masks count the kept half) and the ratios' range over
rounds. Every flashgen output is checked against the float64 reference on a slice of query rows first.
``--pass fwd+bwd`` times the forward and the backward (``torch.autograd.grad`` of q, k, v, 3.5x the forward's
FLOPs) of every callable instead: training with the functions; ``--pass bwd`` the backward alone (the gradients
of a forward recorded once, 2.5x); with either, flashgen's gradients of the first batch entry are checked
against float64 autograd first (FlashAttention's rule, the 16-bit autograd baseline).

    python benchmarks/mods_bench.py --seqs 2048 8192 --rounds 3 --json mods_h100.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

import flashgen
from flashgen.bench import attention_flops, interleaved
from flashgen.reference import check_attention

_spec = importlib.util.spec_from_file_location("mods_examples", Path(__file__).parents[1] / "examples" / "mods.py")
examples = sys.modules["mods_examples"] = importlib.util.module_from_spec(_spec)  # torch.compile imports it
_spec.loader.exec_module(examples)


def cases(seq: int, heads: int, device: str) -> dict:
    """name -> (score_mod, mask_mod): softcap, ALiBi, document, causal and prefix-LM masks, and three combinations
    (packed documents under a causal mask: a causal LM's training batch)."""
    off = min(37, seq // 8)  # three packed documents, not aligned to blocks
    doc_lengths = [seq // 4 - off, seq // 4 + off, seq - 2 * (seq // 4)]
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor(doc_lengths)).to(device)  # each token's document
    return {
        "softcap": (examples.softcap(30.0), None),
        "alibi": (examples.alibi(heads, device=device), None),
        "document": (None, examples.document_mask(doc_lengths, device=device)),
        "causal_document": (None, lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])),
        "causal_mod": (None, examples.causal()),
        "prefix_lm": (None, examples.prefix_lm(seq // 4)),
        "causal+softcap": (examples.softcap(30.0), examples.causal()),
    }


def kept_fraction(mask_mod, seq: int, device: str) -> float:
    """The share of (query, key) pairs ``mask_mod`` keeps (1 without one): the FLOPs a kernel must do."""
    if mask_mod is None:
        return 1.0
    idx = torch.arange(seq, device=device)
    return float(mask_mod(0, 0, idx[:, None], idx[None, :]).float().mean())


def flex_callable(q, k, v, score_mod, mask_mod):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # captured Python floats (softcap's cap) compiled in, as flex's own benchmarks do; left symbolic they
    # become 0-d CPU tensors that inductor's flex lowering rejects
    torch._dynamo.config.specialize_float = True
    torch._dynamo.config.recompile_limit = 1024  # a compile per function and shape, as a user's would be
    torch._dynamo.config.accumulated_recompile_limit = 4096
    flex = torch.compile(flex_attention)
    b, s, h, _ = q.shape
    block_mask = create_block_mask(mask_mod, b, None, s, s, device=q.device) if mask_mod is not None else None
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # flex takes (batch, heads, seq, d)
    return lambda: flex(qt, kt, vt, score_mod=score_mod, block_mask=block_mask)


def _grad_out(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """``do`` (shaped as flashgen's o) in ``o``'s layout: flex's o is (batch, heads, seq, d), the same values
    transposed."""
    return do if o.shape == do.shape else do.transpose(1, 2)


def with_backward(fn, leaves: list, do: torch.Tensor):
    """``fn`` (a forward) followed by the gradients of q, k, v (``do`` shaped as flashgen's o)."""
    def run():
        o = fn()
        return torch.autograd.grad(o, leaves, _grad_out(o, do))
    return run


def backward_of(fn, leaves: list, do: torch.Tensor):
    """The gradients of q, k, v through one recorded call of ``fn`` (a forward), again at every call (the graph
    kept): the backward alone. ``do`` as in :func:`with_backward`."""
    o = fn()
    grad_out = _grad_out(o, do)
    return lambda: torch.autograd.grad(o, leaves, grad_out, retain_graph=True)


def keep_compiled_graphs() -> None:
    """Let a compiled function's backward run again on its kept graph (:func:`backward_of`): torch.compile
    donates the saved buffers to a backward by default, which then refuses ``retain_graph``."""
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False


def check_gradients(attn, q, k, v, do, what: str, **mods) -> None:
    """dq, dk, dv of ``attn`` on the first batch entry against float64 autograd through the reference with the
    same functions, by FlashAttention's rule against autograd through the reference in q's dtype."""
    from flashgen import reference

    q, k, v, do = (t[:1].detach() for t in (q, k, v, do))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    reference.check_gradients(torch.autograd.grad(attn(*leaves, **mods), leaves, do), q, k, v, do, what, **mods)


def bench_seq(seq: int, args) -> list[dict]:
    device, batch = "cuda", max(1, args.tokens // seq)
    dt = getattr(torch, args.dtype)
    train = args.pass_ != "fwd"
    q, k, v = (torch.randn(batch, seq, args.heads, args.d_head, device=device, dtype=dt, requires_grad=train) for _ in range(3))
    do = torch.randn_like(q)
    attn = flashgen.compile("auto")
    base = {"flashgen none": lambda: attn(q, k, v), "flashgen causal": lambda: attn(q, k, v, causal=True)}
    rows = []
    for name, (score, mask) in cases(seq, args.heads, device).items():
        if args.cases and name not in args.cases:
            continue
        rows_q = slice(0, min(seq, 256))
        with torch.no_grad():
            out = attn(q, k, v, score_mod=score, mask_mod=mask)
        sub = {"score_mod": score, "mask_mod": mask}
        if seq <= 4096:  # the float64 reference of every row is too large beyond
            check_attention(out[:, rows_q].contiguous(), q[:, rows_q].detach(), k.detach(), v.detach(), f"{name} seq {seq}",
                            **{key: f for key, f in sub.items() if f is not None})
        fns = {"flashgen": lambda s=score, m=mask: attn(q, k, v, score_mod=s, mask_mod=m),
               "flex": flex_callable(q, k, v, score, mask), **base}
        if train:
            if seq <= 4096:  # float64 gradients of a longer sequence are too large
                check_gradients(attn, q, k, v, do, f"{name} seq {seq}", **{key: f for key, f in sub.items() if f is not None})
            timed = with_backward if args.pass_ == "fwd+bwd" else backward_of
            fns = {n: timed(f, [q, k, v], do) for n, f in fns.items()}
        times = interleaved(fns, args.rounds)
        work = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[args.pass_]  # the backward does 2.5x the forward's FLOPs
        flops = work * attention_flops(batch, args.heads, seq, seq, args.d_head) * kept_fraction(mask, seq, device)
        full = work * attention_flops(batch, args.heads, seq, seq, args.d_head)
        row = {"case": name, "seq": seq, "batch": batch, "times_ms": times,
               "tflops": {n: flops / 1e9 / statistics.median(t) for n, t in times.items()}}
        row["tflops"]["flashgen none"] = full / 1e9 / statistics.median(times["flashgen none"])
        row["tflops"]["flashgen causal"] = full / 2e9 / statistics.median(times["flashgen causal"])
        for peer in ("flex", "flashgen none", "flashgen causal"):
            ratios = [p / m for m, p in zip(times["flashgen"], times[peer])]
            row[f"vs {peer}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    t = row["tflops"]
    r = lambda p: f"{row['vs ' + p]['median']:.2f}x [{row['vs ' + p]['min']:.2f}-{row['vs ' + p]['max']:.2f}]"
    return (f"{row['case']:>15} seq {row['seq']:>5}: flashgen {t['flashgen']:6.1f} TFLOP/s, flex {t['flex']:6.1f}; "
            f"flashgen/flex {r('flex')}, no mod / with mod {r('flashgen none')}, built-in causal / with mod {r('flashgen causal')}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192], help="sequence lengths (default 2048 8192)")
    p.add_argument("--tokens", type=int, default=16384, help="batch x seq per row (default 16384)")
    p.add_argument("--heads", type=int, default=16, help="heads (default 16)")
    p.add_argument("--d-head", type=int, default=128, help="head size (default 128)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16", help="element type (default bfloat16)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each in a rotated order (default 3)")
    p.add_argument("--cases", nargs="*", help="only these cases (default: all)")
    p.add_argument("--pass", dest="pass_", choices=["fwd", "bwd", "fwd+bwd"], default="fwd",
                   help="time the forward, the backward alone (gradients of a recorded forward), or both (training) "
                        "(default fwd)")
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if args.pass_ == "bwd":
        keep_compiled_graphs()
    rows = []
    try:
        for seq in args.seqs:
            rows += bench_seq(seq, args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype, "pass": args.pass_,
                "heads": args.heads, "d_head": args.d_head, "tokens": args.tokens, "rounds": args.rounds}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
