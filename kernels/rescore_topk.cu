// Two-level index keys (cupy_dsa.rescore): stage 2 of the fp8-rescore top-k and its small helpers.
//
// Stage 1 (cupy_dsa's fp8 logits, or the caller's) and torch.topk give each query row its K' candidate
// positions; rescore_candidate_keys and a sort put them in stage-1 order (logit descending, ties: lower
// position). rescore_topk_kernel scores every candidate from its fp8 "hi" and int8 "lo" pages,
//   score = sum_h relu(q_h . k_hat) * w_h,   k_hat = e4m3(hi) * hi_scale + lo * lo_scale,
// as q_h . k_hat = hi_scale * (q_h . e4m3(hi)) + lo_scale * (q_h . lo): both dot products run on bf16 tensor
// cores (e4m3 and int8 codes and an fp8 or bf16 q are exact in bf16, every product is exact) with fp32
// accumulation, then fp32 epilogue. It writes one int64 sort key per candidate (the score, ties: better
// stage-1 rank), so that torch.topk of the keys is the row's selection in the reference's order, the same
// on every rerun; rescore_finish turns the selection into SGLang's outputs.
//
// Stage-2 work split: one CTA per (query row, chunk of candidates); 4 warps, each scoring 16-candidate
// tiles (two mma n-tiles of 8). q is staged once per CTA in shared memory as ready A quads (heads = M, 4
// m-tiles of 16 heads), in the element order of fp8 key rows that cupy_dsa's logits kernel uses for fp8 keys
// (kernels/mqa_logits.cu): thread (gid = lane / 4, t = lane % 4) loads, for candidate 8j + gid of its tile,
// the 16-byte chunks at bytes 64g + 16t (g = 0, 1) of the candidate's hi row and of its lo row; the half
// `half` of chunk g is pair s = 2g + half (head_dim elements d = 64(s/2) + 16t + 8(s%2) .. +7), whose words
// (0,2) (1,3) (4,6) (5,7) feed k-steps 2s ({w0, w1}) and 2s+1 ({w2, w3}). q is staged in the same order, so
// every k of A meets the same head_dim element of B; over the 4 pairs and 4 threads head_dim is covered once.
// The accumulator of (m-tile i, n-tile j) holds heads {16i + gid, 16i + gid + 8} x candidates {8j + 2t,
// 8j + 2t + 1}; relu * w is summed over the thread's heads, then over the 8 lanes sharing t (4 shuffles,
// transposed: lane (gid, t) ends with candidate 8(gid / 4) + 2t + (gid / 2) % 2). The arithmetic of a
// candidate (mma order, head order, lane reduction) does not depend on the grid: results are deterministic.
//
// Nothing is read outside q / weights / the row's lengths / its block-table row / valid pages (entry in
// [0, num_pages), page index < bt_width) / the row's candidates; candidates a row does not see score as
// invalid and are never read; a row that sees at most index_topk keys reads no key at all.
#include "common.cuh"

