"""The GPU prefill path (dequantize + fp16 SDPA, `kvcache.dense_gpu`) and its dequant kernel.

On the CPU the path runs with the dequant kernel's reference and MLX's CPU SDPA, and is compared
with the blocked pure-MLX path (the oracle); the `gpu` tests run the kernel itself.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from kernel_cases import preset_bits

from longctx import kvcache
from longctx.kernels import _prelude
from longctx.kernels import dequant as dq
from longctx.kvcache import attention, dense_gpu, turbo
from longctx.kvcache.attention import compressed_attention, kernel_table
from longctx.kvcache.turbo import TurboQuantCache

TURBO = [p for p in kvcache.PRESETS.values() if p.kind == "turbo"]
ON_GPU = _prelude.backend() in ("metal", "cuda")
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a Metal or CUDA device")


def _filled(preset, hkv=2, d=64, n=700, new=300, seed=0):
    """A cache holding `n` tokens (a sink, a compressed tail) and a view over `new` more tokens
    kept exact (the window plus a chunk), as a prefill chunk sees it."""
    mx.random.seed(seed)
    k = mx.random.normal((1, hkv, n + new, d)) * 2.0 + 0.5
    v = mx.random.normal((1, hkv, n + new, d))
    cache = TurboQuantCache(preset, layer=1)
    cache.update_and_fetch(k[:, :, :n], v[:, :, :n])
    view, _ = cache.update_and_fetch(k[:, :, n:], v[:, :, n:])
    return view


@pytest.mark.parametrize("preset", TURBO, ids=lambda p: p.name)
def test_dequant_reference_is_codec_decode(preset):
    view = _filled(preset, n=300, new=10)
    kc, vc = view.key_codec, view.value_codec
    seg_k, seg_v, _ = view.segments[0]
    for codec, enc in ((kc, seg_k), (vc, seg_v)):
        bits2 = codec.spec.bits2 if codec.rvq is not None else 0
        got = dq.dequant_reference(enc, kernel_table(codec), bits=codec.spec.bits, bits2=bits2, p=codec.padded_dim)
        want = codec.decode_rotated(enc).astype(mx.float16)
        assert mx.array_equal(got, want)


def test_dequant_head_and_after_rows():
    view = _filled(kvcache.get_preset("tq4"), n=300, new=10)
    kc = view.key_codec
    seg_k = view.segments[0][0]
    head = mx.random.normal((1, 2, 4, 64)).astype(mx.float16)
    after = mx.random.normal((1, 2, 9, 64)).astype(mx.float16)
    out = dq.dequant(seg_k, kernel_table(kc), bits=4, p=64, head=head, after=after)
    n = seg_k["norm"].shape[2]
    assert out.shape == (1, 2, 4 + n + 9, 64) and out.dtype == mx.float16
    assert mx.array_equal(out[:, :, :4], head) and mx.array_equal(out[:, :, 4 + n :], after)


@pytest.mark.parametrize("preset", TURBO, ids=lambda p: p.name)
@pytest.mark.parametrize("hq,hkv,lq,mask", [(4, 2, 300, "causal"), (6, 3, 129, "causal"), (2, 2, 65, None), (8, 2, 100, "array")])
def test_dense_path_matches_blocked_path(preset, hq, hkv, lq, mask):
    view = _filled(preset, hkv=hkv, new=lq)
    q = mx.random.normal((1, hq, lq, 64)) * 2.0
    if mask == "array":
        n = view.offset
        mask = mx.arange(n)[None, :] <= mx.arange(n - lq, n)[:, None]  # causal, as a bool array
    want = compressed_attention(q, view, scale=0.125, mask=mask, fused=False)
    got = dense_gpu.attention(q, view, 0.125, mask)
    err = np.abs(np.array(got) - np.array(want)).max() / np.abs(np.array(want)).max()
    assert err < 5e-3, err  # fp16 keys, values and queries against the fp32 blocked path


def test_routing_takes_the_dense_path_for_many_rows_on_a_gpu(monkeypatch):
    view = _filled(kvcache.get_preset("tq4"), new=200)
    calls = []
    monkeypatch.setattr(dense_gpu, "attention", lambda *a: calls.append(a[0].shape) or a[0])
    q = mx.random.normal((1, 4, 200, 64))
    with _prelude.force_backend("cpu"):
        compressed_attention(q, view, scale=0.125, mask="causal")
    assert calls == []  # the CPU keeps its own path
    with _prelude.force_backend("cuda"):
        assert dense_gpu.applies(view, "causal")
        compressed_attention(q, view, scale=0.125, mask="causal")
        assert attention.choose_path(view, "causal", 200)[0] == "dense-gpu"
        off = dataclasses.replace(view, paths=turbo.Paths(dense_gpu=False))  # the blocked path
        assert attention.choose_path(off, "causal", 200)[0] == "blocked"
    assert calls == [(1, 4, 200, 64)]


@gpu
@pytest.mark.parametrize("name", sorted(p.name for p in TURBO))
@pytest.mark.parametrize("p,length", [(64, 1), (64, 4099), (128, 517), (256, 33)])
def test_gpu_dequant(name, p, length):
    from kernel_cases import random_segment

    b1, b2, qjl, bv = preset_bits(name)
    _, _, keys, values, kt, vt = random_segment(1, 3, 1, p, length, b1, b2, bv, qjl, seed=length, capacity=length + 5)
    head = mx.random.normal((1, 3, 4, p)).astype(mx.float16)
    after = mx.random.normal((1, 3, 7, p)).astype(mx.float16)
    for enc, table, bits, bits2 in ((keys, kt, b1, b2), (values, vt, bv, 0)):
        kw = dict(bits=bits, bits2=bits2, p=p, head=head, after=after)
        assert mx.array_equal(dq.dequant(enc, table, **kw), dq.dequant_reference(enc, table, **kw))


@gpu
@pytest.mark.parametrize("preset", TURBO, ids=lambda p: p.name)
def test_gpu_dense_path_matches_blocked_path(preset):
    view = _filled(preset, hkv=2, n=3000, new=640)
    q = mx.random.normal((1, 8, 512, 64)) * 2.0
    want = compressed_attention(q, view, scale=0.125, mask="causal", fused=False)
    got = compressed_attention(q, view, scale=0.125, mask="causal")
    err = np.abs(np.array(got) - np.array(want)).max() / np.abs(np.array(want)).max()
    assert err < 5e-3, err


def test_encode_takes_the_fused_kernel_on_a_gpu():
    """On a GPU backend a scalar codec encodes through `hadamard_quantize` (one launch); its
    reference computes exactly what the MLX encode does."""
    from longctx.kernels import hadamard_quant as hq
    from longctx.quant.codec import QuantSpec, VectorCodec

    launched = []

    def reference(spec, launch):
        launched.append(spec.name)
        return list(hq.hadamard_quantize_reference(*launch.inputs))

    x = mx.random.normal((1, 2, 37, 128)) * 3.0
    for spec, fused in ((QuantSpec(4), True), (QuantSpec(3, bits2=0, qjl=True), False), (QuantSpec(2, bits2=2), False)):
        codec = VectorCodec(128, spec, seed=5)
        want = codec.encode(x)
        launched.clear()
        with _prelude.executor(reference, as_backend="cuda"):
            got = codec.encode(x)
        assert launched == (["lc_hadamard_quantize"] if fused else [])
        assert set(got) == set(want)
        for name in want:
            assert mx.array_equal(got[name], want[name]), name
    assert not VectorCodec(72, QuantSpec(4), seed=5).fused_encode()  # padded dims: MLX path


def _references():
    """An executor that runs every kernel's pure-MLX reference (and records the launches): the
    GPU backend's code paths on the CPU."""
    from longctx.kernels import prefill_encode as pe
    from longctx.kernels import rotate as rt

    launched = []

    def run(spec, launch):
        launched.append(spec.name)
        ins = launch.inputs
        if spec.name == "lc_prefill_encode":
            w, t = (int(v) for v in np.array(ins[7])[:2])
            return list(
                pe.prefill_encode_reference(*ins[:4], ins[4] if w else None, ins[5] if t else None, ins[6] if t else None)
            )
        if spec.name == "lc_rotate":
            tpl = dict(launch.template)
            return [
                rt.rotate_reference(
                    ins[0], ins[1], inverse=bool(tpl["INV"]), mean=ins[2] if tpl["HAS_MEAN"] else None, out_dtype=tpl["OT"]
                )
            ]
        if spec.name == "lc_dequant":
            s, w = (int(v) for v in np.array(ins[6])[:2])
            tpl = dict(launch.template)
            enc = {"idx": ins[0], "norm": ins[2]}
            if tpl["B2"]:
                enc["idx2"] = ins[1]
            return [
                dq.dequant_reference(
                    enc,
                    ins[3],
                    bits=tpl["B1"],
                    bits2=tpl["B2"],
                    p=tpl["P"],
                    head=ins[4] if s else None,
                    after=ins[5] if w else None,
                )
            ]
        if spec.name == "lc_hadamard_quantize":
            from longctx.kernels import hadamard_quant as hq

            return list(hq.hadamard_quantize_reference(*ins))
        raise AssertionError(f"unexpected kernel {spec.name}")

    return run, launched


