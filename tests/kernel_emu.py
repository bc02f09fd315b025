"""Run the kernels' bodies on the CPU, and compile them as MLX's CUDA JIT would (dev tools).

- `emulator()`: an executor for `longctx.kernels._prelude.executor`. Each kernel body is compiled
  with g++ under an emulation prelude: the threads of a threadgroup are OS threads meeting at a
  std::barrier, threadgroup memory is function-static (threadgroups run one after another), warp
  operations go through a per-warp exchange buffer; threadgroups run in a shuffled order. Inputs
  of kernels that read strides are embedded in larger buffers, so the strides are not the
  contiguous ones. Outputs start poisoned.
  This checks indexing, layout, barriers placement and the arithmetic, not GPU speed.
- `cuda_source()` / `nvcc_check()`: the exact source `mx.fast.cuda_kernel` hands NVRTC (the
  signature MLX generates around the body), compiled for sm_90 with nvcc against a stub of MLX's
  device header, returning ptxas' register / spill report.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from longctx.kernels import _prelude

BUILD = Path(tempfile.gettempdir()) / "longctx_kernel_emu"

EMU_HEADER = r"""
#include <cstdint>
#include <algorithm>
#include <cmath>
#include <math.h>
#include <barrier>
#include <thread>
#include <vector>
#include <memory>
typedef _Float16 lc_half_t;
struct lc_bf16_t {  // bfloat16: the top 16 bits of a float32, rounded to nearest even
  uint16_t b;
  lc_bf16_t() = default;
  lc_bf16_t(float f) {
    uint32_t u; __builtin_memcpy(&u, &f, 4);
    b = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const { uint32_t u = (uint32_t)b << 16; float f; __builtin_memcpy(&f, &u, 4); return f; }
};
struct LcWarp { std::barrier<>* bar; float f[32]; uint32_t u[32]; };
static LcWarp lc_warps[32];
static std::barrier<>* lc_group_bar;
static thread_local uint32_t lc_e_tid, lc_e_tg, lc_e_gid;
#define LC_EMU 1
#define LC_SHARED static
#define LC_DEVICE
#define LC_BARRIER() lc_group_bar->arrive_and_wait()
#define LC_INF INFINITY
#define LC_H2F(x) ((float)(x))
#define LC_TOF(x) ((float)(x))
#define LC_F2H(x) ((lc_half_t)(x))
#define LC_EXP(x) expf(x)
#define LC_EXP2(x) exp2f(x)
#define LC_SQRT(x) sqrtf(x)
#define LC_MAX(a, b) fmaxf((a), (b))
#define LC_MIN(a, b) fminf((a), (b))
#define LC_FN static inline
#define LC_UNROLL
#define LC_UNROLL_N(n)
#include <cstring>
struct lc_u4 { uint32_t x, y, z, w; };
static inline lc_u4 lc_ld_u4(const uint32_t* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16) __builtin_trap();  // the GPU would fault
  lc_u4 t; std::memcpy(&t, p, 16); return t;
}
#define LC_U4 lc_u4
struct lc_f4 { float x, y, z, w; };
#define LC_F4 lc_f4
#define LC_LD_U4(p, off) lc_ld_u4((p) + (off))
template <typename T> static inline void lc_st_u4(T* p, lc_u4 v) {
  if (reinterpret_cast<uintptr_t>(p) % 16) __builtin_trap();  // the GPU would fault
  std::memcpy(p, &v, 16);
}
#define LC_ST_U4(p, off, v) lc_st_u4((p) + (off), (v))
static inline uint32_t lc_f2h_bits(float x) {
  lc_half_t h = (lc_half_t)x; uint16_t b; std::memcpy(&b, &h, 2); return b;
}
#define LC_F2H_BITS(x) lc_f2h_bits(x)
static inline float lc_xchg(float x, uint32_t src) {
  LcWarp& w = lc_warps[lc_e_tid >> 5];
  w.f[lc_e_tid & 31u] = x;
  w.bar->arrive_and_wait();
  const float r = w.f[src];
  w.bar->arrive_and_wait();
  return r;
}
static inline float lc_simd_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += lc_xchg(x, (lc_e_tid & 31u) ^ (uint32_t)o);
  return x;
}
static inline float lc_simd_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, lc_xchg(x, (lc_e_tid & 31u) ^ (uint32_t)o));
  return x;
}
static inline float lc_simd_xor(float x, int m) {
  return lc_xchg(x, (lc_e_tid & 31u) ^ (uint32_t)m);
}
static inline uint32_t lc_simd_ballot(bool p, uint32_t lane) {
  LcWarp& w = lc_warps[lc_e_tid >> 5];
  w.u[lane] = p ? 1u : 0u;
  w.bar->arrive_and_wait();
  uint32_t r = 0u;
  for (uint32_t i = 0; i < 32u; ++i) r |= w.u[i] << i;
  w.bar->arrive_and_wait();
  return r;
}
// CUDA-only helpers (decode_attend_mma): dynamic shared memory, mma.sync m16n8k16 (fp16 in,
// fp32 accumulate; the PTX fragment layouts), cp.async (a plain copy here), prmt, half2 packing,
// 16-byte stores.
// Dynamic shared memory, poisoned (NaN / all ones) at the start of every threadgroup: a read of
// a word the kernel did not write shows up as NaN or a wild index, not as a plausible value.
#define LC_DYN_SHARED(name)                                                   \
  static uint32_t name[65536] __attribute__((aligned(16)));                   \
  if (lc_e_tid == 0u) std::memset(name, 0xFF, sizeof(name));                  \
  lc_group_bar->arrive_and_wait()
