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
// bits 0..4 (shuffles). Unnormalized: see hadamard128_orthonormal.
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

// H x * 128^-0.5 (orthonormal, so q.k is preserved). The scale is a correctly rounded constant: rsqrtf's
// approximation could differ by an ulp from the references.
__device__ __forceinline__ void hadamard128_orthonormal(float (&x)[4], int lane) {
  hadamard128(x, lane);
  const float hs = __int_as_float(0x3db504f3);
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = __fmul_rn(x[i], hs);
}

// SGLang's per-row fp8 of a warp's 128 values (4 per lane): scale = max(amax, 1e-4) / 448 (plain fp32),
// e4m3 (RNE, saturating) of x * (1 / scale); returns this lane's 4 codes packed, the scale in `scale`.
__device__ __forceinline__ u32 fp8_quantize_row(const float (&x)[4], float& scale) {
  const float amax = warp_max(fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3]))));
  // fmaxf drops NaN: a row holding one gets a NaN scale (and NaN codes), as the reference's amax does
  const bool nan = __any_sync(0xffffffffu, isnan(x[0]) || isnan(x[1]) || isnan(x[2]) || isnan(x[3]));
  scale = nan ? __int_as_float(0x7fc00000) : fmaxf(amax, 1e-4f) / 448.f;
  const float inv = 1.f / scale;
  return static_cast<u32>(pack_e4m3x2(__fmul_rn(x[0], inv), __fmul_rn(x[1], inv))) |
         (static_cast<u32>(pack_e4m3x2(__fmul_rn(x[2], inv), __fmul_rn(x[3], inv))) << 16);
}

// ---- RoPE (interleaved pairs), fp4 simulation: shared by the key store and the query prep -------
__device__ __forceinline__ float rot_re(float re, float im, float c, float s) {
  return __fsub_rn(__fmul_rn(re, c), __fmul_rn(im, s));
}
__device__ __forceinline__ float rot_im(float re, float im, float c, float s) {
  return __fadd_rn(__fmul_rn(re, s), __fmul_rn(im, c));
}

// V4: trailing 64 dims, interleaved pairs (x[64+2j], x[65+2j]).
__device__ __forceinline__ void rope_v4(float (&x)[4], const float4& f, int lane) {
  if (lane >= 16) {
    const float r0 = rot_re(x[0], x[1], f.x, f.y), i0 = rot_im(x[0], x[1], f.x, f.y);
    const float r1 = rot_re(x[2], x[3], f.z, f.w), i1 = rot_im(x[2], x[3], f.z, f.w);
    x[0] = r0; x[1] = i0; x[2] = r1; x[3] = i1;
  }
}


// DeepSeek-V4 QAT: e2m1 value times a ue8m0 scale 2^ceil(log2(max(amax, 1e-4) / 6)) per 32 elements
// (8 lanes); ties go to the even code. Every result is exact in bf16. A block that holds a NaN or an
// infinity has no scale: all of it becomes NaN (fmaxf would skip a NaN and an infinite scale wraps).
__device__ __forceinline__ float e2m1_round(float q) {
  const float a = fabsf(q);
  float r;
  if (a <= 0.25f) r = 0.f;
  else if (a < 0.75f) r = 0.5f;
  else if (a <= 1.25f) r = 1.f;
  else if (a < 1.75f) r = 1.5f;
  else if (a <= 2.5f) r = 2.f;
  else if (a < 3.5f) r = 3.f;
  else if (a <= 5.f) r = 4.f;
  else r = 6.f;
  return copysignf(r, q);
}

__device__ __forceinline__ bool is_finite_f32(float v) {
  return (__float_as_uint(v) & 0x7F800000u) != 0x7F800000u;
}

__device__ __forceinline__ void fp4_simulate(float (&x)[4]) {
  const bool finite = is_finite_f32(x[0]) && is_finite_f32(x[1]) && is_finite_f32(x[2]) && is_finite_f32(x[3]);
  float amax = fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3])));
  if (!finite) amax = __int_as_float(0x7F800000);
  amax = group_max<8>(amax);  // +inf when a lane of the block holds a NaN or an infinity
  if (!is_finite_f32(amax)) {
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = __int_as_float(0x7FFFFFFF);
    return;
  }
  const float t = fmaxf(amax, 1e-4f) / 6.f;
  const u32 bits = __float_as_uint(t);
  const int e = static_cast<int>((bits >> 23) & 0xFFu) - 127 + ((bits & 0x7FFFFFu) != 0u);  // ceil(log2 t)
  const float scale = __uint_as_float(static_cast<u32>(e + 127) << 23);
  const float inv = __uint_as_float(static_cast<u32>(127 - e) << 23);  // exact 1/scale
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = __fmul_rn(e2m1_round(__fmul_rn(x[i], inv)), scale);
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


