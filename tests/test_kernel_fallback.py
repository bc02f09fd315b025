"""The kernel safety net: a kernel that fails to build or launch falls back to its MLX reference
(one warning, the rest of the process), and answers stay those of the reference path.

Run on the CPU by installing an executor that raises, as a Metal compile error or a CUDA launch
failure would (`kernels._prelude.run`)."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest
from kernel_cases import preset_bits, random_segment

from longctx import session

from longctx import asking
from longctx.kernels import _prelude
from longctx.kernels import decode_attend as da
from longctx.kernels import pack as kp


class fallbacks(warnings.catch_warnings):
    """Records every KernelFallbackWarning of the block (`.names`: the kernels that fell back)."""

    def __init__(self):
        super().__init__(record=True)

    def __enter__(self):
        self.caught = super().__enter__()
        warnings.simplefilter("always", _prelude.KernelFallbackWarning)
        return self

    @property
    def names(self) -> set:
        return {str(w.message).split()[1] for w in self.caught if issubclass(w.category, _prelude.KernelFallbackWarning)}


class Broken:
    """An executor whose every launch raises like MLX's Metal back end does; counts calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, spec, launch):
        self.calls += 1
        raise RuntimeError(
            "[metal::Device] Unable to build metal library from source\n"
            "program_source:209:31: error: C-style cast ... address spaces"
        )


def test_failing_kernel_falls_back_once_with_one_warning():
    broken = Broken()
    x = mx.array(np.random.default_rng(0).integers(0, 8, size=(4, 100)).astype(np.uint8))
    with _prelude.executor(broken, as_backend="metal"):
        with pytest.warns(_prelude.KernelFallbackWarning) as caught:
            first = kp.pack(x, 3)
        assert len(caught) == 1
        message = str(caught[0].message)
        assert "lc_pack" in message and "metal" in message
        assert "Unable to build metal library from source" in message and "program_source" not in message
        assert _prelude.failed("lc_pack")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second warning
            second = kp.pack(x, 3)
        assert broken.calls == 1  # the failed kernel is not tried again
    assert mx.array_equal(first, kp.pack_reference(x, 3))
    assert mx.array_equal(second, kp.pack_reference(x, 3))
    assert not _prelude.failed("lc_pack")  # an executor's failures end with its block


def test_without_a_reference_the_error_propagates():
    with _prelude.executor(Broken(), as_backend="cuda"):
        with pytest.raises(RuntimeError, match="Unable to build"):
            _prelude.run(
                kp._PACK,
                _prelude.Launch([mx.zeros((2, 32), dtype=mx.uint8)], [("B", 2)], (64, 1, 1), (64, 1, 1), [(2, 2)], [mx.uint32]),
            )


@pytest.mark.parametrize("preset", ["tq4", "tq3+qjl", "rvq2+2"])
def test_decode_attend_falls_back_to_its_reference(preset):
    b1, b2, qjl, bv = preset_bits(preset)
    q, qp, keys, values, kt, vt = random_segment(1, 2, 8, 64, 300, b1, b2, bv, qjl, seed=3)
    kw = dict(key_bits=b1, key_bits2=b2, value_bits=bv, scale=0.125, q_proj=qp, lq=2, causal_base=290)
    want = da.decode_attend_reference(q, keys, values, kt, vt, **kw)
    with _prelude.executor(Broken(), as_backend="metal"):
        with fallbacks() as fell:
            got = da.decode_attend(q, keys, values, kt, vt, **kw)
    assert fell.names == {"lc_decode_attend", "lc_split_combine"}
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-6)


def test_ask_answers_like_the_reference_path_when_kernels_fail(tiny_model, text_doc):
    session.ingest(text_doc, model=str(tiny_model))
    question = "Who keeps the lighthouse?"
    with _prelude.force_backend("cpu"):  # every kernel's reference: the oracle
        want = "".join(asking.ask(question, max_tokens=12))
    broken = Broken()
    with _prelude.executor(broken, as_backend="metal"):
        with fallbacks() as fell:
            got = "".join(asking.ask(question, max_tokens=12))
    assert "lc_decode_attend" in fell.names
    assert broken.calls >= 1  # the fused path was taken and its kernel failed
    assert got == want and len(got) > 0


def test_kernel_variants_are_checked_once():
    """A kernel that works is evaluated eagerly on its first launch only."""
    calls = []

    def ok(spec, launch):
        calls.append(spec.name)
        return [kp.pack_reference(launch.inputs[0], 3)]

    x = mx.zeros((2, 64), dtype=mx.uint8)
    with _prelude.executor(ok, as_backend="cuda"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                kp.pack(x, 3)
        assert len(calls) == 3 and not _prelude.failed("lc_pack")
        assert len([v for v in _prelude._VERIFIED if v[1] == "lc_pack"]) == 1
