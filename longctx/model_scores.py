"""Scores the model itself gives a segment for a question (the `model` and `attention` rankers)
and an answer (choosing among answers from several segments).

- `question_likelihood`: the mean log-probability of the question's tokens after the segment
  (query likelihood).
- `attention_mass`: the share of the question's attention that lands on the segment's text, read
  in every compressed layer by an observer on `kvcache.attention.compressed_attention` (the
  question's queries scored against the segment's decoded keys).
- `answer_likelihood`: the mean log-probability of an answer's tokens after the question.

Each runs one forward pass over a fork of a restored cache (the cache itself is not changed).
"""

from __future__ import annotations

from longctx import kvcache


def question_likelihood(lm, cache: list, suffix: list[int], n_question: int) -> float:
    """Mean log-probability of the question's tokens (after its first) given the cached prefix."""
    import mlx.core as mx

    logits = lm.model(mx.array(suffix, dtype=mx.int32)[None], cache=kvcache.fork(cache))
    logits = logits[0, : n_question - 1].astype(mx.float32)  # predicts suffix[1:n_question]
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    target = mx.array(suffix[1:n_question], dtype=mx.int32)
    picked = mx.take_along_axis(logp, target[:, None], axis=-1)
    return float(mx.mean(picked).item())


def body_mass(queries, kv, scale: float, head: int, tail: int):
    """The largest share, over query heads, of the question's attention that lands on the
    document's text (not the template before and after it, nor the question itself), averaged
    over the question's tokens; one compressed layer."""
    import mlx.core as mx

    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.kvcache import dense_gpu

    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.kvcache.attend_fused import kernel_table

    kc = kv.key_codec
    if kv.dense is not None:  # the CPU's decoded prefix
        keys = kv.dense[0].astype(mx.float32)
    else:
        sink = dense_gpu.rotated_part(kc, kv.sink[0]) if kv.sink is not None else None
        keys = dense_gpu.decode_dense(kc, kernel_table(kc), [s[0] for s in kv.segments], sink, None).astype(mx.float32)
    B, Hq, Lq, _ = queries.shape
    Hkv, n = keys.shape[1], keys.shape[2]
    q = kc.rotate(queries.astype(mx.float32)).reshape(B, Hkv, (Hq // Hkv) * Lq, -1)
    scores = (q @ keys.swapaxes(-1, -2)) * scale  # (B, H_kv, r * L_q, N)
    total = mx.logsumexp(scores, axis=-1)
    if kv.window is not None:
        win = kc.rotate(kv.window[0].astype(mx.float32))
        s_win = (q @ win.swapaxes(-1, -2)) * scale
        if kv.window_mask is not None:
            s_win = mx.where(kv.window_mask, s_win, -mx.inf)
        total = mx.logaddexp(total, mx.logsumexp(s_win, axis=-1))
    body = mx.logsumexp(scores[..., head : max(head + 1, n - tail)], axis=-1)
    share = mx.exp(body - total).reshape(B, Hq, Lq).mean(axis=-1)  # (B, H_q)
    return mx.max(share)


def attention_mass(lm, cache: list, suffix: list[int], head: int, tail: int) -> float:
    """Attention mass: run the question over the segment's cache and read, in every compressed
    layer, how much of its attention goes to the segment's text; the mean over layers."""
    import mlx.core as mx

    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.kvcache import attention

    shares = []

    def observe(queries, kv, scale):
        shares.append(body_mass(queries, kv, scale, head, tail))

    attention.OBSERVERS.append(observe)
    try:
        lm.model(mx.array(suffix, dtype=mx.int32)[None], cache=kvcache.fork(cache))
    finally:
        attention.OBSERVERS.remove(observe)
    if not shares:
        return 0.0
    return float(mx.mean(mx.stack(shares)).item())


def answer_likelihood(lm, cache: list, suffix: list[int], answer: list[int]) -> float:
    """Mean log-probability of `answer` after the question (how sure the model is of it)."""
    import mlx.core as mx

    if not answer:
        return float("-inf")
    ids = suffix + answer
    logits = lm.model(mx.array(ids, dtype=mx.int32)[None], cache=kvcache.fork(cache))
    logits = logits[0, len(suffix) - 1 : len(ids) - 1].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logp, mx.array(answer, dtype=mx.int32)[:, None], axis=-1)
    return float(mx.mean(picked).item())