#define LC_HALF lc_half_t
struct LcMma { uint32_t a[32][4]; uint32_t b[32][2]; };
static LcMma lc_mma_x[32];
static inline float lc_h2f_bits(uint32_t bits) {
  const uint16_t b = (uint16_t)(bits & 0xffffu); lc_half_t h; std::memcpy(&h, &b, 2); return (float)h;
}
static inline void lc_mma_16816(float* d, const uint32_t* a, const uint32_t* b) {
  const uint32_t w = lc_e_tid >> 5, lane = lc_e_tid & 31u;
  LcMma& x = lc_mma_x[w];
  for (int i = 0; i < 4; ++i) x.a[lane][i] = a[i];
  x.b[lane][0] = b[0];
  x.b[lane][1] = b[1];
  lc_warps[w].bar->arrive_and_wait();
  const int g = (int)(lane >> 2), t = (int)(lane & 3u);
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i >> 1), n = 2 * t + (i & 1);
    float s = 0.0f;
    for (int k = 0; k < 16; ++k) {
      const uint32_t av = x.a[(r & 7) * 4 + ((k & 7) >> 1)][(r >> 3) + 2 * (k >> 3)];
      const uint32_t bv = x.b[n * 4 + ((k & 7) >> 1)][k >> 3];
      s += lc_h2f_bits(av >> (16 * (k & 1))) * lc_h2f_bits(bv >> (16 * (k & 1)));
    }
    out[i] = d[i] + s;
  }
  lc_warps[w].bar->arrive_and_wait();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}
