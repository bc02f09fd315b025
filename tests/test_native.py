"""The native helper (`longctx.native`): a captured MLX graph replayed on new inputs, and the GPU
decode step replayed on it (its code paths on the CPU: the kernels run as their references).

Skipped where the helper is not built (no C++ compiler at set-up), except under
LONGCTX_REQUIRE_NATIVE=1 (CI builds it and runs these again with that set)."""

import dataclasses
import os

import mlx.core as mx
import pytest

from longctx import config, kvcache, native
from longctx.kernels import _prelude
from longctx.kernels import decode_attend as da
from longctx.kernels import decode_attend_mma as dm
from longctx.kernels import decode_finish as df
from longctx.kvcache import attend_step
from longctx.kvcache.attention import compressed_attention
from longctx.kvcache.turbo import TurboQuantCache

if native.load() is None:
    if os.environ.get("LONGCTX_REQUIRE_NATIVE") == "1":
        raise RuntimeError("LONGCTX_REQUIRE_NATIVE=1 but the native helper is not built "
                           "(python -m longctx.native build)")
    pytest.skip("the native helper is not built", allow_module_level=True)


def _graph(a, b, c):
    x = a.reshape(4, 16) * c  # (4, 16)
    q, r = mx.divmod(x, b)  # one primitive, two outputs (siblings)
    return (q + r).sum(axis=1), mx.concatenate([q, r]).T


def _arrays(seed):
    k = mx.random.split(mx.random.key(seed), 3)
    a = mx.random.normal((2, 2, 16), key=k[0])
    b = mx.random.uniform(1.0, 2.0, (16,), key=k[1])
    c = mx.random.normal((1,), key=k[2])
    return a, b, c


def test_tape_replays_the_graph_on_new_inputs():
    ins = _arrays(0)
    tape = native.Tape(ins, _graph(*ins))
    assert tape.nodes >= 5
    for seed in (1, 2):
        new = _arrays(seed)
        got = tape.replay(list(new))
        want = _graph(*new)
        assert len(got) == 2
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert mx.array_equal(g, w).item()


def test_tape_keeps_the_inputs_not_varying_and_the_constants():
    a, b, c = _arrays(0)
    k = mx.array([0.5, 1.5])  # a constant the graph holds (no primitive, not an input)
    tape = native.Tape([a, b, c], [(a.reshape(4, 16) * c + b) @ mx.ones((16, 2)) * k], [0])
    assert tape.constants >= 3  # b, c and k (and the ones)
    a2 = _arrays(5)[0]
    got = tape.replay([a2])[0]
    assert mx.array_equal(got, (a2.reshape(4, 16) * c + b) @ mx.ones((16, 2)) * k).item()


def test_tape_refuses_other_arrays():
    ins = _arrays(0)
    tape = native.Tape(ins, _graph(*ins))
    a, b, c = ins
    with pytest.raises(ValueError, match="expected 3 arrays"):
        tape.replay([a, b])
    with pytest.raises(ValueError, match="array 0 differs"):
        tape.replay([a.reshape(4, 16), b, c])
    with pytest.raises(ValueError, match="array 2 differs"):
        tape.replay([a, b, c.astype(mx.float16)])
    with pytest.raises(ValueError, match="distinct input positions"):
        native.Tape(ins, _graph(*ins), [0, 0])
    with pytest.raises(ValueError, match="distinct input positions"):
        native.Tape(ins, _graph(*ins), [3])


def test_an_evaluated_graph_has_no_nodes():
    """Evaluation detaches a graph: what the tape then holds is the value, not the work (why the
    decode step captures its graph before anything evaluates it)."""
    a, b, c = _arrays(0)
    out = a * c
    mx.eval(out)
    tape = native.Tape([a, b, c], [out])
    assert tape.nodes == 0
    assert mx.array_equal(tape.replay([b.reshape(1, 1, 16) + a, b, c])[0], out).item()


def _references(monkeypatch):
    def references(spec, launch, reference=None):
        return list(reference())

    for module in (da, dm, df):
        monkeypatch.setattr(module, "run", references)


def _fork(d: int = 64):
    preset = kvcache.get_preset("tq4")
    parent = TurboQuantCache(preset, 0)
    kv = mx.random.normal((2, 1, 2, 300, d), key=mx.random.key(3)).astype(mx.bfloat16)
    parent.update_and_fetch(kv[0], kv[1])
    parent.seal()
    return TurboQuantCache.from_arrays(preset, 0, parent.arrays(), d).fork(exact_new=300)


