"""Per-backend preludes, so that one kernel body compiles for Metal and for CUDA through MLX.

A kernel body uses only these names (plus plain C++ arithmetic, `uint32_t`, `int64_t`, `float`):

    ids         lc_tid (thread in threadgroup), lc_tg (threadgroup in grid), lc_gid (thread in grid),
                lc_lane (lane in its 32-wide simdgroup/warp), lc_warp (simdgroup/warp in threadgroup)
    memory      LC_SHARED float buf[N];   (threadgroup / __shared__; declare at the body's top level)
                LC_BARRIER()              (threadgroup_barrier / __syncthreads)
    simd/warp   lc_simd_sum(x), lc_simd_max(x)          float, result identical in all 32 lanes
                lc_simd_ballot(pred, lc_lane)           uint32_t, bit i = pred of lane i
                lc_simd_xor(x, m)                       float, lane l gets lane (l ^ m)'s x
                                                        (m < 32; every lane must take part)
    numbers     LC_INF, LC_H2F(h) / LC_F2H(f) (fp16 load/store, round to nearest even),
                LC_TOF(x) (any float input, float32/float16/bfloat16, as float),
                LC_EXP(x), LC_EXP2(x), LC_SQRT(x), LC_MAX(a, b), LC_MIN(a, b)
    loops       LC_UNROLL before a loop with a compile-time trip count; LC_UNROLL_N(n) before
                a runtime-bound loop, unrolled n times (loads of n iterations in flight)
    vectors     LC_U4 t = LC_LD_U4(ptr, offset): four uint32 words (.x .y .z .w) in one 16-byte
                load; ptr + offset must be 16-byte aligned; ptr may be an input in either Metal
                address space (MLX puts inputs of < 8 elements in `constant`, others in `device`);
                LC_ST_U4(out, offset, t): one 16-byte store into an output (aligned likewise);
                LC_F2H_BITS(f): the 16 bits of f rounded to fp16, as a uint32;
                LC_F4: four floats (.x .y .z .w), e.g. `LC_SHARED LC_F4 buf[N];` for 16-byte
                threadgroup reads
    helpers     lc_pack_word(...) (packing.py's layout, see COMMON below)

MLX generates the signature: inputs arrive as `const T* name` (Metal: `const device T*`) plus
`name_shape` / `name_strides` when the body mentions them; template ints become compile-time
constants; the grid counts THREADS (grid=(n_groups * T, 1, 1), threadgroup=(T, 1, 1)).

Metal scans the body (not the header) for attribute names such as `thread_position_in_grid`, so
the ids are defined by a short prefix prepended to every body. Simdgroups are 32 wide on every
Apple GPU MLX supports, which the Metal prelude assumes. The CUDA prelude has been compiled and run
on an H200; the Metal prelude has NOT been compiled on a Mac (none was available).

`run(spec, launch, reference)` builds each kernel object once (cached by backend, name and source
digest; the digest is also part of the MLX kernel name, since MLX caches compiled modules by name
and template values only) and calls it. Tests may install another executor (a CPU emulator).

Safety net: MLX compiles a kernel lazily, on the first evaluation of its outputs, and a build or
launch failure (a Metal compiler error, a CUDA resource limit) would surface far away, in the
middle of an answer. So the first launch of each distinct compiled variant (template values,
input dtypes and Metal address-space classes) is evaluated on the spot; if it raises, one
`KernelFallbackWarning` names the kernel, the backend and the first line of MLX's message, the
kernel is switched to its pure-MLX reference for the rest of the process, and this call returns
the reference's outputs. A first launch inside a function transformation (`mx.compile` tracing)
cannot be evaluated: it takes the reference (correct; callers trace only after an eager first
call, `kvcache.attention`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import warnings
from dataclasses import dataclass, field

import mlx.core as mx

CUDA_HEADER = r"""
#define LC_CUDA 1
#define LC_SHARED __shared__
#define LC_DEVICE
#define LC_BARRIER() __syncthreads()
#define LC_INF __int_as_float(0x7f800000)
#define LC_H2F(x) __half2float(x)
#define LC_TOF(x) static_cast<float>(x)
#define LC_F2H(x) __float2half_rn(x)
#define LC_EXP(x) expf(x)
#define LC_EXP2(x) exp2f(x)
#define LC_SQRT(x) sqrtf(x)
#define LC_MAX(a, b) fmaxf((a), (b))
#define LC_MIN(a, b) fminf((a), (b))
#define LC_FN __device__ __forceinline__
#define LC_UNROLL _Pragma("unroll")
#define LC_PRAGMA(x) _Pragma(#x)
#define LC_UNROLL_N(n) LC_PRAGMA(unroll n)
#define LC_U4 uint4
#define LC_F4 float4
#define LC_LD_U4(p, off) (*reinterpret_cast<const uint4*>((p) + (off)))
#define LC_ST_U4(p, off, v) (*reinterpret_cast<uint4*>((p) + (off)) = (v))
#define LC_F2H_BITS(x) ((uint32_t)__half_as_ushort(__float2half_rn(x)))
#define LC_BYTE(w, i) __byte_perm((w), 0u, 0x4440u | (uint32_t)(i))
// a float of threadgroup array `a` at byte offset `off` (a table read by a code already x4)
#define LC_AT_BYTE(a, off) (*reinterpret_cast<const float*>(reinterpret_cast<const char*>(a) + (off)))
LC_FN float lc_simd_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
LC_FN float lc_simd_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
LC_FN uint32_t lc_simd_ballot(bool p, uint32_t lane) { return __ballot_sync(0xffffffffu, p); }
LC_FN float lc_simd_xor(float x, int m) { return __shfl_xor_sync(0xffffffffu, x, m); }
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
#define LC_TOF(x) static_cast<float>(x)
#define LC_F2H(x) half(x)
#define LC_EXP(x) metal::exp(x)
#define LC_EXP2(x) metal::exp2(x)
#define LC_SQRT(x) metal::sqrt(x)
#define LC_MAX(a, b) metal::fmax((a), (b))
#define LC_MIN(a, b) metal::fmin((a), (b))
#define LC_FN inline
#define LC_UNROLL _Pragma("clang loop unroll(full)")
#define LC_PRAGMA(x) _Pragma(#x)
#define LC_UNROLL_N(n) LC_PRAGMA(clang loop unroll_count(n))
#define LC_U4 uint4
#define LC_F4 float4
// MLX declares an input `const constant T*` when it has fewer than 8 elements and `const device
// T*` otherwise, and MSL refuses casts between address spaces: one overload per space.
inline uint4 lc_ld_u4(const device uint32_t* p, int64_t off) {
  return *((const device uint4*)(p + off));
}
inline uint4 lc_ld_u4(const constant uint32_t* p, int64_t off) {
  return *((const constant uint4*)(p + off));
}
#define LC_LD_U4(p, off) lc_ld_u4((p), (int64_t)(off))
#define LC_ST_U4(p, off, v) (*((device uint4*)((p) + (off))) = (v))
#define LC_F2H_BITS(x) ((uint32_t)as_type<ushort>(half(x)))
#define LC_BYTE(w, i) ((((uint32_t)(w)) >> (8u * (uint32_t)(i))) & 255u)
#define LC_AT_BYTE(a, off) (*((threadgroup const float*)((threadgroup const char*)(a) + (off))))
inline float lc_simd_sum(float x) { return simd_sum(x); }
inline float lc_simd_max(float x) { return simd_max(x); }
inline uint32_t lc_simd_ballot(bool p, uint32_t lane) { return simd_or(p ? (1u << lane) : 0u); }
inline float lc_simd_xor(float x, int m) { return simd_shuffle_xor(x, (ushort)m); }
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
// In-place Walsh-Hadamard butterfly (unnormalized) over `rows` rows of p floats, row-major, in
// threadgroup memory `buf`; all nt threads of the group take part (tid: this one's index), and
// each of the log2(p) stages ends at a barrier (pair j, j + h at stride h: one thread's).
#define LC_WHT_ROWS(buf, rows, p, nt, tid)                                         \
  LC_UNROLL for (int lc_h = 1; lc_h < (p); lc_h <<= 1) {                           \
    for (int lc_i = (tid); lc_i < (rows) * ((p) / 2); lc_i += (nt)) {              \
      const int lc_r = lc_i / ((p) / 2);                                           \
      const int lc_k = lc_i - lc_r * ((p) / 2);                                    \
      const int lc_j = lc_r * (p) + (lc_k / lc_h) * (2 * lc_h) + (lc_k % lc_h);    \
      const float lc_a = buf[lc_j];                                                \
      const float lc_b = buf[lc_j + lc_h];                                         \
      buf[lc_j] = lc_a + lc_b;                                                     \
      buf[lc_j + lc_h] = lc_a - lc_b;                                              \
    }                                                                              \
    LC_BARRIER();                                                                  \
  }