namespace dsa {
namespace rescore {

constexpr int kNumHeads = 64;
constexpr int kWarps = 4;
constexpr int kTileCands = 16;                       // candidates per warp tile (two mma n-tiles)
constexpr int kQWords = 4 * 8 * 32;                   // A quads per row: [m-tile][k-step][lane]
constexpr long long kInvalidKey = static_cast<long long>(0x8000000000000000ull);  // below every valid key

// How a query row's visible positions [lo, hi) and its block-table row are found (cupy_dsa.logits' contracts).
enum RowMode {
  kDecodeLens1D = 0,  // row r = request r / next_n, row j = r % next_n of it sees lens0[b] - (next_n - 1 - j)
  kDecodeLens2D = 1,  // sees lens0[r] (per-row lengths)
  kPrefillKsKe = 2,   // sees [lens0[r], lens1[r]) of its request: the one request (cu_rows null) or the request
                      // of cu_rows that owns row r (none: the row is empty)
};

struct RowSpec {
  const int* lens0;
  const int* lens1;
  const int* cu_rows;
  int mode;
  int next_n;
  int batch;
  int width;          // positions past it are never visible (the logits' columns)
};

struct RowKeys {
  int lo, hi;         // visible positions (empty: 0, 0)
  int table_row;      // the row's block-table row
};

__device__ __forceinline__ RowKeys row_keys(const RowSpec& s, int r) {
  int lo = 0, hi = 0, table_row = 0;
  if (s.mode == kDecodeLens1D) {
    table_row = r / s.next_n;
    hi = s.lens0[table_row] - (s.next_n - 1 - r % s.next_n);
  } else if (s.mode == kDecodeLens2D) {
    table_row = r / s.next_n;
    hi = s.lens0[r];
  } else {
    lo = s.lens0[r];
    hi = s.lens1[r];
    if (s.cu_rows != nullptr) {
      // the request owning row r: the last b with cu_rows[b] <= r (non-decreasing offsets), if r < cu_rows[b + 1]
      int a = 0, z = s.batch;
      while (z - a > 1) {
        const int mid = (a + z) >> 1;
        if (s.cu_rows[mid] <= r) a = mid; else z = mid;
      }
      table_row = a;
      if (s.batch <= 0 || s.cu_rows[a] > r || r >= s.cu_rows[a + 1]) hi = lo;
    }
  }
  lo = max(lo, 0);
  hi = min(hi, s.width);
  if (hi <= lo) lo = hi = 0;
  return {lo, hi, table_row};
}

// A key that sorts as signed int64 by (value, tie), both descending: the fp32 value's order-preserving int32
// in the high half, `tie` (greater = earlier) in the low half. -0.0 counts as +0.0.
__device__ __forceinline__ long long order_key(float value, u32 tie) {
  const int b = __float_as_int(value + 0.0f);
  const int ord = b >= 0 ? b : b ^ 0x7FFFFFFF;
  return static_cast<long long>((static_cast<u64>(static_cast<u32>(ord)) << 32) | tie);
}

// The index i a key's low half holds as 0xFFFFFFFF - i: a stage-1 key's position, a stage-2 key's candidate.
__device__ __forceinline__ u32 tie_index(long long key) {
  return 0xFFFFFFFFu - static_cast<u32>(static_cast<u64>(key));
}

// Four int8 codes x = [c0 c1 c2 c3] (c0 lowest) -> even = bf16x2 (c0, c2), odd = (c1, c3) (exact).
__device__ __forceinline__ void int8x4_to_bf16x2(u32 x, u32& even, u32& odd) {
  float c[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) c[i] = static_cast<float>(static_cast<signed char>((x >> (8 * i)) & 0xFFu));
  even = pack_bf16x2(c[0], c[2]);
  odd = pack_bf16x2(c[1], c[3]);
}

// 8 consecutive q elements of one head (bytes of `q` at element offset `elem`) as the mma words of the fp8
// key order: (0,2) (1,3) (4,6) (5,7), bf16 (an fp8 q is exact in bf16).
template <int QFp8>
__device__ __forceinline__ uint4 q_words(const unsigned char* __restrict__ q, i64 elem) {
  uint4 v;
  if (QFp8) {
    const uint2 x = *reinterpret_cast<const uint2*>(q + elem);
    const unsigned char* b = reinterpret_cast<const unsigned char*>(&x);
    v.x = pack_bf16x2(e4m3_to_float(b[0]), e4m3_to_float(b[2]));
    v.y = pack_bf16x2(e4m3_to_float(b[1]), e4m3_to_float(b[3]));
    v.z = pack_bf16x2(e4m3_to_float(b[4]), e4m3_to_float(b[6]));
    v.w = pack_bf16x2(e4m3_to_float(b[5]), e4m3_to_float(b[7]));
  } else {
    const uint4 x = *reinterpret_cast<const uint4*>(q + 2 * elem);
    v.x = __byte_perm(x.x, x.y, 0x5410);
    v.y = __byte_perm(x.x, x.y, 0x7632);
    v.z = __byte_perm(x.z, x.w, 0x5410);
    v.w = __byte_perm(x.z, x.w, 0x7632);
  }
  return v;
}

// B words of a tile from the raw chunks: W[j][s][w] (candidate 8j + gid, pair s, word w).
__device__ __forceinline__ void hi_words(const uint4 (&raw)[2][2], u32 (&W)[2][4][4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const u32 x[4] = {raw[j][g].x, raw[j][g].y, raw[j][g].z, raw[j][g].w};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        u32 e0, o0, e1, o1;
        e4m3x4_to_f16x2_scaled(x[2 * half], e0, o0);
        e4m3x4_to_f16x2_scaled(x[2 * half + 1], e1, o1);
        u32* w = W[j][2 * g + half];
        w[0] = f16x2_scaled_to_bf16x2(e0);
        w[1] = f16x2_scaled_to_bf16x2(o0);
        w[2] = f16x2_scaled_to_bf16x2(e1);
        w[3] = f16x2_scaled_to_bf16x2(o1);
      }
    }
}

__device__ __forceinline__ void lo_words(const uint4 (&raw)[2][2], u32 (&W)[2][4][4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const u32 x[4] = {raw[j][g].x, raw[j][g].y, raw[j][g].z, raw[j][g].w};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        u32* w = W[j][2 * g + half];
        int8x4_to_bf16x2(x[2 * half], w[0], w[1]);
        int8x4_to_bf16x2(x[2 * half + 1], w[2], w[3]);
      }
    }
}

}  // namespace rescore
}  // namespace dsa