def test_native_decode_steps_match_the_compiled_plan(monkeypatch):
    """Two forks of one cache take the same tokens and queries: one keeps its plan on a tape, the
    other (LONGCTX_NATIVE=0) on MLX's compiled call. Each step's output is the same bit for bit,
    through the window's buffer filling (its tokens written in place: a tape that kept the
    buffers' arrays would read a stale window) and growing (a new plan)."""
    _references(monkeypatch)
    forks = {"tape": _fork(), "compiled": _fork()}
    attend_step._COMPILED.clear()
    kinds = {"tape": set(), "compiled": set()}
    with _prelude.force_backend("cuda"):
        question = mx.random.normal((2, 1, 2, 250, 64), key=mx.random.key(4)).astype(mx.bfloat16)
        for f in forks.values():
            f.update_and_fetch(question[0], question[1])
        for step in range(10):  # window 251..260: its buffer of 256 fills at 256, then grows
            new = mx.random.normal((2, 1, 2, 1, 64),
                                   key=mx.random.key(10 + step)).astype(mx.bfloat16)
            q = mx.random.normal((1, 8, 1, 64), key=mx.random.key(20 + step)).astype(mx.bfloat16)
            outs = {}
            for name, f in forks.items():
                with config.override(native=name == "tape"):  # LONGCTX_NATIVE
                    view, _ = f.update_and_fetch(new[0], new[1])
                    outs[name] = compressed_attention(q, view, 0.125)
                p = view.plan[0] if view.plan is not None else None
                if p is not None:
                    kinds[name].add("tape" if p.tape is not None else "compiled")
            mx.eval(outs)
            assert mx.array_equal(outs["tape"], outs["compiled"]).item(), step
    assert kinds == {"tape": {"tape"}, "compiled": {"compiled"}}


def test_native_plan_serves_a_bare_view_and_checks_its_arrays(monkeypatch):
    """A view without a window (benchmarks/attend.py's) keeps a tape plan; its replay with new
    queries equals the step built afresh, and queries of another dtype are not replayed (the
    plan's check, before the tape's own)."""
    _references(monkeypatch)
    fork = _fork()
    bare = dataclasses.replace(fork.view(), window=None, window_buffer=None, sink=None,
                               plan=[None])
    attend_step._COMPILED.clear()
    q = mx.random.normal((1, 8, 1, 64), key=mx.random.key(7)).astype(mx.bfloat16)
    with _prelude.force_backend("cuda"):
        first = [compressed_attention(q, bare, 0.125) for _ in range(2)]
        assert bare.plan[0] is not None and bare.plan[0].tape is not None
        again = attend_step.replay(q, bare, 0.125)
        assert again is not None and mx.array_equal(again, first[1]).item()
        q2 = mx.random.normal((1, 8, 1, 64), key=mx.random.key(8)).astype(mx.bfloat16)
        got = attend_step.replay(q2, bare, 0.125)
        want = attend_step.attention(q2, dataclasses.replace(bare, plan=[None]), 0.125)
        assert mx.array_equal(got, want).item()
        assert attend_step.replay(q2.astype(mx.float16), bare, 0.125) is None


def test_replayed_compiled_function_matches_and_recaptures():
    """`native.Replayed` over a compiled function (the cache's centering of a decode step's keys
    and values): its replays equal the compiled call bit for bit, new shapes are captured
    again, and LONGCTX_NATIVE=0 calls the function itself."""
    calls = []

    def center(k, v, km, vm):
        calls.append(1)
        return k.astype(mx.float32) - km, v.astype(mx.float32) - vm

    compiled = mx.compile(center)
    fn = native.Replayed(compiled)
    km, vm = mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 2, 1, 8))
    for step, n in enumerate((1, 1, 1, 5, 1)):
        k = mx.random.normal((1, 2, n, 8), key=mx.random.key(step)).astype(mx.bfloat16)
        v = mx.random.normal((1, 2, n, 8), key=mx.random.key(50 + step)).astype(mx.bfloat16)
        got, want = fn(k, v, km, vm), compiled(k, v, km, vm)
        assert all(mx.array_equal(g, w).item() for g, w in zip(got, want)), step
    assert sorted(key[0] for key in fn.tapes) == [(1, 2, 1, 8), (1, 2, 5, 8)]
    # a mean of another shape at a captured key shape: captured again, right
    km2 = mx.random.normal((1, 2, 1, 1))
    k = mx.random.normal((1, 2, 1, 8)).astype(mx.bfloat16)
    assert mx.array_equal(fn(k, k, km2, km2)[0], compiled(k, k, km2, km2)[0]).item()
    n = len(calls)
    with config.override(native=False):
        assert mx.array_equal(fn(k, k, km, vm)[1], compiled(k, k, km, vm)[1]).item()
    assert len(calls) == n  # (traced before: the compiled function's cache, no new trace)


def test_tape_refuses_another_default_stream():
    """A tape's primitives carry the stream they were captured on: under another default stream
    its replay is refused (as mx.compile's cache retraces there), and the decode step's replay
    then falls back to the full path."""
    ins = _arrays(0)
    tape = native.Tape(ins, _graph(*ins))
    with mx.stream(mx.new_stream(mx.default_device())):
        with pytest.raises(ValueError, match="default stream"):
            tape.replay(list(ins))
    assert len(tape.replay(list(ins))) == 2