// The same with rows, p and nt known at compile time and tid < nt: each stage's pairs are a
// fixed, unrolled count per thread (rows * p / 2 / nt), so the stage is its butterflies and a
// barrier; LC_WHT_ROWS' strided loop compiles to a generic loop (unrolled by 4, with its
// remainder and bound checks) whose ~160 instructions a stage every warp of a threadgroup
// issues (the decode step's prologue: 16 warps an SM rotating at once).
#define LC_WHT_ROWS_N(buf, rows, p, nt, tid)                                       \
  LC_UNROLL for (int lc_h = 1; lc_h < (p); lc_h <<= 1) {                           \
    LC_UNROLL for (int lc_o = 0; lc_o < (rows) * ((p) / 2); lc_o += (nt)) {        \
      const int lc_i = lc_o + (tid);                                               \
      if ((rows) * ((p) / 2) % (nt) == 0 || lc_i < (rows) * ((p) / 2)) {          \
        const int lc_r = lc_i / ((p) / 2);                                         \
        const int lc_k = lc_i - lc_r * ((p) / 2);                                  \
        const int lc_j = lc_r * (p) + (lc_k / lc_h) * (2 * lc_h) + (lc_k % lc_h);  \
        const float lc_a = buf[lc_j];                                              \
        const float lc_b = buf[lc_j + lc_h];                                       \
        buf[lc_j] = lc_a + lc_b;                                                   \
        buf[lc_j + lc_h] = lc_a - lc_b;                                            \
      }                                                                            \
    }                                                                              \
    LC_BARRIER();                                                                  \
  }
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


