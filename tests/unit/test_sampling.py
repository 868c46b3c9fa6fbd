"""Tests for logits -> probabilities and seeded sampling."""

import numpy as np
import pytest

from specdec_edge.errors import SpecdecError
from specdec_edge.sampling import SamplingParams, make_rng, probs_from_logits, sample


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_default_params_are_greedy():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_greedy_is_one_hot_of_argmax(dtype):
    logits = np.array([[0.1, 3.0, -1.0, 3.0], [5.0, 1.0, 2.0, 0.0]], dtype=dtype)
    probs = probs_from_logits(logits, SamplingParams())
    assert probs.dtype == np.float64
    # Ties go to the lowest index, like np.argmax.
    np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_temperature_scales_logits():
    logits = np.array([1.0, 2.0, 0.5, -3.0])
    for t in (0.25, 1.0, 2.0):
        probs = probs_from_logits(logits, SamplingParams(temperature=t))
        np.testing.assert_allclose(probs, _softmax(logits / t), rtol=1e-12)
    sharp = probs_from_logits(logits, SamplingParams(temperature=0.1))
    flat = probs_from_logits(logits, SamplingParams(temperature=10.0))
    assert sharp.max() > flat.max()


def test_top_k_keeps_k_largest_and_renormalises():
    logits = np.array([0.0, 4.0, 1.0, 3.0, 2.0])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    expected = np.zeros(5)
    expected[[1, 3]] = _softmax(np.array([4.0, 3.0]))
    np.testing.assert_allclose(probs, expected, rtol=1e-12)
    # top_k >= V is a no-op.
    np.testing.assert_allclose(
        probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=5)), _softmax(logits), rtol=1e-12
    )


def test_top_p_keeps_smallest_set_reaching_p():
    probs_in = np.array([0.05, 0.5, 0.3, 0.15])
    logits = np.log(probs_in)
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.79))
    np.testing.assert_allclose(probs, [0, 0.5 / 0.8, 0.3 / 0.8, 0], rtol=1e-9)
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.81))
    np.testing.assert_allclose(probs, [0, 0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95], rtol=1e-9)
    # A tiny top_p always keeps the most likely token.
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    np.testing.assert_array_equal(probs, [0, 1, 0, 0])


def test_top_k_then_top_p():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    # top-k=3 renormalises to [4/9, 3/9, 2/9]; top-p=0.7 then keeps the first two.
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    np.testing.assert_allclose(probs, [4 / 7, 3 / 7, 0, 0], rtol=1e-9)


def test_vectorised_over_leading_dims_matches_rows():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 50)).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    batched = probs_from_logits(logits, params)
    assert batched.shape == logits.shape
    for idx in np.ndindex(2, 3):
        np.testing.assert_allclose(batched[idx], probs_from_logits(logits[idx], params), rtol=1e-12)
    np.testing.assert_allclose(batched.sum(-1), 1.0, rtol=1e-12)


def test_sample_is_seeded_and_reproducible():
    probs = _softmax(np.random.default_rng(1).normal(size=100))
    a = [sample(probs, make_rng(42)) for _ in range(3)]
    rng1, rng2 = make_rng(7), make_rng(7)
    assert [sample(probs, rng1) for _ in range(50)] == [sample(probs, rng2) for _ in range(50)]
    assert len(set(a)) == 1


def test_sample_never_draws_zero_probability_tokens():
    probs = np.array([0.0, 0.5, 0.0, 0.0, 0.5, 0.0])
    rng = make_rng(0)
    draws = {sample(probs, rng) for _ in range(2000)}
    assert draws == {1, 4}
    assert sample(np.array([0.0, 0.0, 1.0]), rng) == 2


def test_sample_matches_distribution():
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    rng = make_rng(3)
    counts = np.bincount([sample(probs, rng) for _ in range(20000)], minlength=4)
    np.testing.assert_allclose(counts / counts.sum(), probs, atol=0.015)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_invalid_params_raise_clear_errors(kwargs, name):
    with pytest.raises(SpecdecError, match=name):
        SamplingParams(**kwargs)


def test_sample_rejects_bad_input():
    with pytest.raises(SpecdecError):
        sample(np.zeros(4), make_rng(0))
    with pytest.raises(SpecdecError):
        sample(np.ones((2, 2)), make_rng(0))
