"""Divergence warnings (erpo/divergence.py) and the trainer stopping on a non-finite loss
before that step's checkpoint."""
import math
import os

import pytest
import torch

from erpo import divergence
from erpo.divergence import DivergenceMonitor


def _m(step, loss=0.1, qkl=0.01, grad=1.0, reward=0.5, std=0.3, lr=3e-4):
    return {"step": step, "loss": loss, "qkl/value": qkl, "grad_norm": grad, "reward/mean": reward,
            "reward/std": std, "lr": lr}


def test_quiet_on_a_healthy_run():
    mon = DivergenceMonitor()
    for s in range(1, 40):
        assert mon.check(_m(s, grad=1.0 + 0.1 * (s % 3))) == ([], False)
    assert mon.warning_tag == ""


@pytest.mark.parametrize("key", ["loss", "qkl", "grad"])
def test_non_finite_is_fatal(key):
    values = {"loss": dict(loss=math.nan), "qkl": dict(qkl=math.inf), "grad": dict(grad=math.nan)}[key]
    lines, fatal = DivergenceMonitor().check(_m(3, **values))
    assert fatal and len(lines) == 1 and "\n" not in lines[0] and "not finite" in lines[0] and "lr=" in lines[0]


def test_exploding_values_warn_once_with_what_to_try():
    mon = DivergenceMonitor()
    for s in range(1, 6):
        assert mon.check(_m(s))[0] == []
    lines, fatal = mon.check(_m(6, qkl=8.8e3, grad=3.8e5))   # the step 2 numbers
    assert not fatal and len(lines) == 2
    assert "Query-KL 8.8e+03" in lines[0] and "grad norm 3.8e+05" in lines[1]
    assert all("try a lower lr=" in line and "\n" not in line for line in lines)
    assert mon.warning_tag == "qkl,grad"
    assert mon.check(_m(7, qkl=9e3, grad=4e5)) == ([], False)   # still on: not repeated
    assert mon.check(_m(8)) == ([], False) and mon.warning_tag == ""
    assert len(mon.check(_m(9, loss=-500.0))[0]) == 1   # |loss| too
    # a jump relative to the recent median, below the absolute limit
    mon = DivergenceMonitor()
    for s in range(1, 8):
        mon.check(_m(s, grad=0.5))
    lines, _ = mon.check(_m(8, grad=200.0))
    assert len(lines) == 1 and "grad norm 200" in lines[0]


def test_a_tiny_grad_norm_after_zero_ones_is_no_explosion():
    """Norms of 0 (no reward signal, the Query-KL exactly 0), then 5e-5: not "exploding" (issue
    19.7: the median 0 made any norm a jump); a jump must also exceed GRAD_NORM_FLOOR."""
    mon = DivergenceMonitor()
    for s in range(1, 11):
        assert mon.check(_m(s, grad=0.0))[0] == []
    assert mon.check(_m(11, grad=5e-5))[0] == [] and mon.check(_m(12, grad=0.9))[0] == []
    lines, _ = mon.check(_m(13, grad=divergence.GRAD_NORM_FLOOR * 2))
    assert len(lines) == 1 and "or above 1 and 100x the recent median 0" in lines[0], lines


def test_all_zero_rewards_for_many_steps():
    mon = DivergenceMonitor()
    n = divergence.ZERO_REWARD_STEPS
    for s in range(1, n):
        assert mon.check(_m(s, reward=0.0, std=0.0))[0] == []
    lines, fatal = mon.check(_m(n, reward=0.0, std=0.0))
    assert not fatal and len(lines) == 1 and f"0 for {n} steps" in lines[0] and "template=" in lines[0]
    assert mon.check(_m(n + 1, reward=0.25))[0] == [] and mon.zero_reward_streak == 0


def test_a_run_stops_on_a_non_finite_loss_before_its_checkpoint(capsys, tmp_path, monkeypatch):
    """A tiny run whose objective turns non-finite at step 2: one line naming it, exit 2, the
    step-1 checkpoint kept and no step-2 checkpoint written; a warning (on the log) for a
    Query-KL that explodes at step 1 of another run, which finishes."""
    from erpo import trainer
    from erpo.cli import main
    from tests.test_cli import tiny_args

    real = trainer.erpo_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            loss = loss * float("nan")
            metrics = {**metrics, "loss": float("nan")}
        return loss, metrics

    monkeypatch.setattr(trainer, "erpo_loss", poisoned)
    run, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    threads = torch.get_num_threads()
    try:
        code = main(["train", *tiny_args(run, cache, steps=3, save_every=1, keep_checkpoints=0)])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("erpo: error: step 2: loss and grad norm not finite (loss nan") and "\n" not in err, err
        assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["step-000001"]

        def exploding(*args, **kwargs):
            loss, metrics = real(*args, **kwargs)
            return loss, {**metrics, "qkl/value": 8.8e3}

        monkeypatch.setattr(trainer, "erpo_loss", exploding)
        assert main(["train", *tiny_args(str(tmp_path / "run2"), cache, steps=2, progress="true")]) == 0
        captured = capsys.readouterr()
        warned = [line for line in captured.out.splitlines()
                  if line.startswith("erpo: warning: step 1: Query-KL 8.8e+03")]
        assert len(warned) == 1 and "try a lower lr=" in warned[0]   # once, not at step 2 again
        assert "warning=qkl" in captured.err   # and on the progress bar
    finally:
        torch.set_num_threads(threads)