// ---- balanced decode schedule ---------------------------------------------------------------------
// The plan of a decode batch (paged_mqa_logits_plan) is int64 [batch + 1]: plan[b] = pages (64 keys) that
// the requests before b must compute, plan[batch] = T in all. A request's computed pages are those some of
// its rows sees: ceil(max row length / 64), whatever the block table or the output width. CTA c of a grid of
// C takes the global pages [c T / C, (c+1) T / C) of the concatenation over requests: every CTA gets the
// same share whatever the mix of lengths, and the grid depends on the device only (CUDA-graph safe).

// Pages request b computes (row lengths as the decode kernels read them; negative lengths are empty).
__device__ __forceinline__ int decode_pages(const int* __restrict__ lens, int lens_2d, int next_n, int b) {
  int m = 0;
  if (lens_2d) {
    for (int r = 0; r < next_n; ++r) m = max(m, lens[static_cast<i64>(b) * next_n + r]);
  } else {
    m = lens[b];  // the last row sees the most: lens[b] - (next_n - 1 - r) at r = next_n - 1
  }
  return m > 0 ? m / kPageSlots + (m % kPageSlots != 0) : 0;
}

// Calls seg(b, page_begin, page_end) for each request segment of this CTA's share, in request order, with a
// barrier between segments (they reuse shared memory). Called by every thread of the CTA.
template <class F>
__device__ __forceinline__ void for_each_decode_segment(const i64* __restrict__ plan, int batch, F&& seg) {
  // First request whose pages reach past g0 = the number of requests that end at or before it (plan is
  // non-decreasing): one block-wide count per blockDim.x requests. The first chunk's ends are loaded
  // together with the total (one round trip before the first key load, not two).
  const int i0 = static_cast<int>(threadIdx.x) + 1;
  const i64 end0 = plan[min(i0, batch)];
  const i64 total = plan[batch];
  const i64 g0 = total * blockIdx.x / gridDim.x, g1 = total * (blockIdx.x + 1) / gridDim.x;
  int b = __syncthreads_count(i0 <= batch && end0 <= g0);
  for (int base = blockDim.x; b == base && base < batch; base += blockDim.x) {  // CTA-uniform
    const int i = base + static_cast<int>(threadIdx.x) + 1;
    b += __syncthreads_count(i <= batch && plan[min(i, batch)] <= g0);
  }
  if (g0 >= g1) return;  // CTA-uniform: no pages for this CTA
  bool first = true;
  for (; b < batch; ++b) {
    const i64 s = plan[b], e = plan[b + 1];
    if (s >= g1) break;
    const i64 lo = max(g0, s), hi = min(g1, e);
    if (lo >= hi) continue;  // a request with no pages
    if (!first) __syncthreads();
    first = false;
    seg(b, static_cast<int>(lo - s), static_cast<int>(hi - s));
  }
}

// clean_logits: -inf in every column [64 p, min(64 p + 64, width)) of the next_n rows of request b for the
// pages p in [pages_b, ceil(width / 64)) that no CTA computes (pages_b = plan[b+1] - plan[b]). Page p of
// request b is unit b * W + p of the batch x W grid; CTA c writes the units = c mod C, so every element is
// written by exactly one CTA and the fill is spread evenly. Called by every thread of the CTA.
__device__ __forceinline__ void fill_uncomputed_pages(const i64* __restrict__ plan, int batch, int next_n,
                                                      int width, float* __restrict__ out, i64 out_stride) {
  const i64 wp = width / kPageSlots + (width % kPageSlots != 0);
  const i64 C = gridDim.x, c = blockIdx.x;
  const float neg_inf = __int_as_float(0xff800000);
  for (int b = 0; b < batch; ++b) {
    const i64 pb = plan[b + 1] - plan[b];
    if (pb >= wp) continue;
    const i64 u0 = static_cast<i64>(b) * wp + pb;           // first unit of request b to fill
    for (i64 p = pb + ((c - u0 % C) + C) % C; p < wp; p += C) {
      const int n0 = static_cast<int>(p) * kPageSlots, cols = min(kPageSlots, width - n0);
      for (int i = threadIdx.x; i < next_n * kPageSlots; i += blockDim.x) {
        const int r = i / kPageSlots, col = i % kPageSlots;
        if (col < cols) out[(static_cast<i64>(b) * next_n + r) * out_stride + n0 + col] = neg_inf;
      }
    }
  }
}