@functools.lru_cache(maxsize=None)
def strip_source(src: str) -> str:
    """`src` without its comments and indentation, runs of blanks as one, every line kept (so
    line numbers in compiler messages are unchanged); string literals as they are, and a line
    continued from the one before (a macro's `\\`) starts with one blank.

    MLX hashes a kernel's whole source at every launch (CUDA and Metal, mlx 0.32: the module's
    cache key), ~7.6 us for the 40 KB of the whole-step kernel on a 2-core x86 host, once per
    layer and token: this drops ~30% of it (what the kernel files keep for their readers).
    `assemble` strips a spec's texts when a kernel is first built (~30 ms for all of them: not
    at import, where the CPU, which launches none, would pay it); the preludes are stripped
    here, so their lengths are those of the assembled source (`metal_check` maps lines by
    them)."""
    out, i, n = [], 0, len(src)

    def blank():
        if not (out and out[-1].endswith(" ")):
            out.append(" ")

    while i < n:
        c = src[i]
        if c == '"' or (c == "'" and not (i and (src[i - 1].isalnum() or src[i - 1] == "_"))):
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            out.append(src[i : j + 1])
            i = j + 1
        elif src.startswith("//", i):  # to the end of the line, and of lines it splices on
            j = src.find("\n", i)
            while 0 <= j < n - 1 and src[j - 1] == "\\":
                out.append("\n")
                j = src.find("\n", j + 1)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank()
            lines = src.count("\n", i, j)
            if lines:  # each line it spans stays, spliced (a directive continues past it)
                out.append("\\\n" * lines)
            i = j
        elif c in " \t":
            while i < n and src[i] in " \t":
                i += 1
            blank()
        else:
            out.append(c)
            i += 1
    lines, cont = [], False
    for line in "".join(out).split("\n"):
        line = line.strip()
        lines.append(" " + line if cont and line else line)
        cont = line.endswith("\\")
    return "\n".join(lines)


