// Shared device helpers for cupy_dsa kernels: packing, warp reductions, the Hadamard butterfly,
// page addressing, tensor-core fragments. Compiled by NVRTC: no host standard library here.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace dsa {

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

// ---- page geometry (mirrors cupy_dsa/layouts.py) ------------------------------------------------
constexpr int kPageSlots = 64;
constexpr int kPageBits = 6;
constexpr int kHeadDim = 128;
constexpr int kBf16PageBytes = kPageSlots * kHeadDim * 2;     // 16384
constexpr int kFp8PageBytes = kPageSlots * (kHeadDim + 4);     // 8448
constexpr int kFp8ScaleOffset = kPageSlots * kHeadDim;         // 8192

enum Layout { kLayoutBf16 = 0, kLayoutFp8 = 1 };

// ---- packing -------------------------------------------------------------------------------------
// Round-to-nearest-even of two fp32 values into one bf16x2 word (lo in the low half).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<u32*>(&v);
}

__device__ __forceinline__ float bf16_bits_to_float(unsigned short b) {
  return __uint_as_float(static_cast<u32>(b) << 16);
}

// e4m3 (RNE, saturating) of two fp32 values packed into 16 bits (lo byte = first value).
__device__ __forceinline__ unsigned short pack_e4m3x2(float lo, float hi) {
  return static_cast<unsigned short>(
      __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float e4m3_to_float(unsigned char b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
  return __half2float(__half(h));
}

// ---- warp reductions (xor butterfly: every lane ends with the same value, same order in all) ------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// Max over aligned groups of `Width` lanes (Width a power of two <= 32).
template <int Width>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int m = Width / 2; m >= 1; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// ---- Hadamard-128 on a warp, lane l holding elements 4l..4l+3 ------------------------------------
// Natural-order Sylvester transform y = H x, H[i,j] = (-1)^popcount(i&j): the lower index of each
// butterfly gets a+b, the upper a-b. Stages over element bits 0,1 are in-lane; bits 2..6 are lane
// bits 0..4 (shuffles). The caller applies the 128^-0.5 scale.
__device__ __forceinline__ void hadamard128(float (&x)[4], int lane) {
  float a0 = x[0] + x[1], a1 = x[0] - x[1], a2 = x[2] + x[3], a3 = x[2] - x[3];
  x[0] = a0 + a2; x[1] = a1 + a3; x[2] = a0 - a2; x[3] = a1 - a3;
#pragma unroll
  for (int m = 1; m <= 16; m <<= 1) {
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float o = __shfl_xor_sync(0xffffffffu, x[i], m);
      x[i] = upper ? (o - x[i]) : (x[i] + o);
    }
  }
}

// ---- page addressing ----------------------------------------------------------------------------
// Byte offset of a slot (out_loc = page*64 + slot) in a cache of `num_pages` rows of `PageBytes`;
// -1 when out of range (negative out_loc or page >= num_pages): the caller then touches nothing.
template <int PageBytes, int SlotBytes>
__device__ __forceinline__ i64 slot_byte_offset(i64 out_loc, i64 num_pages) {
  if (out_loc < 0) return -1;
  const i64 page = out_loc >> kPageBits;
  if (page >= num_pages) return -1;
  return page * PageBytes + (out_loc & (kPageSlots - 1)) * SlotBytes;
}

}  // namespace dsa
