"""Per-backend preludes, so that one kernel body compiles for Metal and for CUDA through MLX.

A kernel body uses only these names (plus plain C++ arithmetic, `uint32_t`, `int64_t`, `float`):

    ids         lc_tid (thread in threadgroup), lc_tg (threadgroup in grid), lc_gid (thread in grid),
                lc_lane (lane in its 32-wide simdgroup/warp), lc_warp (simdgroup/warp in threadgroup)
    memory      LC_SHARED float buf[N];   (threadgroup / __shared__; declare at the body's top level)
                LC_BARRIER()              (threadgroup_barrier / __syncthreads)
    simd/warp   lc_simd_sum(x), lc_simd_max(x)          float, result identical in all 32 lanes
                lc_simd_ballot(pred, lc_lane)           uint32_t, bit i = pred of lane i
    numbers     LC_INF, LC_H2F(h) / LC_F2H(f) (fp16 load/store, round to nearest even),
                LC_EXP(x), LC_EXP2(x), LC_SQRT(x), LC_MAX(a, b), LC_MIN(a, b)
    loops       LC_UNROLL before a loop with a compile-time trip count
    vectors     LC_U4 t = LC_LD_U4(ptr, offset): four uint32 words (.x .y .z .w) in one 16-byte
                load; ptr + offset must be 16-byte aligned
    helpers     lc_pack_word(...) (packing.py's layout, see COMMON below)

MLX generates the signature: inputs arrive as `const T* name` (Metal: `const device T*`) plus
`name_shape` / `name_strides` when the body mentions them; template ints become compile-time
constants; the grid counts THREADS (grid=(n_groups * T, 1, 1), threadgroup=(T, 1, 1)).

Metal scans the body (not the header) for attribute names such as `thread_position_in_grid`, so
the ids are defined by a short prefix prepended to every body. Simdgroups are 32 wide on every
Apple GPU MLX supports, which the Metal prelude assumes. The CUDA prelude has been compiled and run
on an H200; the Metal prelude has NOT been compiled on a Mac (none was available).

`run(spec, launch)` builds each kernel object once (cached by backend, name and source digest;
the digest is also part of the MLX kernel name, since MLX caches compiled modules by name and
template values only) and calls it. Tests may install another executor (a CPU emulator).
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field

import mlx.core as mx

CUDA_HEADER = r"""
#define LC_CUDA 1
#define LC_SHARED __shared__
#define LC_DEVICE
#define LC_BARRIER() __syncthreads()
#define LC_INF __int_as_float(0x7f800000)
#define LC_H2F(x) __half2float(x)
#define LC_F2H(x) __float2half_rn(x)
#define LC_EXP(x) expf(x)
#define LC_EXP2(x) exp2f(x)
#define LC_SQRT(x) sqrtf(x)
#define LC_MAX(a, b) fmaxf((a), (b))
#define LC_MIN(a, b) fminf((a), (b))
#define LC_FN __device__ __forceinline__
#define LC_UNROLL _Pragma("unroll")
#define LC_U4 uint4
#define LC_LD_U4(p, off) (*reinterpret_cast<const uint4*>((p) + (off)))
LC_FN float lc_simd_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
LC_FN float lc_simd_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
LC_FN uint32_t lc_simd_ballot(bool p, uint32_t lane) { return __ballot_sync(0xffffffffu, p); }
"""

CUDA_IDS = r"""
  const uint32_t lc_tid = threadIdx.x;
  const uint32_t lc_tg = blockIdx.x;
  const uint32_t lc_gid = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t lc_lane = threadIdx.x & 31u;
  const uint32_t lc_warp = threadIdx.x >> 5;
"""

METAL_HEADER = r"""
#define LC_METAL 1
#define LC_SHARED threadgroup
#define LC_DEVICE device
#define LC_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define LC_INF INFINITY
#define LC_H2F(x) float(x)
#define LC_F2H(x) half(x)
#define LC_EXP(x) metal::exp(x)
#define LC_EXP2(x) metal::exp2(x)
#define LC_SQRT(x) metal::sqrt(x)
#define LC_MAX(a, b) metal::fmax((a), (b))
#define LC_MIN(a, b) metal::fmin((a), (b))
#define LC_FN inline
#define LC_UNROLL _Pragma("clang loop unroll(full)")
#define LC_U4 uint4
#define LC_LD_U4(p, off) (*((const device uint4*)((p) + (off))))
inline float lc_simd_sum(float x) { return simd_sum(x); }
inline float lc_simd_max(float x) { return simd_max(x); }
inline uint32_t lc_simd_ballot(bool p, uint32_t lane) { return simd_or(p ? (1u << lane) : 0u); }
"""

METAL_IDS = r"""
  const uint32_t lc_tid = thread_position_in_threadgroup.x;
  const uint32_t lc_tg = threadgroup_position_in_grid.x;
  const uint32_t lc_gid = thread_position_in_grid.x;
  const uint32_t lc_lane = thread_index_in_simdgroup;
  const uint32_t lc_warp = simdgroup_index_in_threadgroup;
