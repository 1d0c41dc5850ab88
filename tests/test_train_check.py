"""benchmarks/train_check.py on the CPU: the model, the data, the tolerance rule, and that the rule tells
an attention equal to SDPA from a wrong one after a short training of a tiny model."""
from __future__ import annotations

import importlib.util
import functools
import io
import json
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("train_check", REPO / "benchmarks" / "train_check.py")
tc = importlib.util.module_from_spec(spec)
sys.modules["train_check"] = tc  # dataclasses look their module up while the class is made
spec.loader.exec_module(tc)

TINY = tc.ModelShape(vocab=32, seq=32, heads=2, d_head=16, layers=2)
PERIOD = 4
STEPS = 100
EVERY = 10


def manual_attention(q, k, v, scale_factor=1.0, causal=True):
    """Softmax attention written out, (batch, seq, heads, d): SDPA's result by another computation."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale_factor / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


class _DroppedDq(torch.autograd.Function):
    """SDPA's forward and its dK and dV, but no dQ: a backward that forgets one gradient."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return tc.sdpa_attention(q, k, v)

    @staticmethod
    def backward(ctx, do):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            _, dk, dv = torch.autograd.grad(tc.sdpa_attention(q, k, v), (q, k, v), do)
        return torch.zeros_like(q), dk, dv


def _train(candidate, steps=STEPS):
    torch.manual_seed(0)
    batches = tc.copy_batches(steps, 16, TINY.seq, TINY.vocab, seed=0, period=PERIOD)
    runs = tc.train_pair(TINY, {"sdpa": tc.sdpa_attention, "candidate": candidate}, batches, PERIOD,
                         device=torch.device("cpu"), lr=1e-2, warmup=5, amp=None, seed=0)
    return runs, tc.judge(runs["sdpa"].losses, runs["candidate"].losses, EVERY)


@pytest.fixture(scope="module")
def equivalent():
    return _train(manual_attention)


def test_an_attention_equal_to_sdpa_passes_and_the_loss_falls(equivalent):
    runs, verdict = equivalent
    assert verdict["passed"], verdict["reasons"]
    assert runs["candidate"].losses != runs["sdpa"].losses  # two computations, not one run twice
    for run in runs.values():
        assert run.losses[-1] < 0.5 * run.losses[0]
        assert len(run.seconds) == STEPS and all(s > 0 for s in run.seconds)


@pytest.mark.parametrize("wrong", [
    pytest.param(lambda q, k, v: manual_attention(q, k, v, causal=False), id="no-causal-mask"),
    pytest.param(lambda q, k, v: manual_attention(q, k, v, scale_factor=2.0), id="scores-times-2"),
    pytest.param(_DroppedDq.apply, id="backward-without-dq"),
])
def test_a_wrong_attention_or_gradient_fails(wrong):
    _, verdict = _train(wrong)
    assert not verdict["passed"]
    assert any("differ by" in r for r in verdict["reasons"])


def test_the_same_attention_in_both_slots_trains_the_same_model_bit_for_bit():
    """Same initial weights, same batches, same order: the attention is the only difference."""
    runs, verdict = _train(tc.sdpa_attention, steps=5)
    assert runs["sdpa"].losses == runs["candidate"].losses
    assert all(torch.equal(a, b) for a, b in zip(runs["sdpa"].model.parameters(), runs["candidate"].model.parameters()))
    assert verdict["per_step"]["max_abs"] == 0


def _curves(ref, cand):
    return tc.judge(ref, cand, 1)


def test_the_rule_allows_two_percent_plus_an_absolute_002_at_every_logged_step():
    ref = [6.0, 4.0, 2.0, 1.0]
    inside = [r + 0.02 * r + 0.02 - 1e-9 for r in ref]
    outside = inside[:2] + [ref[2] + 0.02 * ref[2] + 0.02 + 1e-6] + inside[3:]
    assert _curves(ref, inside)["passed"]
    lower = [r - 0.02 * r - 0.02 + 1e-9 for r in ref]
    assert _curves(ref, lower)["passed"]
    verdict = _curves(ref, outside)
    assert not verdict["passed"] and len(verdict["reasons"]) == 1 and verdict["reasons"][0].startswith("step 2:")