def _assert_same_arrays(a: dict, b: dict) -> None:
    """Two caches' `arrays()` hold the same names and the same values, bit for bit."""
    assert set(a) == set(b)
    for key in a:
        assert mx.array_equal(a[key], b[key]), key


def _assert_close_outputs(got: list, want: list) -> None:
    """Attention outputs per chunk agree to bf16 precision."""
    for a, b in zip(got, want):
        a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
        assert np.abs(a - b).max() / np.abs(b).max() < 2e-2  # bf16 outputs


def _prefill(preset, chunks, fused, monkeypatch, hkv=2, d=64, hq=4, seed=0, refs=True, compiled=False):
    """Chunked prefill of one layer's cache through the GPU code paths (kernel references, or
    with `refs=False` the device's kernels; `compiled`: the compiled update and attention, which
    under the references executor trace the references); returns (cache, attention outputs per
    chunk, launches per chunk)."""
    mx.random.seed(seed)
    total = sum(chunks)
    k = (mx.random.normal((1, hkv, total, d)) * 2.0 + 0.5).astype(mx.bfloat16)
    v = mx.random.normal((1, hkv, total, d)).astype(mx.bfloat16)
    q = mx.random.normal((1, hq, total, d)).astype(mx.bfloat16)
    cache = TurboQuantCache(
        preset, layer=1, paths=turbo.Paths(compile="1" if compiled else "0", compile_under_executor=refs and compiled)
    )
    if not fused:
        monkeypatch.setattr(TurboQuantCache, "_fused_room", lambda self, n: None)
    outs, counts = [], []
    run, launched = _references()
    lo = 0
    import contextlib

    with _prelude.executor(run, as_backend="cuda") if refs else contextlib.nullcontext():
        for n in chunks:
            launched.clear()
            view, _ = cache.update_and_fetch(k[:, :, lo : lo + n], v[:, :, lo : lo + n])
            outs.append(compressed_attention(q[:, :, lo : lo + n], view, scale=0.125, mask="causal"))
            mx.eval(outs[-1], cache.state)
            counts.append(list(launched))
            lo += n
    monkeypatch.undo()
    return cache, outs, counts


