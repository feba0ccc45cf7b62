// Indexer query prep: wq_b output q [T, 64, 128] bf16 -> RoPE (trailing 64 dims, interleaved) ->
// Hadamard-128 -> (fp4-simulate to bf16 | per-(token, head) fp8 | bf16), and the folded head weights.
//
// One warp per (token, head) row, lane l owning elements 4l..4l+3 as in the key store, so RoPE, the
// Hadamard butterfly and the fp4 simulation are the store's own helpers (common.cuh). No multiply-add
// is contracted: the torch reference in cupy_dsa/query.py reproduces every rounding.
#include "common.cuh"

namespace dsa {

enum QueryNumerics { kQFp4Sim = 0, kQFp8 = 1, kQBf16 = 2 };
constexpr int kIndexHeads = 64;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// q, q_out: [n_rows = T*64, 128] (q_out bf16 for fp4sim and bf16, e4m3 bytes for fp8); weights, weights_out: [T*64];
// positions: [T] int32/int64 (pos64); a position outside [0, max_pos) reads table row 0 and raises the
// token's head weights to NaN, so a bad position is visible in the logits and never reads out of bounds.
// Grid: ceil(n_rows / 8) blocks of 256.
template <int Numerics, typename TW>
__global__ void __launch_bounds__(256) prepare_index_q(
    const __nv_bfloat16* __restrict__ q, const TW* __restrict__ weights, const float* __restrict__ freqs,
    const void* __restrict__ positions, void* __restrict__ q_out, float* __restrict__ weights_out, i64 n_rows,
    i64 max_pos, float weight_scale, int pos64) {
  const int lane = threadIdx.x & 31;
  const i64 row = static_cast<i64>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= n_rows) return;  // warp-uniform
  const i64 token = row / kIndexHeads;
  const i64 pos = pos64 ? static_cast<const i64*>(positions)[token]
                        : static_cast<i64>(static_cast<const int*>(positions)[token]);
  const bool pos_ok = pos >= 0 && pos < max_pos;

  const uint2 v = __ldcs(reinterpret_cast<const uint2*>(q + row * kHeadDim) + lane);
  float x[4] = {__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xFFFF0000u), __uint_as_float(v.y << 16),
                __uint_as_float(v.y & 0xFFFF0000u)};
  float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
  if (lane >= 16) f = *reinterpret_cast<const float4*>(freqs + (pos_ok ? pos : 0) * 64 + 4 * (lane - 16));
  rope_v4(x, f, lane);
  hadamard128_orthonormal(x, lane);

  float w = __fmul_rn(to_float(weights[row]), weight_scale);
  if (Numerics != kQFp8) {
    if (Numerics == kQFp4Sim) fp4_simulate(x);
    reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(q_out) + row * kHeadDim)[lane] =
        make_uint2(pack_bf16x2(x[0], x[1]), pack_bf16x2(x[2], x[3]));
  } else {
    float scale;
    reinterpret_cast<u32*>(static_cast<unsigned char*>(q_out) + row * kHeadDim)[lane] = fp8_quantize_row(x, scale);
    w = __fmul_rn(w, scale);
  }
  if (lane == 0) weights_out[row] = pos_ok ? w : __int_as_float(0x7fc00000);
}

}  // namespace dsa

using dsa::prepare_index_q;
