"""Attention over a compressed cache: one decision picks the path, each path is a module.

    path            where                          module
    fused-step      GPU, one query token, one      attend_step (two launches: decode-attend with
                    scalar-coded segment, no mask  q rotation inside, then the finish kernel)
    fused-compiled  GPU, <= fused_max_lq queries   attend_fused (fused kernel under mx.compile)
    fused           GPU, a test's kernel executor  attend_blocked.attend(fused=True), uncompiled
    dense-gpu       GPU, more queries (prefill)    dense_gpu (dequantize kernel + fp16 SDPA)
    cpu-dense       CPU, a prefix decoded once     attend_cpu (one softmax, numpy exponentials)
    blocked         everything else                attend_blocked (pure MLX: the reference)

Soft-capped scores (Gemma-2, `softcap`) always take the blocked path: it is the only one that
caps. `choose_path` makes the decision and says why (logged at debug level by the logger
`longctx.attention`); `compressed_attention` runs it. The blocked path is the oracle the tests
hold every other path to. Switches: the cache's `turbo.Paths` (each view carries them:
`fused_max_lq`, `dense_gpu`, `compile`), and the keyword argument `fused_step` of `choose_path`
and `compressed_attention`.
"""

from __future__ import annotations

import logging

import mlx.core as mx

from longctx.kernels import _prelude
from longctx.kvcache import attend_blocked, attend_cpu, attend_fused, attend_step, compiling, dense_gpu
from longctx.kvcache.attend_blocked import BLOCK
from longctx.kvcache.attend_cpu import rotation_matrices
from longctx.kvcache.attend_fused import kernel_table
from longctx.kvcache.turbo import DEFAULT_PATHS, CompressedKV

__all__ = ["compressed_attention", "choose_path", "kernel_table", "rotation_matrices", "BLOCK"]

_log = logging.getLogger("longctx.attention")


def _kernel_mask(mask) -> bool:
    return mask is None or (isinstance(mask, str) and mask == "causal")


def use_fused(mask, lq: int, max_lq: int = DEFAULT_PATHS.fused_max_lq) -> bool:
    """Whether compressed segments go to the fused kernel: on a GPU backend, at most `max_lq`
    query tokens (`Paths.fused_max_lq`), a mask the kernel expresses (none, or causal), and a
    kernel that has not failed here."""
    return (
        _prelude.backend() != "cpu" and lq <= max_lq and _kernel_mask(mask) and not _prelude.failed("lc_decode_attend")
    )  # failed: the blocked path is its reference


def choose_path(
    kv: CompressedKV,
    mask,
    lq: int,
    fused: bool | None = None,
    softcap: float | None = None,
    rows: int = 1,
    fused_step: bool = True,
) -> tuple[str, str]:
    """(path, reason) for attention of `lq` query tokens over `kv` (see the module docstring).

    Args:
        rows: query heads per KV head.
        fused: None decides; True forces the fused kernel (mask None or causal), False forces
            the pure-MLX paths.
        softcap: soft-capped scores (Gemma-2) take the blocked path on every device: neither the
            kernels nor the fused SDPA nor the CPU's one-softmax path cap scores.
        fused_step: a decode step over one scalar-coded segment runs as two kernel launches
            (`attend_step`; False: the compiled fused path).
    """
    if softcap:
        if fused:
            raise ValueError("the fused kernel does not soft-cap scores")
        return "blocked", f"soft-capped scores (cap {softcap:g}): pure MLX only"
    if fused is None:
        fused = use_fused(mask, lq, kv.paths.fused_max_lq)
        if not fused and kv.paths.dense_gpu and dense_gpu.applies(kv, mask):
            return "dense-gpu", f"GPU, {lq} query tokens > fused_max_lq or a mask array"
    elif fused and not _kernel_mask(mask):
        raise ValueError("the fused kernel takes mask None or 'causal'")
    if fused:
        if fused_step and attend_step.applies(kv, mask, lq, rows):
            return "fused-step", "GPU, one query token over one scalar-coded segment"
        if compiling.executor_installed():
            return "fused", "a kernel executor is installed: every launch must reach it"
        if attend_fused.compile_wanted(lq, kv.paths.compile):
            return "fused-compiled", f"{_prelude.backend()} backend, {lq} query tokens"
        return "fused", f"the cache's compile mode {kv.paths.compile!r}"
    cpu = mx.default_device().type == mx.DeviceType.cpu
    if cpu and attend_cpu.applies(kv, mask, lq):
        return "cpu-dense", "CPU, the prefix is decoded once"
    return "blocked", "pure MLX" + (" (CPU)" if cpu else "")


# Called with (queries, view, scale) before each compressed attention (retrieval's attention-mass
# ranker reads the question's queries against the document's keys); empty in normal use.
OBSERVERS: list = []


def compressed_attention(
    queries: mx.array,
    kv: CompressedKV,
    scale: float,
    mask=None,
    block: int = BLOCK,
    fused: bool | None = None,
    softcap: float | None = None,
    fused_step: bool = True,
) -> mx.array:
    """Softmax attention of `queries` over a compressed cache.

    Args:
        queries: (B, H_q, L_q, D), rope already applied; H_q a multiple of the cache's H_kv.
        kv: the cache view returned by `TurboQuantCache.update_and_fetch`.
        scale: score scale (usually D ** -0.5).
        mask: None, "causal" (queries are the last L_q positions), or an mlx-lm mask array.
        block: keys decoded per step on the MLX path.
        fused: send compressed segments to `longctx.kernels.decode_attend` (None: decide, see
            `choose_path`; False: the pure-MLX paths). On the CPU the kernel function runs its
            pure-MLX reference.
        softcap: scores become `tanh(scale * s / softcap) * softcap` before the softmax
            (Gemma-2's `attn_logit_softcapping`); always the blocked path.
        fused_step: as `choose_path` takes it (tests and benchmarks compare the paths; a
            model's forward pass takes the default).

    Returns:
        (B, H_q, L_q, D) in the queries' dtype.
    """
    if OBSERVERS:
        for observe in OBSERVERS:
            observe(queries, kv, scale)
    lq = queries.shape[2]
    # a decode step whose layer kept its last step's launch (`attend_step._Plan`): replay it
    if kv.plan is not None and lq == 1 and mask is None and fused is None and not softcap and fused_step:
        out = attend_step.replay(queries, kv, scale, kv.paths.tensor_cores)
        if out is not None:
            return out
    path, why = choose_path(kv, mask, lq, fused, softcap, queries.shape[1] // max(1, kv.value_mean.shape[1]), fused_step)
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("attention: %s (%s)", path, why)
    if path == "fused-step":
        return attend_step.attention(queries, kv, scale, tensor_cores=kv.paths.tensor_cores)
    if path == "dense-gpu":
        return dense_gpu.attention(queries, kv, scale, mask)
    if path == "fused-compiled":
        return attend_fused.compiled_attention(queries, kv, scale, mask)
    if path == "cpu-dense":
        return attend_cpu.attention(queries, kv, scale, mask)
    kc, vc = kv.key_codec, kv.value_codec
    fused_now = path == "fused"
    tables = (kernel_table(kc), kernel_table(vc)) if fused_now else None
    cpu = mx.default_device().type == mx.DeviceType.cpu
    return attend_blocked.attend(queries, kv, kc, vc, tables, scale, mask, block, fused_now, cpu, softcap)