@pytest.mark.parametrize("name", ["tq4", "tq3", "tq4k3v"])
def test_fused_prefill_chunks_match_the_unfused_update(name, monkeypatch):
    """A fused prefill chunk (`kernels/prefill_encode.py`) stores what the unfused update stores,
    bit for bit, and its attention matches; from the second chunk on a layer's chunk is six
    launches: encode, dequantize and rotate, each for keys and values / queries and output."""
    preset = kvcache.get_preset(name)
    chunks = [300, 256, 300, 200]
    want_cache, want, _ = _prefill(preset, chunks, False, monkeypatch)
    got_cache, got, counts = _prefill(preset, chunks, True, monkeypatch)
    _assert_close_outputs(got, want)  # bf16 outputs
    for c in counts[1:]:
        assert sorted(c) == sorted(["lc_prefill_encode"] * 2 + ["lc_dequant"] * 2 + ["lc_rotate"] * 2), c
    assert got_cache.offset == want_cache.offset and got_cache.tail_len == want_cache.tail_len
    wk, wv = want_cache.window
    gk, gv = got_cache.window
    assert mx.array_equal(gk, wk) and mx.array_equal(gv, wv)
    for c in (got_cache, want_cache):
        c.seal()
    _assert_same_arrays(got_cache.arrays(), want_cache.arrays())


