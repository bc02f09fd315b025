"""Decoding packed indices by table lookup in numpy: the CPU path that decodes a cache once.

MLX's CPU gather (`mx.take`) costs about 12 ns per element on the development machine, so
decoding a restored 4k-token cache of SmolLM2 (30 layers, keys and values) that way takes over a
second. numpy's `take` into a preallocated buffer costs about 1 ns per element. This module
decodes straight from the packed bytes: the packing layout (packing.py) is a little-endian bit
stream, so for bit widths that divide 8 each byte holds 8 / bits whole values, in order, and one
lookup in a 256-entry table yields all of them; for the other widths (3, 5, 6, 7) every run of
`bits` bytes holds 8 values, cut into fields of at most 12 bits, each looked up whole.

The result is bit-identical to `VectorCodec.decode_rotated`: the table entries are the same
float32 centroids (for two stages the same float32 sum c1[i1] + c2[i1, i2]) and the norm is
applied with the same float32 multiply (tests/test_lut.py checks equality).
"""

from __future__ import annotations

import functools
import sys

import mlx.core as mx
import numpy as np

from longctx.quant.packing import unpack

LITTLE_ENDIAN = sys.byteorder == "little"


@functools.lru_cache(maxsize=64)
def _field_table(values: bytes, bits: int, k: int) -> np.ndarray:
    """(2^(k*bits),) entries of 4k bytes: the k float32 values of every k*bits-bit field."""
    table = np.frombuffer(values, dtype=np.float32)
    field = np.arange(1 << (k * bits))
    slots = np.stack([table[(field >> (bits * s)) & ((1 << bits) - 1)] for s in range(k)], axis=-1)
    slots = np.ascontiguousarray(slots.astype(np.float32))  # (2^(k*bits), k)
    return slots.view(np.dtype((np.void, 4 * k))).reshape(-1)


# Values per table lookup: a whole byte where the width divides 8; otherwise fields of at most 12
# bits (tables of at most 4096 entries) inside each run of `bits` bytes, which holds 8 values.
_PER_LOOKUP = {1: 8, 2: 4, 4: 2, 8: 1, 3: 4, 5: 2, 6: 2, 7: 1}