#define DSA_ROW_SPEC_ARGS                                                                                  \
  const int *__restrict__ lens0, const int *__restrict__ lens1, const int *__restrict__ cu_rows, int mode, \
      int next_n, int batch, int width
#define DSA_ROW_SPEC \
  dsa::rescore::RowSpec { lens0, lens1, cu_rows, mode, next_n, batch, width }

// out[r, c] = logits[r, c] where row r sees position c, else -inf, for c < width (logits a caller computed,
// whose columns past a row's keys may hold anything). out: [rows, width] contiguous. Grid (rows,
// ceil(width / 4096)), 256 threads.
__global__ void __launch_bounds__(256) rescore_mask_logits(const float* __restrict__ logits, long long logits_stride,
                                                           float* __restrict__ out, DSA_ROW_SPEC_ARGS) {
  const int r = blockIdx.x;
  const dsa::rescore::RowKeys rk = dsa::rescore::row_keys(DSA_ROW_SPEC, r);
  const float neg_inf = __int_as_float(0xff800000);
  const int c_end = min(width, static_cast<int>(blockIdx.y + 1) * 4096);
  for (int c = blockIdx.y * 4096 + threadIdx.x; c < c_end; c += blockDim.x)
    out[static_cast<long long>(r) * width + c] =
        (c >= rk.lo && c < rk.hi) ? logits[static_cast<long long>(r) * logits_stride + c] : neg_inf;
}

// keys[i] = order_key(vals[i], 0xFFFFFFFF - idx[i]): the stage-1 candidates (torch.topk's values and positions)
// as keys whose descending order is the reference's (logit descending, ties: lower position). Grid ceil(n / 256).
__global__ void __launch_bounds__(256) rescore_candidate_keys(const float* __restrict__ vals,
                                                              const long long* __restrict__ idx,
                                                              long long* __restrict__ keys, long long n) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) keys[i] = dsa::rescore::order_key(vals[i], 0xFFFFFFFFu - static_cast<unsigned>(idx[i]));
}

