"""Query weights (docs/method.md section 3): the three schemes, batch normalisation
(mean 1 within [w_min, w_max]), the effective sample size, bad inputs."""
import math

import pytest
import torch

from erpo.query_weights import QueryWeighter, effective_sample_size, normalise_batch_weights, query_scores

F64 = torch.float64


def test_query_scores():
    s = query_scores(torch.tensor([-12.0, -3.0, -7.5], dtype=F64), torch.tensor([4, 3, 5]))
    assert torch.equal(s, torch.tensor([-3.0, -1.0, -1.5], dtype=F64))
    assert query_scores(torch.tensor([-2.0]), torch.tensor([4])).dtype == torch.float32


def test_prevalence_histogram_hand_computed():
    # K = 5 equal-width bins over [0, 10]: [0,2) [2,4) [4,6) [6,8) [8,10]
    train = torch.tensor([0.0, 1.0, 1.5, 3.0, 5.0, 9.0, 10.0], dtype=F64)
    qw = QueryWeighter(train, scheme="prevalence", bins=5)
    assert torch.allclose(qw.bin_fraction, torch.tensor([3, 1, 1, 0, 2], dtype=F64) / 7, rtol=0, atol=1e-15)
    # inside bins, on an interior edge (4.0 -> [4,6)), in the empty bin, below and above the range
    batch = torch.tensor([0.5, 3.9, 4.0, 7.0, -5.0, 12.0, 10.0], dtype=F64)
    expect = torch.tensor([3, 1, 1, 0, 3, 2, 2], dtype=F64) / 7
    assert torch.allclose(qw.raw(batch), expect, rtol=0, atol=1e-15)
    qw2 = QueryWeighter(train, scheme="prevalence", bins=5, gamma=2.0)
    assert torch.allclose(qw2.raw(batch), expect**2, rtol=0, atol=1e-15)
    # the batch weights follow the prevalence: the empty-bin query sits at w_min
    w = qw.batch_weights(batch)
    assert float(w[3]) == pytest.approx(0.1) and float(w[0]) > float(w[1])


def test_prevalence_all_scores_equal():
    qw = QueryWeighter(torch.full((5,), -1.0, dtype=F64), bins=4)
    assert torch.equal(qw.raw(torch.tensor([-3.0, -1.0, 2.0], dtype=F64)), torch.ones(3, dtype=F64))


def test_softmax_monotone_and_stable():
    train = torch.randn(30, dtype=F64)
    qw = QueryWeighter(train, scheme="softmax", temperature=0.5, w_min=0.0, w_max=1e9)
    s = torch.tensor([-3.0, -1.0, -0.5, 0.2, 2.0], dtype=F64)
    u = qw.raw(s)
    assert (u[1:] > u[:-1]).all()
    assert torch.allclose(u[1:] / u[:-1], torch.exp((s[1:] - s[:-1]) / 0.5), rtol=1e-12, atol=0)
    w = qw.batch_weights(s)
    assert (w[1:] > w[:-1]).all()
    assert torch.allclose(w, 5 * u / u.sum(), rtol=1e-12, atol=0)  # no clip binds with these bounds
    big = qw.raw(torch.tensor([1000.0, 999.0], dtype=F64))
    assert torch.isfinite(big).all() and float(big[0] / big[1]) == pytest.approx(math.exp(2.0))


def test_none_is_ones():
    qw = QueryWeighter(torch.randn(10), scheme="none")
    s = torch.randn(6)
    assert torch.equal(qw.raw(s), torch.ones(6))
    assert torch.equal(qw.batch_weights(s), torch.ones(6))


@pytest.mark.parametrize("m", [1, 2, 7, 33, 128])
@pytest.mark.parametrize("spread", [0.3, 3.0, 8.0])
def test_batch_weights_mean_one_within_bounds(m, spread):
    g = torch.Generator().manual_seed(m)
    u = torch.exp(torch.randn(m, generator=g, dtype=F64) * spread)
    w = normalise_batch_weights(u, 0.1, 10.0)
    assert w.dtype == F64 and w.shape == (m,)
    assert abs(float(w.mean()) - 1.0) <= 1e-12
    assert float(w.min()) >= 0.1 and float(w.max()) <= 10.0
    # the order of the raw weights is kept
    order = torch.argsort(u)
    assert (w[order][1:] >= w[order][:-1]).all()
    if spread == 8.0 and m >= 33:
        assert float(w.min()) == 0.1 and float(w.max()) == 10.0  # both clips bind here


def test_batch_weights_without_clipping_is_plain_normalisation():
    u = torch.tensor([1.0, 2.0, 3.0, 2.0], dtype=F64)
    assert torch.allclose(normalise_batch_weights(u), 4 * u / u.sum(), rtol=1e-15, atol=0)