def lookup(words: mx.array, bits: int, n: int, table: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """table[i] for the n packed `bits`-bit indices i of each row of `words`.

    Args:
        words: (..., bits * ceil(n / 32)) uint32, packing.py's layout.
        bits: 1..8.
        n: values per row.
        table: (2^bits,) float32.
        out: optional (..., n) float32 destination (its last axis contiguous).

    Returns:
        (..., n) float32 numpy array (`out` when given).
    """
    table = np.ascontiguousarray(table, dtype=np.float32)
    if not _byte_path(n):
        got = np.take(table, np.asarray(unpack(words, bits, n)))
        if out is None:
            return got
        out[...] = got
        return out
    return lookup_bytes(_stream(words), bits, n, table, out)


def _byte_path(n: int) -> bool:
    """Whether rows of n values decode straight from the packed bytes (`lookup_bytes`)."""
    return LITTLE_ENDIAN and n % 32 == 0


def _stream(words: mx.array) -> np.ndarray:
    """(..., bytes) uint8: the packed bit stream of `words` (a view where MLX allows)."""
    return _numpy(words, mx.uint32, np.uint32).view(np.uint8)


def _numpy(arr: mx.array, mx_dtype, np_dtype) -> np.ndarray:
    """`arr` as numpy `np_dtype`. An evaluated fp16/fp32/uint32 array is read in place and
    converted by numpy (the same exact widening as MLX's), so no MLX evaluation runs per call."""
    if arr.dtype in (mx.float16, mx.float32, mx.uint32):
        return np.asarray(arr).astype(np_dtype, copy=False)
    return np.asarray(arr.astype(mx_dtype))


def lookup_bytes(raw: np.ndarray, bits: int, n: int, table: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`lookup` on the bit stream `raw` (..., bytes) uint8, little-endian hosts, n % 32 == 0.
    numpy only: safe to run on a worker thread (numpy releases the GIL in the big loops)."""
    table = np.ascontiguousarray(table, dtype=np.float32)
    lead = raw.shape[:-1]
    k = _PER_LOOKUP[bits]
    tab = _field_table(table.tobytes(), bits, k)
    if 8 % bits == 0:
        idx = raw
    else:  # each run of `bits` bytes holds 8 values: assemble it, cut it into k-value fields
        run = raw.reshape(*lead, -1, bits)
        val = run[..., 0].astype(np.uint64)
        for j in range(1, bits):
            val |= run[..., j].astype(np.uint64) << np.uint64(8 * j)
        width = k * bits
        mask = np.uint64((1 << width) - 1)
        idx = np.empty((*val.shape, 8 // k), dtype=np.uint64)
        for s in range(8 // k):
            np.bitwise_and(val >> np.uint64(s * width), mask, out=idx[..., s])
        idx = idx.reshape(*lead, -1)
    if out is None:
        return np.take(tab, idx, mode="clip").view(np.float32).reshape(*lead, n)
    np.take(tab, idx, out=out.view(tab.dtype), mode="clip")  # n % 32 == 0: no padding to drop
    return out


def decode_rotated(codec, enc: dict[str, mx.array], head: np.ndarray | None = None) -> np.ndarray:
    """`codec.decode_rotated(enc)` as a numpy array, by table lookup (bit-identical).

    Args:
        codec: a `longctx.quant.codec.VectorCodec`.
        enc: its encoded arrays (`idx`, `norm`, and `idx2` for two stages).
        head: optional (..., S, padded_dim) float32 rows placed before the decoded ones (one
            buffer, no concatenation afterwards).

    Returns:
        (..., S + L, padded_dim) float32.
    """
    return finish(prepare(codec, enc, head))


def prepare(codec, enc: dict[str, mx.array], head: np.ndarray | None = None) -> dict:
    """The MLX half of `decode_rotated` (reads the packed arrays out of MLX, on the calling
    thread); `finish` does the rest in numpy alone, so it may run on another thread."""
    p = codec.padded_dim
    c1 = codec.codebook.centroids.astype(np.float32)
    job = {"norm": _numpy(enc["norm"], mx.float32, np.float32), "head": head, "p": p}  # norm (..., L)
    if codec.rvq is None and _byte_path(p):
        job.update(raw=_stream(enc["idx"]), bits=codec.spec.bits, table=c1)
    elif codec.rvq is None:
        job["rows"] = lookup(enc["idx"], codec.spec.bits, p, c1)
    else:
        b2 = codec.spec.bits2
        c2 = codec.rvq.stage2.centroids.astype(np.float32).reshape(len(c1), -1)
        table = (c1[:, None] + c2).ravel()  # the float32 sum rvq.dequantize computes
        i1 = unpack(enc["idx"], codec.spec.bits, p).astype(mx.uint32)
        i2 = unpack(enc["idx2"], b2, p).astype(mx.uint32)
        job["rows"] = np.take(table, np.asarray((i1 << b2) | i2))
    return job


def finish(job: dict) -> np.ndarray:
    """The numpy half of `decode_rotated`: table lookup into one buffer, times the norms."""
    norm, head, p = job["norm"], job["head"], job["p"]
    s = 0 if head is None else head.shape[-2]
    full = np.empty((*norm.shape[:-1], s + norm.shape[-1], p), dtype=np.float32)
    if s:
        full[..., :s, :] = head
    body = full[..., s:, :]  # the decoded rows, written in place
    if "raw" in job:
        lookup_bytes(job["raw"], job["bits"], p, job["table"], out=body)
    else:
        body[...] = job["rows"]
    body *= norm[..., None]
    return full


__all__ = ["decode_rotated", "finish", "lookup", "lookup_bytes", "prepare"]