@pytest.mark.parametrize("name", ["tq4", "tq4k3v"])
def test_compiled_prefill_matches_eager(name, monkeypatch):
    """The fused chunk's update and the dense attention compiled (`turbo._encode_chunk`,
    `dense_gpu._attend`, one trace per shape shared by layers) store and return what they do
    eagerly; a trace that meets a kernel variant not yet checked is dropped for an eager call."""
    from longctx.kvcache import dense_gpu, turbo

    preset = kvcache.get_preset(name)
    chunks = [300, 256, 300, 200, 256]
    want_cache, want, _ = _prefill(preset, chunks, True, monkeypatch)
    turbo._ENCODE.clear()
    dense_gpu._COMPILED.clear()
    got_cache, got, _ = _prefill(preset, chunks, True, monkeypatch, compiled=True)
    # the first chunk is eager (its sink); the second chunk's traces met the executor's
    # unchecked variants and were dropped; the later chunks' traces were kept
    assert len(turbo._ENCODE) == 3 and len(dense_gpu._COMPILED) == 3
    for a, b in zip(got, want):
        assert mx.array_equal(a, b)
    for c in (got_cache, want_cache):
        c.seal()
    _assert_same_arrays(got_cache.arrays(), want_cache.arrays())


def test_fused_prefill_then_decode_trim_and_fork(monkeypatch):
    """After fused chunks the cache keeps working through every other path: decode steps into
    the window, a trim, a fork, another chunk; the stored tokens equal the unfused cache's."""
    preset = kvcache.get_preset("tq4")
    caches = []
    for fused in (True, False):
        cache, _, _ = _prefill(preset, [300, 300], fused, monkeypatch)
        mx.random.seed(7)
        run, _ = _references()
        with _prelude.executor(run, as_backend="cuda"):
            for _ in range(3):
                cache.update_and_fetch(mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64)))
            cache.trim(5)
            child = cache.fork()
            child.update_and_fetch(mx.random.normal((1, 2, 200, 64)), mx.random.normal((1, 2, 200, 64)))
            cache.update_and_fetch(mx.random.normal((1, 2, 300, 64)), mx.random.normal((1, 2, 300, 64)))
            for c in (cache, child):
                c.seal()
        caches.append((cache.arrays(), child.arrays()))
    for a, b in zip(*caches):
        _assert_same_arrays(a, b)