CUDA_HEADER, CUDA_IDS, METAL_HEADER, METAL_IDS, COMMON = map(
    strip_source, (CUDA_HEADER, CUDA_IDS, METAL_HEADER, METAL_IDS, COMMON)
)
PRELUDES = {"cuda": (CUDA_HEADER, CUDA_IDS), "metal": (METAL_HEADER, METAL_IDS)}


# Bumped by `executor` / `force_backend`: a decode step's kept launch compares this one number
# instead of asking which executor and backend serve at every layer and token.
GENERATION = [0]


_GPU_KIND: list = []
_GPU_TYPE = (
    mx.DeviceType.gpu
)  # (a nanobind enum's attribute lookups: ~0.3 us a call)  # what the GPU device is, asked once: "metal", "cuda" or "cpu"


def backend() -> str:
    """Where kernels run now: "metal", "cuda" or "cpu" (the references), from the default device
    (asked at every call: a decode step asks a few times, so what the GPU is, is asked once)."""
    if _FORCED is not None:
        return _FORCED
    if mx.default_device().type != _GPU_TYPE:
        return "cpu"
    if not _GPU_KIND:
        cuda = getattr(mx, "cuda", None)
        _GPU_KIND.append("metal" if mx.metal.is_available() else "cuda" if cuda is not None and cuda.is_available() else "cpu")
    return _GPU_KIND[0]


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel is: its name, argument names, body and extra header (backend-neutral)."""

    name: str
    inputs: tuple
    outputs: tuple
    source: str
    header: str = ""
    row_contiguous: bool = True  # False: the body reads `<input>_strides` itself
    shared_memory: int = 0  # bytes of dynamic shared memory (CUDA only: `LC_DYN_SHARED`)


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
    """(header, body) for backend `which`: prelude header + COMMON + spec header; ids + body,
    the spec's texts without comments (`strip_source`)."""
    header, ids = (preludes or PRELUDES)[which]
    return header + COMMON + strip_source(spec.header), ids + strip_source(spec.source)


_KERNELS: dict = {}
_FORCED: str | None = None
_EXECUTOR = None
_VERIFIED: set = set()  # variants whose first launch evaluated cleanly
_FAILED: dict = {}  # kernel name -> (backend, first line of the error), for the rest of the process
# launches of unchecked variants met inside a function transformation (their references served):
# a caller compiling a function compares it before and after the trace (`traced_references`)
_TRACED_REFERENCES = [0]


class KernelFallbackWarning(RuntimeWarning):
    """A kernel failed to build or launch; its pure-MLX reference serves from now on."""


_BY_SPEC: dict = {}  # (backend, spec) -> kernel object: a launch's lookup without the digest
_SOURCES: dict = {}  # (backend, spec) -> (MLX kernel name, header, body) as handed to MLX
_PREPARED: set = set()  # CUDA variants handed to CUDA_PREPARE (below) before their first launch