static inline void lc_cp_async16(uint32_t* s, const uint32_t* g) {
  if (reinterpret_cast<uintptr_t>(s) % 16 || reinterpret_cast<uintptr_t>(g) % 16) __builtin_trap();
  std::memcpy(s, g, 16);
}
#define LC_CP_COMMIT()
#define LC_CP_WAIT(n)
#define LC_CP_WAIT0()
#define LC_SYNCWARP() lc_warps[lc_e_tid >> 5].bar->arrive_and_wait()
#define LC_BYTE(w, i) ((((uint32_t)(w)) >> (8u * (uint32_t)(i))) & 255u)
#define LC_AT_BYTE(a, off) (*reinterpret_cast<const float*>(reinterpret_cast<const char*>(a) + (off)))
struct lc_u2 { uint32_t x, y; };
#define LC_U2 lc_u2
static inline lc_u2 lc_ld_u2(const uint32_t* p) {
  if (reinterpret_cast<uintptr_t>(p) % 8) __builtin_trap();  // the GPU would fault
  lc_u2 t; std::memcpy(&t, p, 8); return t;
}
#define LC_LD_U2(p) lc_ld_u2(p)
static inline void lc_st_x4(uint32_t* p, uint32_t v) {
  if (reinterpret_cast<uintptr_t>(p) % 16) __builtin_trap();  // the GPU would fault
  p[0] = v; p[1] = v; p[2] = v; p[3] = v;
}
#define LC_ST_X4(p, v) lc_st_x4((p), (v))
static inline uint32_t lc_pack_h2(float lo, float hi) {
  return lc_f2h_bits(lo) | (lc_f2h_bits(hi) << 16);
}
#define LC_MIN_I(a, b) std::min((a), (b))
static inline float lc_ex2(float x) { return exp2f(x); }
static inline float lc_shfl_xor(float x, int m) { return lc_xchg(x, (lc_e_tid & 31u) ^ (uint32_t)m); }
static inline bool lc_any(bool p) { return lc_simd_ballot(p, lc_e_tid & 31u) != 0u; }
// decode_attend_mma's whole-step variant: a count per KV head in an input it updates
#define LC_FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
static inline int lc_atomic_add(const int32_t* p, int v) {
  return __atomic_fetch_add(const_cast<int32_t*>(p), v, __ATOMIC_SEQ_CST);
}
static inline void lc_atomic_zero(const int32_t* p) {
  __atomic_store_n(const_cast<int32_t*>(p), 0, __ATOMIC_SEQ_CST);
}
// Metal's simdgroup matrices (decode_attend_simdgroup), under their MSL names: 8x8
// simdgroup_matrix<T, Cols, Rows>, held two elements a lane in the layout Apple's GPUs use (MLX's
// steel `BaseMMAFrag::get_coord`: lane l, q = l / 4, holds row (q & 4) + (l / 2) % 4, columns
// 4 (q / 2 % 2) + 2 (l % 2) + {0, 1}). Load, store and the products are collective: every lane of
// the simdgroup takes part with the same pointer, row stride and transpose (checked: a trap
// otherwise); they order no memory between lanes (a lane reads and writes its own elements at
// once; simdgroup_barrier orders). load / store: element (r, c) at src[r * epr + c], or with
// transpose_matrix at src[c * epr + r]; a matrix_origin other than 0 is not modeled (trap).
// multiply_accumulate(d, a, b, c): d = a b + c, operands read exactly as float (half, bfloat,
// float), products and the sum over k in order in float, then + c, rounded to d's type.
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
static inline void simdgroup_barrier(mem_flags) { lc_warps[lc_e_tid >> 5].bar->arrive_and_wait(); }
static inline void lc_sg_coord(int i, int& r, int& c) {
  const int l = (int)(lc_e_tid & 31u), q = l >> 2;
  r = (q & 4) + ((l >> 1) & 3);
  c = (q & 2) * 2 + (l & 1) * 2 + i;
}
template <typename T, int Cols, int Rows = Cols> struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "simdgroup matrices are 8x8 here");
  T e[2];
  simdgroup_matrix() { e[0] = e[1] = (T)NAN; }  // undefined contents: NaN
  explicit simdgroup_matrix(T diag) {  // MSL: a diagonal matrix
    for (int i = 0; i < 2; ++i) { int r, c; lc_sg_coord(i, r, c); e[i] = r == c ? diag : (T)0.0f; }
  }
};
typedef simdgroup_matrix<lc_half_t, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<lc_bf16_t, 8, 8> simdgroup_bfloat8x8;
template <typename T, int Cols, int Rows = Cols>
static inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.e[0] = m.e[1] = v;
  return m;
}
struct lc_sg_origin { unsigned long x, y; lc_sg_origin(unsigned long v) : x(v), y(v) {} };
struct LcSg { const void* p[32]; unsigned long s[32]; bool t[32]; float a[64], b[64], c[64]; };
static LcSg lc_sg_x[32];
static inline void lc_sg_uniform(const void* p, unsigned long s, bool t) {
  const uint32_t w = lc_e_tid >> 5, l = lc_e_tid & 31u;
  LcSg& x = lc_sg_x[w];
  x.p[l] = p; x.s[l] = s; x.t[l] = t;
  lc_warps[w].bar->arrive_and_wait();
  if (x.p[l] != x.p[0] || x.s[l] != x.s[0] || x.t[l] != x.t[0]) __builtin_trap();  // not uniform
  lc_warps[w].bar->arrive_and_wait();
}
template <typename T, int C, int R>
static inline void simdgroup_load(simdgroup_matrix<T, C, R>& d, const T* src, unsigned long epr = C,
                                  lc_sg_origin o = 0, bool transpose_matrix = false) {
  if (o.x || o.y) __builtin_trap();
  for (int i = 0; i < 2; ++i) {
    int r, c; lc_sg_coord(i, r, c);
    d.e[i] = transpose_matrix ? src[c * epr + r] : src[r * epr + c];
  }
  lc_sg_uniform(src, epr, transpose_matrix);
}
template <typename T, int C, int R>
static inline void simdgroup_store(const simdgroup_matrix<T, C, R>& a, T* dst, unsigned long epr = C,
                                   lc_sg_origin o = 0, bool transpose_matrix = false) {
  if (o.x || o.y) __builtin_trap();
  for (int i = 0; i < 2; ++i) {
    int r, c; lc_sg_coord(i, r, c);
    (transpose_matrix ? dst[c * epr + r] : dst[r * epr + c]) = a.e[i];
  }
  lc_sg_uniform(dst, epr, transpose_matrix);
}
template <typename T, typename U, typename V, typename W>
static inline void lc_sg_mma(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<U, 8, 8>& a,
                             const simdgroup_matrix<V, 8, 8>& b, const simdgroup_matrix<W, 8, 8>* c) {
  const uint32_t w = lc_e_tid >> 5;
  LcSg& x = lc_sg_x[w];
  for (int i = 0; i < 2; ++i) {
    int r, cc; lc_sg_coord(i, r, cc);
    x.a[r * 8 + cc] = (float)a.e[i];
    x.b[r * 8 + cc] = (float)b.e[i];
    x.c[r * 8 + cc] = c ? (float)c->e[i] : 0.0f;
  }
  lc_warps[w].bar->arrive_and_wait();
  float out[2];
  for (int i = 0; i < 2; ++i) {
    int r, cc; lc_sg_coord(i, r, cc);
    float s = 0.0f;
    for (int k = 0; k < 8; ++k) s += x.a[r * 8 + k] * x.b[k * 8 + cc];
    out[i] = c ? s + x.c[r * 8 + cc] : s;
  }
  lc_warps[w].bar->arrive_and_wait();
  for (int i = 0; i < 2; ++i) d.e[i] = (T)out[i];
}
template <typename T, typename U, typename V, typename W>
static inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, 8, 8>& d,
                                                 const simdgroup_matrix<U, 8, 8>& a,
                                                 const simdgroup_matrix<V, 8, 8>& b,
                                                 const simdgroup_matrix<W, 8, 8>& c) {
  lc_sg_mma(d, a, b, &c);
}
template <typename T, typename U, typename V>
static inline void simdgroup_multiply(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<U, 8, 8>& a,
                                      const simdgroup_matrix<V, 8, 8>& b) {
  lc_sg_mma(d, a, b, (const simdgroup_matrix<T, 8, 8>*)nullptr);
}
"""

EMU_IDS = r"""
  const uint32_t lc_tid = lc_e_tid;
  const uint32_t lc_tg = lc_e_tg;
  const uint32_t lc_gid = lc_e_gid;
  const uint32_t lc_lane = lc_e_tid & 31u;
  const uint32_t lc_warp = lc_e_tid >> 5;
