"""How a prefill is cut and sized: chunk lengths and the facts the memory estimate and the
layer-major loop's in-flight bound share (a leaf module: engine, estimate and prefill_layers all
read it)."""

from __future__ import annotations

from longctx import config

DEFAULT_CHUNK = 512
MIN_CHUNK = 64
# `LONGCTX_PREFILL_PAIRS` (query-key pairs one chunk may score per head; 0, the default: fixed
# chunks) makes chunks shrink on long documents (at 5 * 2**22: 256 queries at 64k, 128 at 128k),
# so that one evaluation's attention work and, where the backend materializes scores (the CPU),
# its score buffers stay those of a ~40k prefix: a bound for the Metal watchdog, which kills
# command buffers of a few seconds (mlx-lm #1087). Measured on the CPU (a 4-layer random model,
# 16k tokens, pairs scaled to 1/8 of that to stand for 128k): the chunk working set 428 -> 202 MiB
# (fp16) and 401 -> 196 MiB (tq4), the longest evaluation 4.97 -> 1.64 s and 3.16 -> 1.53 s, at
# -4% (fp16) and -28% (tq4: every chunk reads the whole compressed prefix) prefill tokens/s.


def chunk_at(done: int, chunk: int = DEFAULT_CHUNK, pairs: int | None = None) -> int:
    """Tokens of the next chunk when `done` tokens are already cached: `chunk`, or fewer (down
    to MIN_CHUNK, in multiples of it) so that chunk x (done + chunk) stays within `pairs`
    (None: the `prefill_pairs` setting; 0: no bound)."""
    if pairs is None:
        pairs = config.get("prefill_pairs")
    if not pairs or chunk <= MIN_CHUNK or chunk * (done + chunk) <= pairs:
        return chunk
    n = chunk
    while n > MIN_CHUNK and n * (done + n) > pairs:
        n -= MIN_CHUNK
    return max(n, MIN_CHUNK)


ACTIVATIONS = 12  # a chunk's transients in flight, in multiples of its output (prefill_layers.chunk_bytes)
FUSED_SDPA_DIMS = (64, 80, 128)  # head dims whose prefill SDPA is fused on the GPUs (no scores)