// Stage 2. q: [rows, 64, 128] fp8 e4m3 (QFp8) or bf16; weights: fp32 [rows, 64]; hi_cache / lo_cache: fp8-geometry
// page rows (8448 B), num_pages each; block_table: int32, row b at block_table + b * bt_stride, bt_width entries;
// candidates: int64 [rows, k_prime], row r's candidates in stage-1 order, each naming its position
// (tie_index); keys (out): int64 [rows, k_prime], order_key(score, 0xFFFFFFFF - c) for candidate c, or
// kInvalidKey where the row does not see the position, its page is not in the caches, or the row sees at most
// index_topk keys (selected without scores). Grid (rows, ceil(k_prime / cands_per_cta)), 128 threads;
// cands_per_cta a multiple of 64.
template <int QFp8>
__global__ void __launch_bounds__(128, 3) rescore_topk_kernel(
    const unsigned char* __restrict__ q, const float* __restrict__ weights, const unsigned char* __restrict__ hi_cache,
    const unsigned char* __restrict__ lo_cache, long long num_pages, const int* __restrict__ block_table,
    long long bt_stride, int bt_width, DSA_ROW_SPEC_ARGS, const long long* __restrict__ candidates, int k_prime,
    int cands_per_cta, int index_topk, long long* __restrict__ keys) {
  using namespace dsa;
  using namespace dsa::rescore;
  const int r = blockIdx.x;
  const int c_begin = blockIdx.y * cands_per_cta;
  const int c_end = min(k_prime, c_begin + cands_per_cta);
  if (c_begin >= c_end) return;  // CTA-uniform
  const RowKeys rk = row_keys(DSA_ROW_SPEC, r);
  long long* __restrict__ out = keys + static_cast<i64>(r) * k_prime;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (rk.hi - rk.lo <= index_topk) {  // CTA-uniform: a row selected without scores
    for (int c = c_begin + tid; c < c_end; c += blockDim.x) out[c] = kInvalidKey;
    return;
  }

  __shared__ uint4 qs[kQWords];                      // A quads [m-tile][k-step][lane]
  __shared__ float2 ws[kNumHeads / 2];               // [m-tile][gid]: (w[16i + gid], w[16i + gid + 8])
  for (int i = tid; i < kQWords / 2; i += blockDim.x) {  // both k-steps of a pair at once
    const int m = i >> 7, s = (i >> 5) & 3, ln = i & 31;
    const int head = 16 * m + (ln >> 2), t = ln & 3;
    const i64 elem = (static_cast<i64>(r) * kNumHeads + head) * kHeadDim + 64 * (s >> 1) + 16 * t + 8 * (s & 1);
    const uint4 v0 = q_words<QFp8>(q, elem), v1 = q_words<QFp8>(q, elem + 8 * kHeadDim);
    uint4* dst = qs + (m * 8 + 2 * s) * 32 + ln;
    dst[0] = make_uint4(v0.x, v1.x, v0.y, v1.y);   // k-step 2s
    dst[32] = make_uint4(v0.z, v1.z, v0.w, v1.w);  // k-step 2s + 1
  }
  if (tid < kNumHeads / 2) {
    const float* wr = weights + static_cast<i64>(r) * kNumHeads;
    ws[tid] = make_float2(wr[16 * (tid >> 3) + (tid & 7)], wr[16 * (tid >> 3) + (tid & 7) + 8]);
  }
  __syncthreads();

  const int* __restrict__ bt = block_table + static_cast<i64>(rk.table_row) * bt_stride;
  const long long* __restrict__ cand = candidates + static_cast<i64>(r) * k_prime;
  const int gid = lane >> 2, t = lane & 3;
  const int b4 = (lane >> 4) & 1, b3 = (lane >> 3) & 1;
  for (int tile0 = c_begin + warp * kTileCands; tile0 < c_end; tile0 += kWarps * kTileCands) {
    // this lane's load candidates 8j + gid: page byte offset, slot, whether the row sees them in the caches
    i64 base[2] = {0, 0};
    int slot[2] = {0, 0};
    int ok[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = tile0 + 8 * j + gid;
      if (c < c_end) {
        const u32 pos = tie_index(cand[c]);
        if (pos >= static_cast<u32>(rk.lo) && pos < static_cast<u32>(rk.hi) &&
            static_cast<int>(pos >> kPageBits) < bt_width) {
          const int e = bt[pos >> kPageBits];
          if (e >= 0 && static_cast<i64>(e) < num_pages) {
            ok[j] = 1;
            base[j] = static_cast<i64>(e) * kFp8PageBytes;
            slot[j] = static_cast<int>(pos & (kPageSlots - 1));
          }
        }
      }
    }
    const int c_out = tile0 + 8 * b4 + 2 * t + b3;  // the candidate this lane holds after the reduction
    const bool writer = (lane & 4) == 0 && c_out < c_end;
    if (!__any_sync(0xffffffffu, ok[0] | ok[1])) {  // warp-uniform: nothing to score in this tile
      if (writer) out[c_out] = kInvalidKey;
      continue;
    }
    uint4 hraw[2][2], lraw[2][2];
    float hsc[2], lsc[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const i64 row_off = base[j] + static_cast<i64>(slot[j]) * kHeadDim + 16 * t;
      const i64 scale_off = base[j] + kFp8ScaleOffset + 4 * slot[j];
#pragma unroll
      for (int g = 0; g < 2; ++g) {
        hraw[j][g] = ok[j] ? ldg_stream_v4<1>(hi_cache + row_off + 64 * g) : make_uint4(0u, 0u, 0u, 0u);
        lraw[j][g] = ok[j] ? ldg_stream_v4<1>(lo_cache + row_off + 64 * g) : make_uint4(0u, 0u, 0u, 0u);
      }
      hsc[j] = ok[j] ? __ldg(reinterpret_cast<const float*>(hi_cache + scale_off)) : 0.0f;
      lsc[j] = ok[j] ? __ldg(reinterpret_cast<const float*>(lo_cache + scale_off)) : 0.0f;
    }
    // scales and validity of the epilogue's candidates 8j + 2t + e, held by lane 4 (2t + e)
    float ehs[2][2], els[2][2];
    int eok[2][2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int src = 4 * (2 * t + e);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        ehs[j][e] = __shfl_sync(0xffffffffu, hsc[j], src);
        els[j][e] = __shfl_sync(0xffffffffu, lsc[j], src);
        eok[j][e] = __shfl_sync(0xffffffffu, ok[j], src);
      }
    }
    u32 Wh[2][4][4], Wl[2][4][4];
    hi_words(hraw, Wh);
    lo_words(lraw, Wl);

    float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // [2j + e]: candidate 8j + 2t + e over this lane's heads
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float ah[2][4], al[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) ah[j][e] = al[j][e] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        const uint4 a = qs[(i * 8 + ks) * 32 + lane];
        const int s = ks >> 1, w0 = 2 * (ks & 1);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          mma_16816<false>(ah[j], a.x, a.y, a.z, a.w, Wh[j][s][w0], Wh[j][s][w0 + 1]);
          mma_16816<false>(al[j], a.x, a.y, a.z, a.w, Wl[j][s][w0], Wl[j][s][w0 + 1]);
        }
      }
      const float2 w = ws[i * 8 + gid];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // e: (head 16i + gid, +8 for e >= 2) x (candidate 8j + 2t + e % 2)
          const int col = e & 1;
          const float v = __fadd_rn(__fmul_rn(ehs[j][col], ah[j][e]), __fmul_rn(els[j][col], al[j][e]));
          p[2 * j + col] = fmaf(fmaxf(v, 0.0f), e < 2 ? w.x : w.y, p[2 * j + col]);
        }
    }
    // sum over the 8 lanes sharing t: keep j = b4 (xor 16), then e = b3 (xor 8), then add the b2 pair (xor 4)
    float u[2];