def test_the_rule_fails_curves_that_match_but_did_not_fall_by_half():
    flat = [6.0, 5.0, 4.0, 3.01]
    verdict = _curves(flat, flat)
    assert not verdict["passed"]
    assert len(verdict["reasons"]) == 2 and all("first loss" in r for r in verdict["reasons"])
    assert _curves([6.0, 5.0, 4.0, 3.0], [6.0, 5.0, 4.0, 3.0])["passed"]


def test_the_rule_compares_window_medians_not_single_steps():
    ref = [6.0] * 5 + [1.0] * 5
    spike = ref[:7] + [1.5, 1.3] + ref[9:]  # two steps of a loss spike in one run: not in its window's median
    assert not tc.judge(ref, spike, 1)["passed"]
    verdict = tc.judge(ref, spike, 5)
    assert verdict["passed"], verdict["reasons"]
    assert verdict["per_step"]["max_abs"] == pytest.approx(0.5) and verdict["logged"]["max_abs"] == 0
    assert [c["step"] for c in verdict["curves"]] == [4, 9]
    shifted = ref[:5] + [1.1] * 5  # every step of a window 0.1 off
    assert not tc.judge(ref, shifted, 5)["passed"]


def test_the_rule_refuses_runs_of_different_lengths():
    with pytest.raises(ValueError, match="equal"):
        tc.judge([1.0, 2.0], [1.0], 1)


def test_logged_medians_cover_every_window_and_the_last_step():
    assert tc.logged([1.0, 2.0, 9.0, 4.0, 5.0, 0.0, 7.0], 3) == [(2, 2.0), (5, 4.0), (6, 5.0)]
    assert tc.logged([1.0, 3.0], 5) == [(1, 2.0)]


def test_copy_batches_repeat_a_random_block_and_depend_only_on_the_seed():
    a = tc.copy_batches(3, 4, 24, 50, seed=1, period=8)
    assert a.shape == (3, 4, 24) and int(a.min()) >= 0 and int(a.max()) < 50
    assert torch.equal(a[..., :8], a[..., 8:16]) and torch.equal(a[..., :8], a[..., 16:])
    assert torch.equal(a, tc.copy_batches(3, 4, 24, 50, seed=1, period=8))
    assert not torch.equal(a, tc.copy_batches(3, 4, 24, 50, seed=2, period=8))
    with pytest.raises(ValueError, match="period"):
        tc.copy_batches(1, 1, 20, 50, seed=0, period=8)