def _mlx_kernel(spec: KernelSpec, which: str):
    # Hashing a spec hashes its strings, whose hashes Python keeps: ~1 us, where assembling the
    # source and its digest per launch was ~8-15 us (a prefill chunk launches six kernels per
    # layer, a decode step two)
    found = _BY_SPEC.get((which, spec))
    if found is not None:
        return found
    header, body = assemble(spec, which)
    digest = hashlib.sha1((header + "\0" + body).encode()).hexdigest()[:10]
    key = (which, spec.name, digest, spec.shared_memory)
    if key not in _KERNELS:
        extra = {"shared_memory": spec.shared_memory} if spec.shared_memory else {}
        make = mx.fast.metal_kernel if which == "metal" else mx.fast.cuda_kernel
        _KERNELS[key] = make(
            name=f"{spec.name}_{digest}",
            input_names=list(spec.inputs),
            output_names=list(spec.outputs),
            source=body,
            header=header,
            ensure_row_contiguous=spec.row_contiguous,
            **extra,
        )
    _SOURCES[(which, spec)] = (f"{spec.name}_{digest}", header, body)  # (before the fast path)
    _BY_SPEC[(which, spec)] = _KERNELS[key]
    return _KERNELS[key]


# Called before each variant's first CUDA launch in a process with (MLX kernel name, header,
# body, input names, output names, launch): the library's `runtime.cuda_kernels.prepare` (it puts
# the compiled module on disk where MLX looks, so MLX loads it instead of compiling it); None:
# nothing is done
CUDA_PREPARE = None


def _prepare_cuda(spec: KernelSpec, launch: Launch, variant: tuple) -> None:
    if variant in _PREPARED:
        return
    _PREPARED.add(variant)
    try:  # (a launch never fails here: building the kernel object is retried by the launch,
        _mlx_kernel(spec, "cuda")  # inside the fallback's reach)
        name, header, body = _SOURCES[("cuda", spec)]
        CUDA_PREPARE(name, header, body, spec.inputs, spec.outputs, launch)
    except Exception:  # noqa: BLE001
        pass


def failed(name: str) -> bool:
    """Whether kernel `name` failed earlier in this process (its reference serves instead)."""
    return name in _FAILED


def failure_count() -> int:
    """How many kernels failed in this process (a plan kept across calls is stale once it moves)."""
    return len(_FAILED)


def executor_installed() -> bool:
    """Whether a test or emulation executor runs the kernels (`executor`)."""
    return _EXECUTOR is not None


def _variant(spec: KernelSpec, which: str, launch: Launch) -> tuple:
    """What MLX compiles one module per: template values, dtypes, address-space classes."""
    return (
        which,
        spec.name,
        spec.header,
        spec.shared_memory,
        tuple(launch.template),
        tuple([(a.dtype, a.size < 8) for a in launch.inputs]),
        tuple(launch.output_dtypes),
        id(_EXECUTOR),
    )


def _in_transformation(arrays: list) -> bool:
    """Evaluate `arrays` (a kernel's inputs); True when that is refused because a function
    transformation (`mx.compile`, `vmap`) is tracing them."""
    try:
        mx.eval(arrays)
    except ValueError as err:
        if "transformation" in str(err):
            return True
        raise
    return False


def _fall_back(spec: KernelSpec, which: str, err: Exception) -> None:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    _FAILED[spec.name] = (which, first)
    warnings.warn(
        f"kernel {spec.name} failed on {which} ({first}); using its MLX reference for the rest of this process",
        KernelFallbackWarning,
        stacklevel=3,
    )