#pragma unroll
    for (int e = 0; e < 2; ++e)
      u[e] = (b4 ? p[2 + e] : p[e]) + __shfl_xor_sync(0xffffffffu, b4 ? p[e] : p[2 + e], 16);
    float score = (b3 ? u[1] : u[0]) + __shfl_xor_sync(0xffffffffu, b3 ? u[0] : u[1], 8);
    score += __shfl_xor_sync(0xffffffffu, score, 4);
    const int valid = b4 ? (b3 ? eok[1][1] : eok[1][0]) : (b3 ? eok[0][1] : eok[0][0]);
    if (writer) out[c_out] = valid ? order_key(score, 0xFFFFFFFFu - static_cast<u32>(c_out)) : kInvalidKey;
  }
}

// SGLang's outputs of the selection: int32 [rows, index_topk] page_indices (block-table entry * 64 + slot),
// raw_indices (positions), fp8_rank (stage-1 rank), -1 padded. A row that sees n <= index_topk keys selects
// lo .. lo + n - 1 in order (fp8_rank counted over its visible logits: greater, or equal at a lower position);
// any other row takes selected[r, 0 .. m) (the top-m stage-2 keys, descending): candidate c = 0xFFFFFFFF - the
// key's low half, its position from candidates[r, c], its rank c; kInvalidKey -> -1. Grid (rows), 256 threads.
__global__ void __launch_bounds__(256) rescore_finish(
    const long long* __restrict__ selected, int m, const long long* __restrict__ candidates, int k_prime,
    const float* __restrict__ logits, long long logits_stride, const int* __restrict__ block_table,
    long long bt_stride, DSA_ROW_SPEC_ARGS, int index_topk, int* __restrict__ page_indices,
    int* __restrict__ raw_indices, int* __restrict__ fp8_rank) {
  using namespace dsa;
  using namespace dsa::rescore;
  const int r = blockIdx.x;
  const RowKeys rk = row_keys(DSA_ROW_SPEC, r);
  const int n = rk.hi - rk.lo;
  const int* __restrict__ bt = block_table + static_cast<i64>(rk.table_row) * bt_stride;
  const i64 o = static_cast<i64>(r) * index_topk;
  for (int i = threadIdx.x; i < index_topk; i += blockDim.x) {
    int raw = -1, rank = -1;
    if (n <= index_topk) {
      if (i < n) {
        raw = rk.lo + i;
        const float* __restrict__ row = logits + static_cast<i64>(r) * logits_stride;
        const float v = row[raw];
        int ahead = 0;
        for (int c = rk.lo; c < rk.hi; ++c) {
          const float x = row[c];
          ahead += (x > v) || (x == v && c < raw);
        }
        rank = ahead;
      }
    } else if (i < m) {
      const long long key = selected[static_cast<i64>(r) * m + i];
      if (key != kInvalidKey) {
        rank = static_cast<int>(tie_index(key));
        raw = static_cast<int>(tie_index(candidates[static_cast<i64>(r) * k_prime + rank]));
      }
    }
    // entry * 64 + slot in 32 bits, wrapping as the reference's int64 -> int32 conversion does
    const int page = raw < 0 ? -1
                             : static_cast<int>(static_cast<u32>(bt[raw >> kPageBits]) * kPageSlots +
                                                static_cast<u32>(raw & (kPageSlots - 1)));
    page_indices[o + i] = page;
    raw_indices[o + i] = raw;
    fp8_rank[o + i] = rank;
  }
}

#undef DSA_ROW_SPEC
#undef DSA_ROW_SPEC_ARGS