"""

# Helpers shared by kernels, written with the macros above (after a backend header).
COMMON = r"""
// Word k (0..bits-1) of one packed group, from the group's 32 values codes[0..31] (any
// indexable: LC_SHARED array, registers). The group's values form a little-endian bit stream;
// value i occupies stream bits [bits*i, bits*i + bits), and a value may straddle two words.
#define LC_PACK_WORD(out, codes, k, bits)                                          \
  {                                                                              \
    const uint32_t lc_b0 = 32u * (uint32_t)(k);                                  \
    const uint32_t lc_first = lc_b0 / (uint32_t)(bits);                          \
    uint32_t lc_last = (lc_b0 + 31u) / (uint32_t)(bits);                         \
    lc_last = lc_last > 31u ? 31u : lc_last;                                     \
    uint32_t lc_w = 0u;                                                          \
    for (uint32_t lc_i = lc_first; lc_i <= lc_last; ++lc_i) {                    \
      const uint32_t lc_v = (uint32_t)(codes[lc_i]) & ((1u << (bits)) - 1u);     \
      const int lc_sh = (int)(lc_i * (uint32_t)(bits)) - (int)lc_b0;            \
      lc_w |= lc_sh >= 0 ? (lc_v << (uint32_t)lc_sh) : (lc_v >> (uint32_t)(-lc_sh)); \
    }                                                                            \
    out = lc_w;                                                                  \
  }
"""

PRELUDES = {"cuda": (CUDA_HEADER, CUDA_IDS), "metal": (METAL_HEADER, METAL_IDS)}


def backend() -> str:
    """Where kernels run now: "metal", "cuda" or "cpu" (the references), from the default device."""
    if _FORCED is not None:
        return _FORCED
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel is: its name, argument names, body and extra header (backend-neutral)."""

    name: str
    inputs: tuple
    outputs: tuple
    source: str
    header: str = ""
    row_contiguous: bool = True  # False: the body reads `<input>_strides` itself


@dataclass
class Launch:
    """One call: input arrays, template ints, grid and threadgroup (in threads), outputs."""

    inputs: list
    template: list
    grid: tuple
    threadgroup: tuple
    output_shapes: list
    output_dtypes: list
    meta: dict = field(default_factory=dict)


def assemble(spec: KernelSpec, which: str, preludes: dict | None = None) -> tuple[str, str]:
    """(header, body) for backend `which`: prelude header + COMMON + spec header; ids + body."""
    header, ids = (preludes or PRELUDES)[which]
    return header + COMMON + spec.header, ids + spec.source


_KERNELS: dict = {}
_FORCED: str | None = None
_EXECUTOR = None


def _mlx_kernel(spec: KernelSpec, which: str):
    header, body = assemble(spec, which)
    digest = hashlib.sha1((header + "\0" + body).encode()).hexdigest()[:10]
    key = (which, spec.name, digest)
    if key not in _KERNELS:
        make = mx.fast.metal_kernel if which == "metal" else mx.fast.cuda_kernel
        _KERNELS[key] = make(name=f"{spec.name}_{digest}", input_names=list(spec.inputs),
                             output_names=list(spec.outputs), source=body, header=header,
                             ensure_row_contiguous=spec.row_contiguous)
    return _KERNELS[key]


def run(spec: KernelSpec, launch: Launch) -> list:
    """Run `spec` on the current backend (or the installed executor) and return its outputs."""
    if _EXECUTOR is not None:
        return _EXECUTOR(spec, launch)
    which = backend()
    if which not in PRELUDES:
        raise RuntimeError(f"no GPU backend for kernel {spec.name} (backend: {which})")
    kernel = _mlx_kernel(spec, which)
    return kernel(inputs=launch.inputs, template=launch.template, grid=launch.grid,
                  threadgroup=launch.threadgroup, output_shapes=launch.output_shapes,
                  output_dtypes=launch.output_dtypes)


@contextlib.contextmanager
def executor(fn, as_backend: str = "cuda"):
    """Route every `run` through `fn(spec, launch)` and report `as_backend` (for CPU emulation)."""
    global _EXECUTOR, _FORCED
    saved = _EXECUTOR, _FORCED
    _EXECUTOR, _FORCED = fn, as_backend
    try:
        yield
    finally:
        _EXECUTOR, _FORCED = saved


@contextlib.contextmanager
def force_backend(which: str):
    """Pretend the backend is `which` ("cpu" forces the references on a GPU machine)."""
    global _FORCED
    saved = _FORCED
    _FORCED = which
    try:
        yield
    finally:
        _FORCED = saved


def groups(n: int, size: int) -> int:
    """ceil(n / size)."""
    return -(-n // size)
