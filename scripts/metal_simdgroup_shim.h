// The simdgroup-matrix API of MSL (<metal_simdgroup_matrix>, which <metal_stdlib> includes), as
// declarations for metal_check's clang checks: scripts/metal_check.py includes this after the
// shared tool's metal_shim.h (which has no model of it). Both of its modes: `thread`,
// `threadgroup` and `device` are the shared shim's (address spaces in the "as" mode), so a load
// from or a store to another address space, a pointer whose element type is not the matrix's, or
// a matrix other than 8x8 of half / bfloat / float does not compile. MSL 3.x, section "SIMD-group
// matrix functions": simdgroup_matrix<T, Cols, Rows>; load / store take the elements per row,
// a matrix origin (ulong2) and whether to transpose; d = a * b (+ c), operands of mixed types.
#pragma once

namespace metal {

template <typename T> struct msl_sg_elem { static constexpr bool value = false; };
template <> struct msl_sg_elem<half> { static constexpr bool value = true; };
template <> struct msl_sg_elem<float> { static constexpr bool value = true; };
template <> struct msl_sg_elem<bfloat> { static constexpr bool value = true; };

template <typename T, uint Cols, uint Rows = Cols> struct simdgroup_matrix {
  static_assert(msl_sg_elem<T>::value, "simdgroup_matrix: half, bfloat or float elements");
  static_assert(Cols == 8 && Rows == 8, "simdgroup_matrix: 8x8");
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diagonal);
  T msl_sg_elems_[2];
};
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

// (In the "as" mode a returned matrix is a reference to a private one: C++ for OpenCL without
// the generic address space cannot assign a prvalue of class type to a private object, which MSL
// does, e.g. `acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);`.)
#ifdef __OPENCL_CPP_VERSION__
template <typename T, uint Cols, uint Rows = Cols>
const __private simdgroup_matrix<T, Cols, Rows>& make_filled_simdgroup_matrix(const T value);
#else
template <typename T, uint Cols, uint Rows = Cols>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const T value);
#endif

template <typename T, uint Cols, uint Rows>
void simdgroup_load(thread simdgroup_matrix<T, Cols, Rows>& d, const threadgroup T* src,
                    ulong elements_per_row = Cols, ulong2 matrix_origin = 0,
                    bool transpose_matrix = false);
template <typename T, uint Cols, uint Rows>
void simdgroup_load(thread simdgroup_matrix<T, Cols, Rows>& d, const device T* src,
                    ulong elements_per_row = Cols, ulong2 matrix_origin = 0,
                    bool transpose_matrix = false);
template <typename T, uint Cols, uint Rows>
void simdgroup_store(thread const simdgroup_matrix<T, Cols, Rows>& a, threadgroup T* dst,
                     ulong elements_per_row = Cols, ulong2 matrix_origin = 0,
                     bool transpose_matrix = false);
template <typename T, uint Cols, uint Rows>
void simdgroup_store(thread const simdgroup_matrix<T, Cols, Rows>& a, device T* dst,
                     ulong elements_per_row = Cols, ulong2 matrix_origin = 0,
                     bool transpose_matrix = false);

// d (M x N) = a (M x K) . b (K x N) [+ c (M x N)]; simdgroup_matrix<T, Cols, Rows>
template <typename T, typename U, typename V, uint M, uint N, uint K>
void simdgroup_multiply(thread simdgroup_matrix<T, N, M>& d,
                        thread const simdgroup_matrix<U, K, M>& a,
                        thread const simdgroup_matrix<V, N, K>& b);
template <typename T, typename U, typename V, typename W, uint M, uint N, uint K>
void simdgroup_multiply_accumulate(thread simdgroup_matrix<T, N, M>& d,
                                   thread const simdgroup_matrix<U, K, M>& a,
                                   thread const simdgroup_matrix<V, N, K>& b,
                                   thread const simdgroup_matrix<W, N, M>& c);

}  // namespace metal