def test_copy_loss_counts_exactly_the_predictable_positions():
    tokens = tc.copy_batches(1, 2, 12, 10, seed=0, period=4)[0]
    logits = torch.zeros(2, 12, 10)
    logits[:, :-1] = 100 * torch.nn.functional.one_hot(tokens[:, 1:], 10)  # perfect next-token logits
    assert float(tc.copy_loss(logits, tokens, 4)) == pytest.approx(0, abs=1e-6)
    logits[:, 2] = 0  # position 2 predicts a token of the first block: not counted
    assert float(tc.copy_loss(logits, tokens, 4)) == pytest.approx(0, abs=1e-6)
    logits[:, 3] = 0  # position 3 predicts the second block's first token: counted, ln(10) over 8 positions
    assert float(tc.copy_loss(logits, tokens, 4)) == pytest.approx(math.log(10) / 8, rel=1e-5)


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    lrs = [tc.learning_rate(s, 1.0, 10, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(0.1)


def test_the_model_is_causal_and_maps_tokens_to_logits():
    model = tc.TinyDecoder(TINY, tc.sdpa_attention)
    tokens = torch.randint(0, TINY.vocab, (2, TINY.seq))
    changed = tokens.clone()
    changed[:, 20] = (changed[:, 20] + 1) % TINY.vocab
    a, b = model(tokens), model(changed)
    assert a.shape == (2, TINY.seq, TINY.vocab)
    assert torch.equal(a[:, :20], b[:, :20]) and not torch.equal(a[:, 20:], b[:, 20:])


def test_without_cuda_the_tool_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        tc.main(["--steps", "5"])
    assert exc.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [(["--seq", "30"], "period"), (["--lr", "0"], "--lr"), (["--steps", "0"], "positive")])
def test_bad_options_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        tc.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_ctrl_c_stops_without_writing_the_json(monkeypatch, tmp_path, capsys):
    def interrupted(args, out=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tc, "check", interrupted)
    out = tmp_path / "r.json"
    assert tc.main(["--out", str(out)]) == 130
    assert not out.exists() and "interrupted" in capsys.readouterr().err


def test_the_report_prints_both_curves_and_the_verdict():
    out = io.StringIO()
    batches = tc.copy_batches(4, 2, TINY.seq, TINY.vocab, seed=0, period=PERIOD)
    runs = tc.train_pair(TINY, {"sdpa": tc.sdpa_attention, "flashgen": manual_attention}, batches, PERIOD,
                         device=torch.device("cpu"), lr=1e-3, warmup=1, amp=None, seed=0, every=2, out=out)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["step", "sdpa", "flashgen"] and [ln.split()[0] for ln in lines[1:]] == ["2", "4"]
    verdict = tc.judge(runs["sdpa"].losses, runs["flashgen"].losses, 2, names=("sdpa", "flashgen"))
    text = tc.report(verdict, {n: tc.step_ms(r.seconds) for n, r in runs.items()})
    assert text.endswith("FAIL")  # 4 steps do not halve the loss
    assert "time per step:   sdpa" in text and "time per step:   flashgen" in text


def test_the_tool_writes_its_json_and_exits_by_the_verdict(monkeypatch, tmp_path, capsys):
    """main() end to end on the CPU, with the hand-written attention standing in for flashgen's."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tc, "flashgen_attention", lambda: manual_attention)
    monkeypatch.setattr(tc, "check", functools.partial(tc.check, device=torch.device("cpu")))
    out = tmp_path / "sub" / "r.json"
    status = tc.main(["--steps", "6", "--log-every", "3", "--seq", "32", "--period", "4", "--vocab", "32",
                      "--heads", "1", "--batch", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert status == (0 if result["passed"] else 1)
    assert [len(result["losses"][n]) for n in ("sdpa", "flashgen")] == [6, 6]
    judged = tc.judge(result["losses"]["sdpa"], result["losses"]["flashgen"], 3, names=("sdpa", "flashgen"))
    assert result["verdict"] == json.loads(json.dumps(judged))
    assert result["args"]["out"] == str(out) and set(result["ms_per_step"]) == {"sdpa", "flashgen"}
    printed = capsys.readouterr().out
    assert [ln.split()[0] for ln in printed.splitlines()[1:3]] == ["3", "6"] and ("PASS" in printed or "FAIL" in printed)


def test_a_loss_that_is_not_finite_fails_the_check_naming_the_run(monkeypatch, capsys):
    def nan_attention(q, k, v):
        return tc.sdpa_attention(q, k, v) * float("nan")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tc, "flashgen_attention", lambda: nan_attention)
    monkeypatch.setattr(tc, "check", functools.partial(tc.check, device=torch.device("cpu")))
    assert tc.main(["--steps", "2", "--seq", "32", "--period", "4", "--vocab", "32", "--heads", "1", "--batch", "1"]) == 1
    assert "the flashgen run's loss at step 0 is nan" in capsys.readouterr().err
