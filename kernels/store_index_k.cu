// Fused index-key store: norm -> RoPE -> Hadamard -> (fp4-simulate | fp8-quantize) -> paged cache.
// Two-level keys (Layout kLayoutFp8TwoLevel, cupy_dsa.rescore): the fp8 page as SGLang's store writes it
// ("hi") and, in a second cache of the same geometry, the int8 residual of that fp8 row ("lo").
//
// One warp per compressed token (each warp takes two in turn, 16 per 256-thread block); lane l owns
// elements 4l..4l+3 in natural order, so every stage is in-lane or a warp shuffle and every global
// access is one vector per lane.
// Every rounding is spelled out (__fmul_rn / __fadd_rn / __fmaf_rn), so no compiler decides which multiply-add
// is contracted and the torch reference in cupy_dsa/store.py reproduces every rounding except rsqrtf's hardware
// approximation. V4 keys take SGLang 0.5.23's operation order: its fused_norm_rope_indexer is compiled with
// nvcc's default -fmad=true, and its SASS (sm_80 / 89 / 90a / 100a / 120a alike) contracts the sum of squares
// into an FMA chain and each RoPE output into one FMA plus one product; here those FMAs are explicit, so the fp8
// pages are SGLang's bytes (rsqrtf is the same MUFU.RSQ instruction on both sides).
#include "common.cuh"