"""

_C_TYPES = {
    mx.uint8: "uint8_t",
    mx.uint32: "uint32_t",
    mx.int32: "int32_t",
    mx.float32: "float",
    mx.float16: "lc_half_t",
    mx.bfloat16: "lc_bf16_t",
}
_NP = {
    mx.uint8: np.uint8,
    mx.uint32: np.uint32,
    mx.int32: np.int32,
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,
}  # bfloat16: its bits
MAXD = 8


def available() -> bool:
    return shutil.which("g++") is not None


def _emu_source(spec, launch) -> str:
    header, body = _prelude.assemble(spec, "emu", {"emu": (EMU_HEADER, EMU_IDS)})
    params, call = [], []
    for i, (name, arr) in enumerate(zip(spec.inputs, launch.inputs)):
        t = _C_TYPES[arr.dtype]
        params += [f"const {t}* {name}", f"const int32_t* {name}_shape", f"const int64_t* {name}_strides"]
        call += [f"(const {t}*)bufs[{i}]", f"shapes + {i * MAXD}", f"strides + {i * MAXD}"]
    n_in = len(launch.inputs)
    for j, (name, dt) in enumerate(zip(spec.outputs, launch.output_dtypes)):
        params.append(f"{_C_TYPES[dt]}* {name}")
        call.append(f"({_C_TYPES[dt]}*)bufs[{n_in + j}]")
    consts = "".join(
        f"  typedef {_C_TYPES[v]} {k};\n" if isinstance(v, mx.Dtype) else f"  constexpr int {k} = {int(v)};\n"
        for k, v in launch.template
    )
    return (
        f"{header}\nstatic void lc_kernel({', '.join(params)}) {{\n{consts}{body}\n}}\n"
        "extern \"C\" void lc_launch(void** bufs, const int32_t* shapes, const int64_t* strides,"
        " int n_tg, int nt, const int32_t* order) {\n"
        "  std::barrier<> gb(nt);\n  lc_group_bar = &gb;\n"
        "  std::vector<std::unique_ptr<std::barrier<>>> wb;\n"
        "  for (int w = 0; w < nt / 32; ++w) {\n"
        "    wb.emplace_back(new std::barrier<>(32));\n    lc_warps[w].bar = wb.back().get();\n  }\n"
        "  std::vector<std::thread> ts;\n"
        "  for (int t = 0; t < nt; ++t) ts.emplace_back([=, &gb]() {\n"
        "    lc_e_tid = (uint32_t)t;\n"
        "    for (int g = 0; g < n_tg; ++g) {\n"
        "      lc_e_tg = (uint32_t)order[g];\n"
        "      lc_e_gid = (uint32_t)(order[g] * nt + t);\n"
        f"      lc_kernel({', '.join(call)});\n"
        "      gb.arrive_and_wait();\n    }\n  });\n"
        "  for (auto& th : ts) th.join();\n}\n"
    )


_LIBS: dict = {}


def _compile(src: str):
    digest = hashlib.sha1(src.encode()).hexdigest()[:16]
    if digest in _LIBS:
        return _LIBS[digest]
    BUILD.mkdir(parents=True, exist_ok=True)
    so = BUILD / f"k_{digest}.so"
    if not so.exists():
        cpp = BUILD / f"k_{digest}.cpp"
        cpp.write_text(src)
        tmp = BUILD / f"k_{digest}.{os.getpid()}.so"
        res = subprocess.run(
            ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unused-variable", "-o", str(tmp), str(cpp)],
            capture_output=True,
            text=True,
        )
        if res.returncode:
            raise RuntimeError(f"g++ failed for the emulated kernel:\n{res.stderr[-6000:]}")
        tmp.rename(so)
    lib = ctypes.CDLL(str(so))
    lib.lc_launch.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    _LIBS[digest] = lib
    return lib


def _embed(a: np.ndarray, odd_rows: bool = False) -> np.ndarray:
    """A view of `a` with the same values inside a larger buffer (padded along axis -2; with
    `odd_rows`, also one element along axis -1 of 4-d arrays: rows of odd stride)."""
    if a.ndim < 2:
        return a
    shape = list(a.shape)
    shape[-2] += 3
    pad = int(odd_rows and a.ndim == 4)
    shape[-1] += pad
    big = np.full(shape, 0x5A if a.dtype.kind in "ui" else np.nan, dtype=a.dtype)
    view = big[..., 1 : 1 + a.shape[-2], pad:]
    view[...] = a
    return view


def _poison(shape, dt) -> np.ndarray:
    npdt = _NP[dt]
    if np.issubdtype(npdt, np.floating):
        return np.full(shape, np.nan, dtype=npdt)
    return np.full(shape, np.iinfo(npdt).max, dtype=npdt)


def emulator(strided: bool = True, odd_rows: bool = False):
    """An executor running kernels on the CPU (see the module docstring); `odd_rows`: strided
    inputs' rows also get an odd stride (see `_embed`)."""

    def execute(spec, launch):
        lib = _compile(_emu_source(spec, launch))
        ins = []
        for a in launch.inputs:
            x = np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
            ins.append(_embed(x, odd_rows) if strided and not spec.row_contiguous else np.ascontiguousarray(x))
        outs = [_poison(s, d) for s, d in zip(launch.output_shapes, launch.output_dtypes)]
        shapes = np.zeros((len(ins), MAXD), dtype=np.int32)
        strides = np.zeros((len(ins), MAXD), dtype=np.int64)
        for i, x in enumerate(ins):
            shapes[i, : x.ndim] = x.shape
            strides[i, : x.ndim] = [s // x.itemsize for s in x.strides]
        bufs = (ctypes.c_void_p * (len(ins) + len(outs)))(*[x.ctypes.data for x in ins], *[o.ctypes.data for o in outs])
        tx = launch.threadgroup[0]
        assert tx % 32 == 0 and launch.threadgroup[1:] == (1, 1) and launch.grid[1:] == (1, 1)
        n_tg = -(-launch.grid[0] // tx)
        # threadgroups in a shuffled order, as a GPU may run them (one after another here)
        order = np.random.default_rng(n_tg).permutation(n_tg).astype(np.int32)
        lib.lc_launch(bufs, shapes.ctypes.data, strides.ctypes.data, n_tg, tx, order.ctypes.data)
        return [mx.array(o).view(mx.bfloat16) if d == mx.bfloat16 else mx.array(o) for o, d in zip(outs, launch.output_dtypes)]

    return execute


# --- CUDA: the source MLX's cuda_kernel builds, compiled with nvcc --------------------------


def cuda_source(spec, launch) -> str:
    """What `mx.fast.cuda_kernel` compiles for this spec and launch (`runtime.cuda_kernels`: mlx
    0.32 `build_kernel`; the kernel named `custom_kernel_<spec name>`)."""
    from longctx.runtime import cuda_kernels

    header, body = _prelude.assemble(spec, "cuda")
    return cuda_kernels.mlx_source(
        f"custom_kernel_{spec.name}",
        header,
        body,
        spec.inputs,
        launch.inputs,
        spec.outputs,
        launch.output_dtypes,
        launch.template,
    )


def nvcc_check(spec, launch, arch: str = "sm_90") -> str:
    """Compile the CUDA source with nvcc; return ptxas' resource report (raises on errors)."""
    from longctx.runtime import cuda_kernels

    BUILD.mkdir(parents=True, exist_ok=True)
    inc = BUILD / "stub_include" / "mlx" / "backend" / "cuda" / "device"
    inc.mkdir(parents=True, exist_ok=True)
    (inc / "utils.cuh").write_text(cuda_kernels.DEVICE_HEADER)
    src = cuda_source(spec, launch)
    digest = hashlib.sha1(src.encode()).hexdigest()[:16]
    cu = BUILD / f"c_{digest}.cu"
    cu.write_text(src)
    res = subprocess.run(
        [
            "nvcc",
            "-std=c++17",
            f"-arch={arch}",
            "-cubin",
            "-Xptxas",
            "-v",
            "-I",
            str(BUILD / "stub_include"),
            "-o",
            str(BUILD / f"c_{digest}.cubin"),
            str(cu),
        ],
        capture_output=True,
        text=True,
    )
    if res.returncode:
        raise RuntimeError(f"nvcc failed:\n{res.stderr[-6000:]}")
    return res.stderr


def nvrtc_check(
    spec,
    launch,
    libnvrtc: str,
    cccl_include: str | None = None,
    cuda_include: str = "/usr/local/cuda/include",
    arch: str = "sm_90",
) -> bytes:
    """Compile with NVRTC itself, as MLX's JIT does (`runtime.cuda_kernels`: same options, MLX's
    device header stubbed). Returns the cubin; raises with NVRTC's log on failure."""
    from longctx.runtime import cuda_kernels

    includes = [cuda_include] + ([cccl_include] if cccl_include else [])
    nvrtc = cuda_kernels._Nvrtc(libnvrtc, includes)
    cubin, _ = nvrtc.compile(cuda_source(spec, launch), spec.name, f"mlx::core::cu::custom_kernel_{spec.name}", arch)
    return cubin