def test_window_write_is_the_python_indexing():
    """`native.window_write` writes both buffers in place (the same Python objects, seen through
    every reference) and returns the windows, as `buf[:, :, lo:hi] = x; buf[:, :, :hi]` do; a
    write past the buffer is refused."""
    bufs = [mx.zeros((1, 2, 8, 4)) for _ in range(4)]
    held = bufs[0]  # another reference to a buffer object
    lo = 0
    for step, n in enumerate((3, 1, 1, 2)):
        k = mx.random.normal((1, 2, n, 4), key=mx.random.key(step))
        v = mx.random.normal((1, 2, n, 4), key=mx.random.key(10 + step)).astype(mx.bfloat16)
        wk, wv = native.window_write(bufs[0], bufs[1], k, v, lo)
        bufs[2][:, :, lo:lo + n] = k
        bufs[3][:, :, lo:lo + n] = v
        lo += n
        assert mx.array_equal(bufs[0], bufs[2]).item() and mx.array_equal(bufs[1], bufs[3]).item()
        assert mx.array_equal(wk, bufs[2][:, :, :lo]).item()
        assert mx.array_equal(wv, bufs[3][:, :, :lo]).item() and wv.dtype == mx.float32
    assert held is bufs[0] and mx.array_equal(held, bufs[2]).item()
    with pytest.raises(ValueError, match="past the buffer"):
        native.window_write(bufs[0], bufs[1], mx.zeros((1, 2, 2, 4)), mx.zeros((1, 2, 2, 4)), 7)
    with config.override(native=False):
        assert native.window_write(bufs[0], bufs[1], k, v, 0) is None


def test_tape_of_one_array_at_two_places():
    """An array given at two input positions when captured (a cache's keys and values may be one
    array): a replay with two different arrays there is refused (the graph reads the first
    position only), and `Replayed` then captures again and computes the right thing."""
    a, b = _arrays(0)[0], _arrays(1)[0]
    tape = native.Tape([a, a], [a * 2.0 + a * 3.0])  # (two uses of one array)
    assert mx.array_equal(tape.replay([b, b])[0], b * 2.0 + b * 3.0).item()
    with pytest.raises(ValueError, match="were one array"):
        tape.replay([a, b])
    with pytest.raises(ValueError, match="both a kept and a varying"):
        native.Tape([a, a], [a + 1], [0])
    fn = native.Replayed(lambda x, y: (x * 2.0 + y * 3.0,))
    assert mx.array_equal(fn(a, a)[0], a * 2.0 + a * 3.0).item()
    assert mx.array_equal(fn(a, b)[0], a * 2.0 + b * 3.0).item()


def test_an_evaluated_capture_is_not_kept():
    """A graph evaluated before its capture leaves only its value (`frozen_outputs`): `Replayed`
    does not keep such a tape, and computes every call; a deep upstream graph is walked without
    running out of stack."""
    a = _arrays(0)[0]
    out = a * 2.0
    mx.eval(out)
    assert native.Tape([a], [out]).frozen_outputs == 1
    assert native.Tape([a], [out.reshape(-1), a * 2.0]).frozen_outputs == 1  # a node over it
    assert native.Tape([a], [a * 2.0]).frozen_outputs == 0

    def evaluated(x):
        y = x * 2.0
        mx.eval(y)
        return (y,)

    fn = native.Replayed(evaluated)
    for seed in (1, 2):
        x = _arrays(seed)[0]
        assert mx.array_equal(fn(x)[0], x * 2.0).item()
    assert fn.tapes == {}
    deep = mx.zeros((2,))
    for _ in range(200_000):
        deep = deep + 1.0
    unreached = mx.ones((2,))
    tape = native.Tape([unreached], [deep * 3.0])  # the walk climbs the whole upstream graph
    assert tape.nodes > 200_000 and mx.array_equal(tape.replay([unreached])[0],
                                                   mx.full((2,), 600_000.0)).item()


def test_a_step_evaluated_while_built_keeps_no_tape(monkeypatch):
    """A kernel variant is checked on its first launch by evaluating it (`_prelude.run`): a step
    built that way has no graph left, and its tape would return that step's output forever. Such
    a step keeps no plan (each step then takes the full path), and its outputs stay right."""
    def evaluating(spec, launch, reference=None):
        outs = list(reference())
        mx.eval(outs)
        return outs

    for module in (da, dm, df):
        monkeypatch.setattr(module, "run", evaluating)
    bare = dataclasses.replace(_fork().view(), window=None, window_buffer=None, sink=None,
                               plan=[None])
    attend_step._COMPILED.clear()
    with _prelude.force_backend("cuda"):
        for seed in range(3):
            q = mx.random.normal((1, 8, 1, 64), key=mx.random.key(seed)).astype(mx.bfloat16)
            got = compressed_attention(q, bare, 0.125)
            assert bare.plan[0] is None, seed
            want = compressed_attention(q, bare, 0.125, fused=False)
            assert float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max()) < 0.05