@gpu
@pytest.mark.parametrize("p,bits", [(64, 4), (128, 4), (128, 3), (256, 2)])
@pytest.mark.parametrize("held", [False, True])
def test_gpu_prefill_encode(p, bits, held):
    from longctx.kernels import hadamard_quant as hq
    from longctx.kernels import prefill_encode as pe
    from longctx.quant.codebooks import as_mx
    from longctx.quant.codec import QuantSpec, VectorCodec

    codec = VectorCodec(p, QuantSpec(bits), seed=11)
    rng = np.random.default_rng(p + bits)
    x = mx.array(rng.normal(size=(1, 8, 512, p)).astype(np.float32) * 2).astype(mx.bfloat16)
    x = mx.swapaxes(mx.swapaxes(x, 1, 2), 1, 2)  # strided like a model's keys after rope
    mu = mx.array(rng.normal(size=(1, 8, 1, p)).astype(np.float32) * 0.3)
    bounds = as_mx(codec.codebook)[1]
    wd = bits * p // 32
    kw = {}
    if held:
        kw = dict(
            prev=mx.array(rng.normal(size=(1, 8, 128, p)).astype(np.float16)),
            old_idx=mx.array(rng.integers(0, 2**32, size=(1, 8, 1000, wd), dtype=np.uint32)),
            old_norm=mx.array(rng.random(size=(1, 8, 1000)).astype(np.float16)),
        )
    rot, idx, norm = pe.prefill_encode(x, mu, codec.rotation.signs, bounds, **kw)
    want = pe.prefill_encode_reference(x, mu, codec.rotation.signs, bounds, **kw)
    t, w = (1000, 128) if held else (0, 0)
    hi, hn = hq.hadamard_quantize((x.astype(mx.float32) - mu).reshape(-1, p), codec.rotation.signs, bounds)
    assert mx.array_equal(idx[:, :, t:].reshape(-1, wd), hi)  # the unfused kernel's, exactly
    assert mx.array_equal(norm[:, :, t:].reshape(-1), hn)
    assert mx.array_equal(idx[:, :, :t], want[1][:, :, :t])
    assert mx.array_equal(norm[:, :, :t], want[2][:, :, :t])
    assert mx.array_equal(rot[:, :, :w], want[0][:, :, :w])
    assert np.allclose(np.array(norm), np.array(want[2]), rtol=1e-3, atol=0)
    assert (np.array(idx) == np.array(want[1])).mean() > 0.99
    err = np.abs(np.array(rot.astype(mx.float32)) - np.array(want[0].astype(mx.float32))).max()
    assert err < 1e-2, err


@gpu
@pytest.mark.parametrize("p", [64, 128, 256])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_gpu_rotate(p, dtype):
    from longctx.kernels import rotate as rt
    from longctx.quant.codec import QuantSpec, VectorCodec

    codec = VectorCodec(p, QuantSpec(4), seed=p)
    x = (mx.random.normal((1, 32, 300, p)) * 3).astype(dtype)
    m = mx.random.normal((1, 8, 1, p))
    tol = 3e-2 if dtype == mx.bfloat16 else 5e-3
    for inverse, mean, out in ((False, None, mx.float16), (True, m, dtype)):
        got = rt.rotate(x, codec.rotation.signs, inverse=inverse, mean=mean, out_dtype=out)
        want = rt.rotate_reference(x, codec.rotation.signs, inverse=inverse, mean=mean, out_dtype=out)
        assert got.dtype == out
        err = np.abs(np.array(got.astype(mx.float32)) - np.array(want.astype(mx.float32))).max()
        assert err < tol, (inverse, err)


@gpu
@pytest.mark.parametrize("name", ["tq4", "tq4k3v"])
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_fused_prefill_chunks_match_the_unfused_update(name, compiled, monkeypatch):
    """On the device: fused prefill chunks, eager or compiled, store what the unfused update
    stores (codes may differ only next to a boundary, as between the two kernels' sums) and
    attend alike."""
    from longctx.kvcache import turbo

    preset = kvcache.get_preset(name)
    chunks = [512, 512, 512, 300]
    want_cache, want, _ = _prefill(preset, chunks, False, monkeypatch, hkv=8, d=128, hq=32, refs=False)
    turbo._ENCODE.clear()
    dense_gpu._COMPILED.clear()
    monkeypatch.setattr(_prelude, "_VERIFIED", set())  # every variant unchecked again
    got_cache, got, _ = _prefill(preset, chunks, True, monkeypatch, hkv=8, d=128, hq=32, refs=False, compiled=compiled)
    # compiled: the first chunk is eager (its sink), the second's traces met unchecked variants
    # and gave way to eager calls, the last two chunks' traces were kept
    assert (len(turbo._ENCODE), len(dense_gpu._COMPILED)) == ((2, 2) if compiled else (0, 0))
    _assert_close_outputs(got, want)
    for c in (got_cache, want_cache):
        c.seal()
    _assert_same_arrays(got_cache.arrays(), want_cache.arrays())