// ---- prefill of several requests in one launch (varlen) ------------------------------------------
// Request b owns the query rows [cu_rows[b], cu_rows[b + 1]) clipped to the launch's [row_start, row_end); they
// are cut into tiles of kVarlenTileRows rows from the request's first row, so no tile holds two requests' rows
// (each tile reads its own request's pages only). The plan (mqa_logits_plan) is int64 [batch + 1]: plan[b] =
// the tiles of the requests before b. Row offsets are clipped, never trusted: a request that ends before it
// starts is empty, and no row outside [row_start, row_end) is read or written, whatever cu_rows holds.
constexpr int kVarlenTileRows = 4;

__device__ __forceinline__ void varlen_request_rows(const int* __restrict__ cu_rows, int b, int row_start,
                                                    int row_end, int& lo, int& hi) {
  lo = max(cu_rows[b], row_start);
  hi = max(lo, min(cu_rows[b + 1], row_end));
}

__device__ __forceinline__ i64 varlen_tiles(const int* __restrict__ cu_rows, int b, int row_start, int row_end) {
  int lo, hi;
  varlen_request_rows(cu_rows, b, row_start, row_end, lo, hi);
  return (hi - lo + kVarlenTileRows - 1) / kVarlenTileRows;
}

// Tile x of a varlen launch: its request b and its rows [row0, rend) (at most kVarlenTileRows). False
// (CTA-uniform) when x is past the plan's last tile. Called by every thread of the CTA: b = the requests
// whose tiles end at or before x, one block-wide count per blockDim.x requests (the plan is non-decreasing).
__device__ __forceinline__ bool varlen_tile(const i64* __restrict__ plan, const int* __restrict__ cu_rows,
                                            int batch, int row_start, int row_end, i64 x, int& b, int& row0,
                                            int& rend) {
  if (batch <= 0 || x >= plan[batch]) return false;
  int count = 0;
  for (int base = 0; base < batch; base += blockDim.x) {
    const int i = base + static_cast<int>(threadIdx.x) + 1;
    count += __syncthreads_count(i <= batch && plan[min(i, batch)] <= x);
  }
  b = min(count, batch - 1);
  int lo, hi;
  varlen_request_rows(cu_rows, b, row_start, row_end, lo, hi);
  const i64 k = x - plan[b];  // tile of request b
  row0 = (k >= 0 && k * kVarlenTileRows < hi - lo) ? lo + static_cast<int>(k) * kVarlenTileRows : hi;
  rend = hi;
  return true;
}

// ---- mma helpers ----
// Tensor-core tile D += A * B for mma.sync m16n8k16 with fp32 accumulate (sm_80+). Fragments (PTX ISA,
// gid = lane / 4, t = lane % 4): A row-major {a0a1, a2a3, a4a5, a6a7} = rows {gid, gid+8, gid, gid+8},
// k = {2t..2t+1, 2t..2t+1, 2t+8..2t+9, 2t+8..2t+9}; B col-major {b0b1, b2b3} = col gid, k = {2t.., 2t+8..};
// D {d0,d1} = row gid, cols 2t, 2t+1; {d2,d3} = row gid+8. Each 32-bit register holds two 16-bit values,
// the lower k in the low half. F16 selects .f16 inputs, otherwise .bf16.
template <bool F16>
__device__ __forceinline__ void mma_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if (F16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// 16-byte read-only global load for streamed data, not kept in L1. L2Hint: the L2 prefetch size asked on
// a miss: 2 = L2::256B (the whole 256 B line; the other quarters of a key row are read by the next
// instructions), 1 = L2::128B, 0 = no hint. volatile: issued where written, so a prefetch stays a prefetch.
template <int L2Hint = 2>
__device__ __forceinline__ uint4 ldg_stream_v4(const void* p) {
  uint4 r;
  if constexpr (L2Hint == 2) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  } else if constexpr (L2Hint == 1) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  }
  return r;
}

