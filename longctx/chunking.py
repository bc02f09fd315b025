"""How a prefill is cut and sized: chunk lengths and the facts the memory estimate and the
layer-major loop's in-flight bound share (a leaf module: engine, estimate and prefill_layers all
read it)."""

from __future__ import annotations

DEFAULT_CHUNK = 512
MIN_CHUNK = 64
# `pairs` (query-key pairs one chunk may score per head; 0, the default: fixed chunks) makes
# chunks shrink on long documents (at 5 * 2**22: 256 queries at 64k, 128 at 128k),
# so that one evaluation's attention work and, where the backend materializes scores (the CPU),
# its score buffers stay those of a ~40k prefix: a bound for the Metal watchdog, which kills
# command buffers of a few seconds (mlx-lm #1087). Measured on the CPU (a 4-layer random model,
# 16k tokens, pairs scaled to 1/8 of that to stand for 128k): the chunk working set 428 -> 202 MiB
# (fp16) and 401 -> 196 MiB (tq4), the longest evaluation 4.97 -> 1.64 s and 3.16 -> 1.53 s, at
# -4% (fp16) and -28% (tq4: every chunk reads the whole compressed prefix) prefill tokens/s.


def chunk_at(done: int, chunk: int = DEFAULT_CHUNK, pairs: int = 0) -> int:
    """Tokens of the next chunk when `done` tokens are already cached: `chunk`, or fewer (down
    to MIN_CHUNK, in multiples of it) so that chunk x (done + chunk) stays within `pairs`
    (0: no bound)."""
    if not pairs or chunk <= MIN_CHUNK or chunk * (done + chunk) <= pairs:
        return chunk
    n = chunk
    while n > MIN_CHUNK and n * (done + n) > pairs:
        n -= MIN_CHUNK
    return max(n, MIN_CHUNK)


# A prefill's defaults (keyword arguments of `engine.prefill`, `prefill_layers.prefill` and the
# memory estimate; benchmarks/prefill_shapes.py compares other values):
# the order of a compressed prefill of an empty cache: layer by layer, each layer attending its
# keys exactly before they are compressed ("layer"), or chunk by chunk through every layer,
# attending the compressed prefix ("token"); "auto": layer on a GPU, token on the CPU
ORDER = "layer"
# GPU, token-major: most bytes of dequantized cache rows a compressed prefill keeps queued (past
# it, older layers are waited for; 0: no bound), and the layers between two queueings of a
# chunk's graph (each costs host time; the bound still waits): `kvcache.turbo.sync`
INFLIGHT = 2**30
QUEUE_EVERY = 4
# GPU, layer-major (`prefill_layers`): most bytes of staging buffers and activations kept queued
# (past it, older groups are waited for; 0: no bound); a layer's graph queued every this many
# tokens (whole chunks; fewer where LAYER_INFLIGHT bounds what is queued); each layer called on
# runs of whole chunks of up to this many tokens (fewer calls and staging copies; each scores at
# most a 512-token chunk's pairs at 128k; 0: one call per chunk, as the fp16 prefill calls them)
LAYER_INFLIGHT = 256 * 2**20
GROUP_TOKENS = 4096
LAYER_CALL_TOKENS = 2048

ACTIVATIONS = 12  # a chunk's transients in flight, in multiples of its output (prefill_layers.chunk_bytes)
FUSED_SDPA_DIMS = (64, 80, 128)  # head dims whose prefill SDPA is fused on the GPUs (no scores)