def run(spec: KernelSpec, launch: Launch, reference=None) -> list:
    """Run `spec` on the current backend (or the installed executor) and return its outputs.

    Args:
        spec: the kernel.
        launch: its inputs, template, grid and output shapes.
        reference: a zero-argument callable returning the same outputs (shapes and dtypes of
            `launch`) in pure MLX; with it a kernel that fails to build or launch falls back to
            it for the rest of the process (one warning), without it the error propagates.
    """
    which = _FORCED if _EXECUTOR is not None else backend()
    if reference is not None and spec.name in _FAILED:
        return list(reference())
    if _EXECUTOR is None and which not in PRELUDES:
        raise RuntimeError(f"no GPU backend for kernel {spec.name} (backend: {which})")

    def call():
        if _EXECUTOR is not None:
            return _EXECUTOR(spec, launch)
        return _mlx_kernel(spec, which)(
            inputs=launch.inputs,
            template=launch.template,
            grid=launch.grid,
            threadgroup=launch.threadgroup,
            output_shapes=launch.output_shapes,
            output_dtypes=launch.output_dtypes,
        )

    prepare = CUDA_PREPARE is not None and which == "cuda" and _EXECUTOR is None
    if reference is None:
        if prepare:
            _prepare_cuda(spec, launch, _variant(spec, which, launch))
        return call()
    variant = _variant(spec, which, launch)
    if variant in _VERIFIED:
        return call()
    if prepare:
        _prepare_cuda(spec, launch, variant)
    if _in_transformation(launch.inputs):
        _TRACED_REFERENCES[0] += 1
        return list(reference())
    try:
        outputs = call()
        mx.eval(outputs)
    except Exception as err:  # noqa: BLE001 - any build/launch failure: MLX raises RuntimeError,
        _fall_back(spec, which, err)  # an executor anything
        return list(reference())
    _VERIFIED.add(variant)
    return outputs


def traced_references() -> int:
    """How many launches so far took their reference because a trace met an unchecked variant
    (a compiled function traced then holds the slower reference for good: trace it again after
    one eager call)."""
    return _TRACED_REFERENCES[0]


@contextlib.contextmanager
def executor(fn, as_backend: str = "cuda"):
    """Route every `run` through `fn(spec, launch)` and report `as_backend` (for CPU emulation).
    The block starts with no kernel checked or failed, and its checks and failures (fallbacks)
    are forgotten when it ends."""
    global _EXECUTOR, _FORCED
    saved = _EXECUTOR, _FORCED, dict(_FAILED), set(_VERIFIED)
    _EXECUTOR, _FORCED = fn, as_backend
    GENERATION[0] += 1
    _FAILED.clear()
    _VERIFIED.clear()
    try:
        yield
    finally:
        _EXECUTOR, _FORCED = saved[:2]
        GENERATION[0] += 1
        _FAILED.clear()
        _FAILED.update(saved[2])  # an executor's failures stay inside its block
        _VERIFIED.clear()
        _VERIFIED.update(saved[3])


@contextlib.contextmanager
def force_backend(which: str):
    """Pretend the backend is `which` ("cpu" forces the references on a GPU machine)."""
    global _FORCED
    saved = _FORCED
    _FORCED = which
    GENERATION[0] += 1
    try:
        yield
    finally:
        _FORCED = saved
        GENERATION[0] += 1


_CONSTANTS: dict = {}

# MLX's CUDA allocator serves arrays of <= 8 bytes from a small pool of managed memory advised
# read-mostly, whose device copy every host write into the pool (any new scalar) invalidates: a
# kernel's first read of such an array could then wait for a page fault. ncu (MLX 0.32.4) found
# one 8-byte `scales` read stalling the decode step's tensor-core kernel for a large share of its
# time, where a 12-byte `params` array beside it read promptly (docs/performance.md).
MIN_CONSTANT_BYTES = 16


def constant(values: tuple, dtype) -> mx.array:
    """A small array of `values` (a kernel's parameters, scales or a count), made once per
    (values, dtype) and reused: every layer of a decode step, and every step, passes the same
    ones (a new array per call is a host-to-device copy each time). Up to 4096 are kept.

    Zeros pad it to MIN_CONSTANT_BYTES (kernels read its first len(values) entries; a pure-MLX
    reader takes `[:len(values)]`), so that it never lands in MLX's CUDA small-size pool."""
    key = (values, dtype)
    arr = _CONSTANTS.get(key)
    if arr is None:
        if len(_CONSTANTS) > 4096:
            _CONSTANTS.clear()
        pad = max(0, -(-MIN_CONSTANT_BYTES // dtype.size) - len(values))
        arr = _CONSTANTS[key] = mx.array(tuple(values) + (0,) * pad, dtype=dtype)
    return arr


def groups(n: int, size: int) -> int:
    """ceil(n / size)."""
    return -(-n // size)