// ---- cp.async (sm_80+): global -> shared without registers ------------------------------------------
__device__ __forceinline__ u32 smem_u32(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared, bypassing L1; src_bytes 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// 4 bytes global -> shared (through L1, the only path for fewer than 16 bytes).
__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---- thread-block clusters (sm_90+): a CTA's rank, the cluster-wide barrier, reads of another CTA's shared memory
// (distributed shared memory). DSA_CLUSTER_DIMS(n) gives a kernel a compile-time cluster of n CTAs along x, so a
// plain launch (CuPy's cuLaunchKernel) starts the grid in clusters; below sm_90 it is empty, and the kernels that use
// clusters are only instantiated with n = 1 there. Every helper below is called only where kHasClusters holds.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kHasClusters = true;
#define DSA_CLUSTER_DIMS(n) __cluster_dims__(n, 1, 1)
#else
constexpr bool kHasClusters = false;
#define DSA_CLUSTER_DIMS(n)
#endif

__device__ __forceinline__ u32 cluster_rank() {
  u32 r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}
// Every thread of every CTA of the cluster arrives (release: its shared-memory writes become visible to the
// cluster) and waits for all of them (acquire). arrive / wait split: work between them overlaps the barrier.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}
// The shared::cluster address of CTA `rank`'s copy of this CTA's shared variable at p.
__device__ __forceinline__ u32 cluster_map(const void* p, u32 rank) {
  u32 a = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(smem_u32(p)), "r"(rank));
#endif
  return a;
}
__device__ __forceinline__ int cluster_ld_s32(u32 addr) {
  int v = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.s32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
#endif
  return v;
}
__device__ __forceinline__ u64 cluster_ld_u64(u32 addr) {
  u64 v = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.u64 %0, [%1];\n" : "=l"(v) : "r"(addr) : "memory");
#endif
  return v;
}

// fp8 mma.sync (m16n8k32 .e4m3 x .e4m3, fp32 accumulate) is valid PTX on sm_89 and later, but only sm_89
// (Ada) and sm_120+ (consumer Blackwell) run it natively (SASS QMMA). On sm_90 / sm_100 ptxas emulates it
// (checked with cuobjdump, CUDA 13): F2FP to f16, two HMMA.16816 per mma, ~4 FADD per mma, slower than
// expanding e4m3 by shifts. Which targets run it natively is the host's knowledge (its configs per arch).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr bool kHasFp8Mma = true;         // the instruction compiles
#else
constexpr bool kHasFp8Mma = false;
#endif

// D += A * B for mma.sync m16n8k32 .row.col .f32.e4m3.e4m3.f32 (sm_89+; PTX ISA "Matrix Fragments for
// mma.m16n8k32", 8-bit types; gid = lane / 4, t = lane % 4; byte i of a register = k + i):
// A 16x32 row-major {a0, a1, a2, a3} = rows {gid, gid+8, gid, gid+8}, k = {4t.., 4t.., 4t+16.., 4t+16..};
// B 32x8 col-major {b0, b1} = column gid, k = {4t..4t+3, 4t+16..4t+19}; D as for m16n8k16.
// The products are exact, but Ada / Hopper fp8 tensor cores add them (and the accumulator) with ~13-14
// significant bits (published measurements), not in full fp32; the sm_90 / sm_100 emulation adds in fp32.
// Never called where kHasFp8Mma is false.
__device__ __forceinline__ void mma_16832_e4m3(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// Four e4m3 bytes x = [e0 e1 e2 e3] (e0 lowest) -> two f16x2 words with the exact values times 2^-8:
// even = (e0, e2), odd = (e1, e3). e4m3 s.eeee.mmm shifted into f16 s.0eeee.mmm0000000 keeps the
// mantissa and rebiases the exponent by 15 - 7 = 8 (normals and subnormals alike); no cvt needed
// (F2F is slow on Hopper). The e4m3 NaN code (0x7F/0xFF) becomes 480 * 2^-8: never produced by a
// saturating quantizer.
__device__ __forceinline__ void e4m3x4_to_f16x2_scaled(u32 x, u32& even, u32& odd) {
  even = ((x << 8) & 0x80008000u) | ((x << 7) & 0x3F803F80u);
  odd = (x & 0x80008000u) | ((x >> 1) & 0x3F803F80u);
}

// f16x2 word holding v * 2^-8 (from e4m3x4_to_f16x2_scaled) -> bf16x2 of v (exact: e4m3 fits bf16).
__device__ __forceinline__ u32 f16x2_scaled_to_bf16x2(u32 h) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  return pack_bf16x2(f.x * 256.0f, f.y * 256.0f);
}

}  // namespace dsa