def test_batch_weights_clip_then_renormalise():
    # m u / sum u = [0.005, 0.50, 2.50]: the smallest is lifted to 0.1, then the free ones
    # scale down so the mean is 1 again: 0.1 + c + 5 c = 3.
    u = torch.tensor([0.01, 1.0, 5.0], dtype=F64)
    w = normalise_batch_weights(u, 0.1, 10.0)
    c = 2.9 / 6.0
    assert torch.allclose(w, torch.tensor([0.1, c, 5 * c], dtype=F64), rtol=1e-13, atol=0)


def test_batch_weights_zero_raw_weights():
    u = torch.tensor([0.0] * 9 + [1.0], dtype=F64)
    w = normalise_batch_weights(u, 0.1, 10.0)  # feasible: the one positive weight takes 9.1
    assert torch.allclose(w, torch.tensor([0.1] * 9 + [9.1], dtype=F64), rtol=1e-13, atol=0)
    w = normalise_batch_weights(u, 0.1, 1.5)  # no scale reaches mean 1: the zeros share the rest
    assert float(w[-1]) == 1.5 and abs(float(w.mean()) - 1) <= 1e-14 and float(w.min()) >= 0.1
    assert torch.equal(normalise_batch_weights(torch.zeros(4, dtype=F64)), torch.ones(4, dtype=F64))
    assert normalise_batch_weights(torch.zeros(0)).shape == (0,)


def test_effective_sample_size():
    assert effective_sample_size(torch.ones(5)) == pytest.approx(1.0)
    assert effective_sample_size(torch.tensor([2.0, 0.0, 1.0, 1.0])) == pytest.approx(16 / 24)
    w = torch.rand(9, dtype=F64) + 0.1
    assert effective_sample_size(w) == pytest.approx(float(w.sum() ** 2 / (9 * (w**2).sum())), rel=1e-14)


@pytest.mark.parametrize(
    "field,call",
    [
        ("scheme", lambda: QueryWeighter(torch.randn(5), scheme="rank")),
        ("bins", lambda: QueryWeighter(torch.randn(5), bins=0)),
        ("gamma", lambda: QueryWeighter(torch.randn(5), gamma=-1.0)),
        ("temperature", lambda: QueryWeighter(torch.randn(5), temperature=0.0)),
        ("w_min", lambda: QueryWeighter(torch.randn(5), w_min=1.5)),
        ("w_max", lambda: QueryWeighter(torch.randn(5), w_max=0.5)),
        ("train_scores", lambda: QueryWeighter(torch.zeros(0))),
        ("train_scores", lambda: QueryWeighter(torch.tensor([0.0, float("nan")]))),
        ("scores", lambda: QueryWeighter(torch.randn(5)).raw(torch.zeros(2, 2))),
        ("u", lambda: normalise_batch_weights(torch.tensor([1.0, -1.0]))),
        ("w_max", lambda: normalise_batch_weights(torch.ones(3), 0.1, float("inf"))),
        ("n_tokens", lambda: query_scores(torch.ones(3), torch.tensor([1, 0, 2]))),
        ("n_tokens", lambda: query_scores(torch.ones(3), torch.tensor([1, 2]))),
        ("w", lambda: effective_sample_size(torch.zeros(3))),
    ],
)
def test_bad_inputs_raise(field, call):
    with pytest.raises(ValueError, match=field):
        call()


@pytest.mark.parametrize("u", [[1e-320, 1.0], [0.0, 1e-320], [5e-324, 0.0, 0.0], [1e308, 1e308, 1.0], [1.7e308, 1.7e308]])
def test_batch_weights_extreme_raw_weights_keep_their_promises(u):
    """Raw weights whose sum overflows or whose smallest entry is denormal (a softmax
    scheme at a small temperature, a prevalence at a large gamma) still give weights of
    mean 1 within [w_min, w_max]: never inf, NaN or negative."""
    w = normalise_batch_weights(torch.tensor(u, dtype=F64), 0.1, 10.0)
    assert torch.isfinite(w).all() and float(w.min()) >= 0.1 and float(w.max()) <= 10.0
    assert float(w.mean()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_weights_and_scores_are_refused(bad):
    with pytest.raises(ValueError, match="u must be finite"):
        normalise_batch_weights(torch.tensor([1.0, bad], dtype=F64))
    with pytest.raises(ValueError, match="w must be finite"):
        effective_sample_size(torch.tensor([1.0, bad], dtype=F64))
    qw = QueryWeighter(torch.tensor([-1.0, -2.0, -3.0], dtype=F64), scheme="softmax")
    with pytest.raises(ValueError, match="scores must be finite"):
        qw.batch_weights(torch.tensor([-1.0, bad], dtype=F64))
