"""VectorCodec: named arrays, shapes and dtypes, decode accuracy, frames, attention-style use."""

from __future__ import annotations

import numpy as np
import pytest

import longctx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from longctx.quant.codec import QuantSpec, VectorCodec

SPECS = [QuantSpec(4), QuantSpec(3, qjl=True), QuantSpec(2, 2), QuantSpec(2, 1, qjl=True), QuantSpec(1)]


def _x(shape, seed, scale=1.0):
    return mx.array((np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dim,L", [(64, 1), (80, 7), (96, 33), (128, 5), (100, 3)])
def test_named_arrays(spec, dim, L):
    codec = VectorCodec(dim, spec, seed=1)
    P = codec.padded_dim
    enc = codec.encode(_x((2, 3, L, dim), 0))
    names = {"idx", "norm"} | ({"idx2"} if spec.bits2 else set()) | ({"qjl", "rnorm"} if spec.qjl else set())
    assert set(enc) == names
    groups = -(-P // 32)
    assert enc["idx"].dtype == mx.uint32 and enc["idx"].shape == (2, 3, L, spec.bits * groups)
    assert enc["norm"].dtype == mx.float16 and enc["norm"].shape == (2, 3, L)
    if spec.bits2:
        assert enc["idx2"].dtype == mx.uint32
        assert enc["idx2"].shape == (2, 3, L, spec.bits2 * groups)
    if spec.qjl:
        assert enc["qjl"].dtype == mx.uint32 and enc["qjl"].shape == (2, 3, L, codec.qjl.words)
        assert enc["rnorm"].dtype == mx.float16 and enc["rnorm"].shape == (2, 3, L)
    rot = codec.decode_rotated(enc)
    assert rot.dtype == mx.float32 and rot.shape == (2, 3, L, P)
    assert codec.decode(enc).shape == (2, 3, L, dim)
    # Stored bits per vector agree with the accounting.
    stored = sum(a.nbytes for a in enc.values()) * 8 / (2 * 3 * L)
    assert stored == codec.bit_breakdown()["vector_bits"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dim", [64, 128])
def test_decode_error_matches_design(spec, dim):
    codec = VectorCodec(dim, spec, seed=2)
    # Varied norms: the relative error must not depend on them.
    x = _x((4000, dim), 3) * mx.exp(_x((4000, 1), 4))
    rel = mx.sum((codec.decode(codec.encode(x)) - x) ** 2, -1) / mx.sum(x * x, -1)
    assert abs(float(mx.mean(rel)) / codec.unit_mse - 1) < 0.05


@pytest.mark.parametrize("dim", [128, 80, 100])
def test_frames_agree(dim):
    codec = VectorCodec(dim, QuantSpec(3, qjl=True), seed=4)
    x, q = _x((2, 2, 9, dim), 5), _x((2, 2, 4, dim), 6)
    enc = codec.encode(x)
    np.testing.assert_allclose(np.array(codec.unrotate(codec.decode_rotated(enc))), np.array(codec.decode(enc)), atol=1e-6)
    # Scores in the rotated frame equal scores against the decoded keys (also when padded).
    rot_scores = codec.rotate(q) @ codec.decode_rotated(enc).swapaxes(-1, -2)
    plain = q @ codec.decode(enc).swapaxes(-1, -2)
    np.testing.assert_allclose(np.array(rot_scores), np.array(plain), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(codec.unrotate(codec.rotate(q))), np.array(q), atol=1e-5)


def test_qjl_attention_shapes_and_residual_units():
    codec = VectorCodec(64, QuantSpec(2, qjl=True), seed=8)
    k, q = _x((2, 2, 11, 64), 9, scale=7.0), _x((2, 2, 3, 64), 10)
    enc = codec.encode(k)
    q_proj = codec.qjl_project(codec.rotate(q))
    assert q_proj.shape == (2, 2, 3, codec.qjl.m)
    corr = codec.qjl_correction(q_proj, enc)
    assert corr.shape == (2, 2, 3, 11)
    # rnorm is the norm of the residual in key units (norm included).
    resid = codec.rotate(k) - codec.decode_rotated(enc)
    np.testing.assert_allclose(np.array(enc["rnorm"], dtype=np.float32), np.array(mx.sqrt(mx.sum(resid * resid, -1))), rtol=2e-3)
    # Per-pair calls agree with the batched matrix.
    one = codec.qjl_correction(q_proj[:, :, 1:2], {n: a[:, :, 4:5] for n, a in enc.items()})
    np.testing.assert_allclose(np.array(one)[..., 0, 0], np.array(corr)[..., 1, 4], rtol=1e-5)
    with pytest.raises(ValueError):
        VectorCodec(64, QuantSpec(2), seed=0).qjl_project(q)


def test_deterministic_and_seed_dependent():
    x = _x((3, 20, 64), 11)
    a = VectorCodec(64, QuantSpec(2, 1, qjl=True), seed=5).encode(x)
    b = VectorCodec(64, QuantSpec(2, 1, qjl=True), seed=5).encode(x)
    c = VectorCodec(64, QuantSpec(2, 1, qjl=True), seed=6).encode(x)
    for name in a:
        assert np.array_equal(np.array(a[name]), np.array(b[name]))
    assert not np.array_equal(np.array(a["idx"]), np.array(c["idx"]))


def test_zero_vectors_and_fp16_inputs():
    codec = VectorCodec(64, QuantSpec(3, qjl=True), seed=0)
    enc = codec.encode(mx.zeros((1, 4, 64), dtype=mx.float16))
    assert np.all(np.array(codec.decode(enc)) == 0)
    assert np.all(np.array(enc["rnorm"]) == 0)
    x16 = _x((1, 5, 64), 1).astype(mx.float16)
    rel = mx.sum((codec.decode(codec.encode(x16)) - x16) ** 2) / mx.sum(x16.astype(mx.float32) ** 2)
    assert float(rel) < 0.1


def test_spec_validation():
    for bad in [dict(bits=0), dict(bits=9), dict(bits=2, bits2=-1), dict(bits=2, bits2=9)]:
        with pytest.raises(ValueError):
            QuantSpec(**bad)


@pytest.mark.parametrize("dim", [80, 128])
def test_empty_length(dim):
    codec = VectorCodec(dim, QuantSpec(3, 1, qjl=True), seed=0)
    enc = codec.encode(mx.zeros((1, 2, 0, dim)))
    assert enc["idx"].shape == (1, 2, 0, 3 * -(-codec.padded_dim // 32))
    assert codec.decode(enc).shape == (1, 2, 0, dim)
    q_proj = codec.qjl_project(codec.rotate(mx.ones((1, 2, 4, dim))))
    assert codec.qjl_correction(q_proj, enc).shape == (1, 2, 4, 0)


def test_codec_key_names_dim_and_spec():
    """`VectorCodec.key` (what compiled functions' keys hold instead of the spec) is one small int
    per (dim, spec): the same for codecs of any seed, different for another dim or spec."""
    a, b = VectorCodec(128, QuantSpec(4), seed=1), VectorCodec(128, QuantSpec(4), seed=2)
    others = [
        VectorCodec(64, QuantSpec(4), seed=1),
        VectorCodec(128, QuantSpec(3), seed=1),
        VectorCodec(128, QuantSpec(4, qjl=True), seed=1),
    ]
    assert a.key == b.key
    assert len({a.key, *(c.key for c in others)}) == 4
