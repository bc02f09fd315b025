"""Fuzz the cache reader (hypothesis, bounded for CI): damaged copies of a real saved cache.

Every case writes a mutated copy of a tiny model's cache file in place and restores it. Only
`CacheCorrupt` / `CacheMismatch` may come out (0 crashes), and a restore that succeeds must have
read exactly the original (0 accepted corrupt files). The mutations and the oracle live in
`tests/test_fuzz_cache.py`, which also runs a seeded random campaign over them.
"""

from __future__ import annotations

import pytest
import test_fuzz_cache as fuzz_cache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CASES = 2500  # ~1-3 ms each on a 2-core CPU: a few seconds


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    work = tmp_path_factory.mktemp("fuzz")
    mp.setenv("LONGCTX_HOME", str(work / "home"))
    t = fuzz_cache.make_target(work)
    yield t
    t.store.close()
    mp.undo()


@pytest.fixture(autouse=True)
def _same_home(target, monkeypatch):
    # The autouse per-test LONGCTX_HOME would point elsewhere; the target's store is what counts.
    monkeypatch.setenv("LONGCTX_HOME", str(target.store.root.parent))


_params = st.integers(min_value=0, max_value=(1 << 30) - 1)
mutations = st.one_of(
    st.builds(fuzz_cache.Mutation, st.sampled_from(fuzz_cache.RAW_KINDS[:-1]), st.just(""), _params, _params, _params),
    st.builds(
        fuzz_cache.Mutation,
        st.sampled_from(["forge", "forge_nofix"]),
        st.sampled_from(fuzz_cache.FORGE_OPS),
        _params,
        _params,
        _params,
    ),
)


@settings(
    max_examples=CASES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(m=mutations)
def test_damaged_cache_is_refused_never_crashes_never_accepted(target, m):
    outcome = fuzz_cache.run_case(target, m)
    assert outcome in ("rejected", "accepted"), (m, outcome)


def test_original_still_restores(target):
    target.path.write_bytes(target.original)
    assert fuzz_cache.run_case(target, fuzz_cache.Mutation("append", a=-1 % 64)) == "rejected"
    target.path.write_bytes(target.original)
    from longctx import session

    cache = session.restore(target.entry, target.lm, target.store)
    assert all(c.offset == target.entry.tokens for c in cache)


@pytest.mark.parametrize("kind", fuzz_cache.RAW_KINDS)
def test_every_raw_mutation_kind_is_refused(target, kind):
    """Each raw mutation, at a few parameters, is rejected (a changed file is never accepted)."""
    for a, b, c in [(1, 2, 3), (12345, 7, 1), (999_999, 31, 200)]:
        m = fuzz_cache.Mutation(kind, "shape" if kind == "forge_nofix" else "", a, b, c)
        if fuzz_cache.mutate(target.original, m) != target.original:
            assert fuzz_cache.run_case(target, m) == "rejected", m