namespace dsa {

// ---- template parameters -------------------------------------------------------------------------
enum StoreNumerics { kNumExact = 0, kNumFp4Sim = 1 };
enum KeyStyle { kStyleV4 = 0, kStyleV32 = 1 };     // RMSNorm + interleaved tail RoPE | LayerNorm + NeoX head RoPE
enum WorkSource { kSrcDirect = 0, kSrcDecodePlan = 1, kSrcPrefillPlan = 2 };
// The store's third layout (common.cuh has the two page formats): SGLang's fp8 page plus the lo page.
constexpr int kLayoutFp8TwoLevel = 2;
constexpr int kLoMax = 127;

constexpr u32 kPlanInvalid = 0xFFFFFFFFu;

// ---- loads ------------------------------------------------------------------------------------------
// kv row `t`, lane `lane`: elements 4l..4l+3 as one 16-byte (fp32) or 8-byte (bf16) streaming load.
__device__ __forceinline__ void load4(const float* kv, i64 t, int lane, float (&x)[4]) {
  const float4 v = __ldcs(reinterpret_cast<const float4*>(kv + t * kHeadDim) + lane);
  x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
}

__device__ __forceinline__ void load4(const __nv_bfloat16* kv, i64 t, int lane, float (&x)[4]) {
  const uint2 v = __ldcs(reinterpret_cast<const uint2*>(kv + t * kHeadDim) + lane);
  x[0] = __uint_as_float(v.x << 16); x[1] = __uint_as_float(v.x & 0xFFFF0000u);
  x[2] = __uint_as_float(v.y << 16); x[3] = __uint_as_float(v.y & 0xFFFF0000u);
}

__device__ __forceinline__ float sum4_sq(const float (&x)[4]) {
  return __fadd_rn(__fadd_rn(__fadd_rn(__fmul_rn(x[0], x[0]), __fmul_rn(x[1], x[1])), __fmul_rn(x[2], x[2])),
                   __fmul_rn(x[3], x[3]));
}

// SGLang's V4 sum of squares: s = 0; s = fma(x_i, x_i, s) in lane order (its loop, contracted by nvcc).
__device__ __forceinline__ float sum4_sq_fma(const float (&x)[4]) {
  return __fmaf_rn(x[3], x[3], __fmaf_rn(x[2], x[2], __fmaf_rn(x[1], x[1], __fmul_rn(x[0], x[0]))));
}

// ---- norms ----------------------------------------------------------------------------------------
// RMSNorm (V4): k = x * rsqrtf(mean(x^2) + eps) * w.
__device__ __forceinline__ void rms_norm(float (&x)[4], const float* w, float eps, int lane) {
  const float ss = warp_sum(sum4_sq_fma(x));
  const float nf = rsqrtf(__fadd_rn(ss / 128.f, eps));
  const float4 wv = *reinterpret_cast<const float4*>(w + 4 * lane);
  x[0] = __fmul_rn(__fmul_rn(x[0], nf), wv.x);
  x[1] = __fmul_rn(__fmul_rn(x[1], nf), wv.y);
  x[2] = __fmul_rn(__fmul_rn(x[2], nf), wv.z);
  x[3] = __fmul_rn(__fmul_rn(x[3], nf), wv.w);
}

// LayerNorm (V3.2): k = (x - mean) * rsqrtf(var + eps) * w + b.
__device__ __forceinline__ void layer_norm(float (&x)[4], const float* w, const float* b, float eps, int lane) {
  const float mean = warp_sum(__fadd_rn(__fadd_rn(__fadd_rn(x[0], x[1]), x[2]), x[3])) / 128.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = __fsub_rn(x[i], mean);
  const float var = warp_sum(sum4_sq(x)) / 128.f;
  const float rs = rsqrtf(__fadd_rn(var, eps));
  const float4 wv = *reinterpret_cast<const float4*>(w + 4 * lane);
  const float4 bv = *reinterpret_cast<const float4*>(b + 4 * lane);
  x[0] = __fadd_rn(__fmul_rn(__fmul_rn(x[0], rs), wv.x), bv.x);
  x[1] = __fadd_rn(__fmul_rn(__fmul_rn(x[1], rs), wv.y), bv.y);
  x[2] = __fadd_rn(__fmul_rn(__fmul_rn(x[2], rs), wv.z), bv.z);
  x[3] = __fadd_rn(__fmul_rn(__fmul_rn(x[3], rs), wv.w), bv.w);
}

// ---- RoPE -----------------------------------------------------------------------------------------
// (cos, sin) of the pairs a lane rotates, loaded before the norm so the latency hides behind it.
// V4: lane 16+q rotates pairs 2q, 2q+1 = one float4 of the freqs row.
// V3.2: lanes l and l+8 (l < 8) both need pairs 4l..4l+3 = two float4.
template <int Style>
__device__ __forceinline__ void load_freqs(const float* frow, int lane, float4& f0, float4& f1) {
  if (Style == kStyleV4) {
    if (lane >= 16) f0 = *reinterpret_cast<const float4*>(frow + 4 * (lane - 16));
  } else if (lane < 16) {
    f0 = *reinterpret_cast<const float4*>(frow + 8 * (lane & 7));
    f1 = *reinterpret_cast<const float4*>(frow + 8 * (lane & 7) + 4);
  }
}

// V4 key RoPE in SGLang's order: re' = fma(re, cos, -(im * sin)), im' = fma(re, sin, im * cos) (nvcc contracts
// SGLang's `re * c - im * s` / `re * s + im * c` this way; the query prep keeps common.cuh's rope_v4).
__device__ __forceinline__ void rope_v4_fma(float (&x)[4], const float4& f, int lane) {
  if (lane >= 16) {
    const float r0 = __fmaf_rn(x[0], f.x, -__fmul_rn(x[1], f.y)), i0 = __fmaf_rn(x[0], f.y, __fmul_rn(x[1], f.x));
    const float r1 = __fmaf_rn(x[2], f.z, -__fmul_rn(x[3], f.w)), i1 = __fmaf_rn(x[2], f.w, __fmul_rn(x[3], f.z));
    x[0] = r0; x[1] = i0; x[2] = r1; x[3] = i1;
  }
}

// V3.2: leading 64 dims, NeoX pairs (x[i], x[i+32]); lanes l and l+8 (l < 8) swap halves by shuffle.
__device__ __forceinline__ void rope_v32(float (&x)[4], const float4& f0, const float4& f1, int lane) {
  float o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = __shfl_xor_sync(0xffffffffu, x[i], 8);
  if (lane < 16) {
    const float c[4] = {f0.x, f0.z, f1.x, f1.z}, s[4] = {f0.y, f0.w, f1.y, f1.w};
    if (lane < 8) {
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = rot_re(x[i], o[i], c[i], s[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = rot_im(o[i], x[i], c[i], s[i]);
    }
  }
}

// ---- two-level keys: the int8 residual of an fp8 row -------------------------------------------------
// r = x - e4m3(code) * scale (a product, then a difference); lo_scale = max|r| / 127 (true division; 1 for an
// all-zero residual); lo = clamp(RNE(r / lo_scale), -127, 127) (true division). A row whose residual holds a
// NaN or an infinity (a non-finite key) gets zero codes and a NaN scale. cupy_dsa.rescore's
// residual_encode_reference states the same operations, so the lo page matches it to the bit.
__device__ __forceinline__ u32 residual_int8_row(const float (&x)[4], u32 codes, float scale, float& lo_scale) {
  float r[4];
  bool finite = true;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    r[i] = __fsub_rn(x[i], __fmul_rn(e4m3_to_float(static_cast<unsigned char>(codes >> (8 * i))), scale));
    finite = finite && is_finite_f32(r[i]);
  }
  const float amax = warp_max(fmaxf(fmaxf(fabsf(r[0]), fabsf(r[1])), fmaxf(fabsf(r[2]), fabsf(r[3]))));
  if (__any_sync(0xffffffffu, !finite)) {  // fmaxf drops a NaN: decided on the flags, warp-uniform
    lo_scale = __int_as_float(0x7fc00000);
    return 0u;
  }
  lo_scale = amax > 0.f ? __fdiv_rn(amax, static_cast<float>(kLoMax)) : 1.f;
  u32 out = 0u;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = min(kLoMax, max(-kLoMax, __float2int_rn(__fdiv_rn(r[i], lo_scale))));
    out |= static_cast<u32>(c & 0xFF) << (8 * i);
  }
  return out;
}

// ---- store ----------------------------------------------------------------------------------------
// Per-token work item: position and destination slot, or skip (position < 0 => skip).
struct WorkItem {
  i64 position;
  i64 out_loc;
};

// positions / plan out_loc may be int32 or int64: a warp-uniform run-time choice (not a template axis,
// which would double the instantiations for one load instruction).
__device__ __forceinline__ i64 load_index(const void* p, i64 i, bool idx64) {
  return idx64 ? static_cast<const i64*>(p)[i] : static_cast<i64>(static_cast<const int*>(p)[i]);
}

template <int Source>
__device__ __forceinline__ WorkItem work_item(const void* items, const void* out_loc, i64 n_loc, i64 t,
                                              int ratio, bool idx64) {
  WorkItem wi;
  if (Source == kSrcDirect) {
    wi.position = load_index(items, t, idx64);
    wi.out_loc = static_cast<const i64*>(out_loc)[t];
  } else {
    const uint4 row = reinterpret_cast<const uint4*>(items)[t];  // 16-byte plan row (broadcast to the warp)
    const u32 seq_len = row.x;
    wi.position = static_cast<i64>(seq_len) - ratio;
    i64 idx;
    bool skip;
    if (Source == kSrcDecodePlan) {
      skip = (seq_len % static_cast<u32>(ratio)) != 0u;
      idx = t;
    } else {
      skip = seq_len == kPlanInvalid;
      idx = static_cast<i64>(row.y & 0xFFFFu);  // ragged_id
    }
    if (skip || idx >= n_loc) {  // a ragged_id past out_loc is never read
      wi.position = -1;
      wi.out_loc = -1;
    } else {
      wi.out_loc = load_index(out_loc, idx, idx64);
    }
  }
  return wi;
}

// A key that is not finite (a NaN or an infinity in its kv row, or a norm that overflowed) is still written
// (the pages keep what the numerics make of it: NaN), and counted: one atomic per such key, none for a finite
// one, so a bad checkpoint or an upstream race is never stored silently. nonfinite may be null (not counted).
__device__ __forceinline__ void count_nonfinite(const float (&x)[4], unsigned int* nonfinite, int lane) {
  if (nonfinite == nullptr) return;
  const bool bad = !(is_finite_f32(x[0]) && is_finite_f32(x[1]) && is_finite_f32(x[2]) && is_finite_f32(x[3]));
  if (__any_sync(0xffffffffu, bad) && lane == 0) atomicAdd(nonfinite, 1u);
}

// One token, from its loaded kv row to the cache. Every early return is warp-uniform, so no shuffle
// runs with a partial warp.
// lo_cache (two-level layout only): the residual pages, the fp8 geometry, same page count as cache.
template <int Layout, int Numerics, int Style, bool Hadamard>
__device__ __forceinline__ void store_token(float (&x)[4], const WorkItem& wi, unsigned char* cache,
                                            unsigned char* lo_cache, const float* norm_w, const float* norm_b,
                                            const float* freqs, i64 num_pages, i64 max_pos, float eps, int lane,
                                            unsigned int* nonfinite) {
  if (wi.position < 0 || wi.position >= max_pos) return;
  constexpr int kPageBytes = Layout == kLayoutBf16 ? kBf16PageBytes : kFp8PageBytes;
  constexpr int kSlotBytes = Layout == kLayoutBf16 ? 2 * kHeadDim : kHeadDim;
  const i64 off = slot_byte_offset<kPageBytes, kSlotBytes>(wi.out_loc, num_pages);
  if (off < 0) return;

  float4 f0 = make_float4(0.f, 0.f, 0.f, 0.f), f1 = f0;
  load_freqs<Style>(freqs + wi.position * 64, lane, f0, f1);
  if (Style == kStyleV4) {
    rms_norm(x, norm_w, eps, lane);
    rope_v4_fma(x, f0, lane);
  } else {
    layer_norm(x, norm_w, norm_b, eps, lane);
    rope_v32(x, f0, f1, lane);
  }
  if (Hadamard) hadamard128_orthonormal(x, lane);
  count_nonfinite(x, nonfinite, lane);

  if (Layout == kLayoutBf16) {
    if (Numerics == kNumFp4Sim) fp4_simulate(x);
    const uint2 v = make_uint2(pack_bf16x2(x[0], x[1]), pack_bf16x2(x[2], x[3]));
    reinterpret_cast<uint2*>(cache + off)[lane] = v;
  } else {
    float scale;
    const u32 codes = fp8_quantize_row(x, scale);
    reinterpret_cast<u32*>(cache + off)[lane] = codes;
    const i64 scale_off = (wi.out_loc >> kPageBits) * kFp8PageBytes + kFp8ScaleOffset +
                          (wi.out_loc & (kPageSlots - 1)) * 4;
    if (lane == 0) *reinterpret_cast<float*>(cache + scale_off) = scale;
    if (Layout == kLayoutFp8TwoLevel) {
      float lo_scale;
      reinterpret_cast<u32*>(lo_cache + off)[lane] = residual_int8_row(x, codes, scale, lo_scale);
      if (lane == 0) *reinterpret_cast<float*>(lo_cache + scale_off) = lo_scale;
    }
  }
}

// Tokens per warp: both kv rows and work items are loaded before either token is processed, so a warp
// keeps 1 KiB (fp32) of reads in flight and the work-item latency hides behind the kv latency.
constexpr int kTokensPerWarp = 2;

// kv: [n, 128] TIn; cache: uint8 page rows; lo_cache: the residual page rows (two-level layout, else unused);
// items: positions [n] or plan rows [n, 16]; out_loc: [n] int64
// (direct) or [n_loc] (plans); idx64: positions (direct) / plan out_loc are int64 (else int32);
// norm_b only for V3.2; freqs: [max_pos, 64] fp32; nonfinite: u32 [1], += 1 per non-finite key stored (or
// null). Grid: ceil(n / (8 * kTokensPerWarp)) blocks of 256.
template <int Layout, int Numerics, int Style, bool Hadamard, typename TIn, int Source>
__global__ void __launch_bounds__(256) store_index_k(
    const TIn* __restrict__ kv, unsigned char* __restrict__ cache, unsigned char* __restrict__ lo_cache,
    const void* __restrict__ items,
    const void* __restrict__ out_loc, const float* __restrict__ norm_w, const float* __restrict__ norm_b,
    const float* __restrict__ freqs, i64 n, i64 n_loc, i64 num_pages, i64 max_pos, float eps, int ratio,
    int idx64, unsigned int* __restrict__ nonfinite) {
  static_assert(Layout == kLayoutBf16 || Numerics != kNumFp4Sim, "fp4sim needs the bf16 layout");
  const int lane = threadIdx.x & 31;
  const i64 t0 = (static_cast<i64>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5)) * kTokensPerWarp;
  if (t0 >= n) return;

  float x[kTokensPerWarp][4];
  WorkItem wi[kTokensPerWarp];
#pragma unroll
  for (int j = 0; j < kTokensPerWarp; ++j) {
    const i64 t = t0 + j < n ? t0 + j : n - 1;  // the tail warp re-reads row n-1 and skips it
    load4(kv, t, lane, x[j]);
    wi[j] = work_item<Source>(items, out_loc, n_loc, t, ratio, idx64 != 0);
    if (t0 + j >= n) wi[j].position = -1;
  }
#pragma unroll
  for (int j = 0; j < kTokensPerWarp; ++j)
    store_token<Layout, Numerics, Style, Hadamard>(x[j], wi[j], cache, lo_cache, norm_w, norm_b, freqs,
                                                   num_pages, max_pos, eps, lane, nonfinite);
}

}  // namespace dsa

using dsa::store_index_k;
