// Indexer logits: logits[r, n] = sum_{h<64} relu(q[r,h,:] . k[n,:]) * w[r,h], fp32 accumulate
// (fp8 keys: times the key's fp32 scale, applied after the head sum as DeepGEMM does).
//
// One kernel for decode and prefill. Grid: x = row tile (decode: request b and its next_n rows; prefill: Rows
// query rows, heaviest tile first), y = G CTAs sharing that row tile's keys. Keys are cut into 32-key tiles;
// warp w of CTA y takes tiles t_begin + y*Warps + w + k*G*Warps (k = 0, 1, ...), so the G*Warps warps of a row
// tile interleave over exactly the tiles its rows can see (computed from the device-side lengths): no CTA
// per chunk of a mostly empty block table, q staged once per CTA, balanced shares for every length, and the
// grid depends on host integers only (CUDA-graph safe). A warp computes its tile against every row of the
// row tile: per row 4 m-tiles (heads) x 4 n-tiles (keys) x 8 k-steps of mma.m16n8k16, fp32 accumulate,
// then relu * w summed over heads in registers, reduced over lanes, masked, stored.
//
// Fragments: A = q (M = 16 heads per m-tile), B = keys (N = 8 keys per n-tile), K = head_dim (8 k-steps).
// The logit needs only dot products, so head_dim may be permuted as long as q and k use the same
// permutation. Thread (gid = lane/4, t = lane%4) holds keys 8j + gid (n-tiles j = 0..3 of a 32-key tile) and,
// for k-step pair s, loads one 8-element chunk D(s,t) of each key row straight from global memory into
// registers (16-byte loads): its words w0..w3 are the B registers of k-step 2s ({w0, w1}) and 2s+1 ({w2, w3}),
// already consecutive aligned pairs, so no shared memory, no ldmatrix and no register shuffling for keys.
// q is staged once per CTA in shared memory as ready A quads: for heads h = 16i + gid and h' = h + 8 and the
// same chunk D(s,t): k-step 2s = {w0(h), w0(h'), w1(h), w1(h')}, 2s+1 = {w2(h), w2(h'), w3(h), w3(h')}
// (one conflict-free LDS.128 each). In the PTX fragment layout thread t's words sit at k = {2t, 2t+1}
// (w0 / w2) and k = {2t+8, 2t+9} (w1 / w3) in both A and B, so every k of A meets the same head_dim element
// of B; 4 pairs x 4 threads x 8 elements cover head_dim exactly once. (Keys as A would need each A quad
// interleaved from two key rows: ptxas then spends ~4 MOVs per mma rebuilding quads.)
//   bf16 keys: D(s,t) = 32s + 8t, words = element pairs (0,1) (2,3) (4,5) (6,7).
//   fp8 keys:  D(s,t) = 64(s/2) + 16t + 8(s%2) (one 16-byte load covers pairs 2g and 2g+1), words = (0,2)
//              (1,3) (4,6) (5,7): the shift expansion e4m3 -> f16 yields even/odd bytes of a 32-bit word.
// The accumulator of (m-tile i, n-tile j) holds heads {h, h'} x keys {8j+2t, 8j+2t+1}; relu * w is summed over
// the thread's heads, then over the 8 lanes sharing t (7 shuffles, each sum formed in one lane): lane
// (gid, t) ends with key 8*(gid/2) + 2t + gid%2 and stores it (32 lanes: 32 consecutive columns).
// fp8 keys use f16 mma on the shift-expanded key bytes (the value times 2^-8, exact). An fp8 q is expanded the
// same way (epilogue 2^16); a bf16 q is staged as f16 times 2^qs_h, a power of two per head h that puts
// max |q_h| in [2^13, 2^14) (its weight times 2^(8 - qs_h)), see logits_row_tile. bf16 keys use bf16 mma (an fp8 q
// converted to bf16, exact).
// fp8 keys with fp8 q, Mma8 = 1 (an experimental config): mma.sync m16n8k32 .e4m3 on the raw bytes, no conversion and
// half the mma (4 k-steps of 32). Fragments (8-bit): A {a0..a3} = rows {g, g+8, g, g+8}, k {4t..4t+3} (a0,
// a1) and {4t+16..4t+19} (a2, a3); B {b0, b1} = k {4t..}, {4t+16..} of column g. The thread's 16-byte key
// chunk c (bytes 64c + 16t .. +15, words w0..w3, as loaded above) gives k-step 2c B = {w0, w1} and k-step
// 2c+1 B = {w2, w3}: k-step ks maps k 4t+i -> d0+i and k 4t+16+i -> d0+4+i, d0 = 64(ks/2) + 16t + 8(ks%2),
// each head_dim element once. q is staged raw in the same order: A = {x.lo, y.lo, x.hi, y.hi} with x, y the
// 8 bytes of heads h, h+8 at d0 (one LDS.128 per k-step). Epilogue: key scale only (products are exact e4m3).
// The e4m3 mma runs natively on sm_89 and sm_120+ only (there with ~13-bit fp8 tensor-core accumulation);
// ptxas emulates it on sm_90 / sm_100 (slower than the f16 path; there Mma8 = 1 is a test of this layout).
// It does not exist on sm_80: the host declares Mma8 = 1 for sm_89+ targets only.
// Key loads: ld.global.nc.L1::no_allocate with an L2 prefetch-size hint L2Hint (2: 256 B, 1: 128 B, 0: none).
// Every row's arithmetic (mma order, head order, lane reduction) is fixed, independent of the scheduling
// variant (Prefetch/L2Hint/MinBlocks/grid): results are deterministic and bitwise equal across those variants
// (Mma8 changes the arithmetic, hence the results in the last bits).
//
// Masking: row r sees keys n in [lo_r, hi_r) (decode: [0, len); prefill: [ks, ke)) whose page is valid
// (block-table entry in [0, P) and page index < bt_width) and n < num_keys. Output column = n - coloff_r
// (coloff = ks in compressed prefill, else 0). A visited tile writes every row's 32 columns (value or -inf);
// with `clean` every tile is visited, otherwise only tiles in [min lo, max hi). Nothing is read outside
// q / weights / lens / the row tile's block-table row / valid pages; nothing is written outside out.
#include "common.cuh"
#include "mqa_logits_sm90.cuh"  // Hopper wgmma decode path for bf16 keys

namespace dsa {
namespace logits {

constexpr int kNumHeads = 64;
constexpr int kTileKeys = 32;       // keys per warp tile (4 n-tiles)
constexpr int kMaxRows = 8;
enum RangeMode { kCausal1D = 0, kLens2D = 1, kKsKe = 2 };

// Warps per CTA (Warps, 4 or 8) and head m-tiles whose accumulators are live together (MT, 1, 2 or 4: 4 * MT
// independent mma chains per warp) are template parameters chosen per arch on the host (cupy_dsa.heuristics):
// the warps of a CTA share its staged q, so 8 warps on one CTA keep 8 warps per SM where a 100 KB SM
// (sm_86 / sm_89 / sm_120) holds a single 4-row CTA's q.

// 16-byte q words per row staged in shared memory (A quads [m-tile][pair][k-step][lane] of 16-bit mma; the
// e4m3 mma uses the first half) and the dynamic shared memory of a row tile: q words + weights. The host
// passes this size (cupy_dsa.logits states the same formula; tests/test_compile.py checks the two agree).
constexpr int kQWords16 = 4 * 4 * 2 * 32;
template <int Rows>
constexpr int kRowTileSmemBytes = Rows * (kQWords16 * 16 + kNumHeads * 4);

// Raw key bytes of one 32-key tile held by one thread: [n-tile j: key 8j + gid][16-byte chunk c] at byte
// 64c + 16t of the key row (bf16: 4 chunks = pairs s; fp8: 2 chunks = pairs 2c, 2c+1).
template <int KeyFp8>
struct KeyTile {
  static constexpr int kChunks = KeyFp8 ? 2 : 4;
  uint4 raw[4][kChunks];
  float scale;    // fp8: scale of this lane's output key (key_of_lane); 1 otherwise
  int tok0;       // first key of the tile
  int page_ok;    // the tile's page is readable
  unsigned live;  // bit r: row r sees a key of this tile (0: nothing to compute)
};

// The key whose logit lane `lane` stores after the reduction (a bijection of the 32 lanes onto 0..31).
__device__ __forceinline__ int key_of_lane(int lane) {
  const int gid = lane >> 2, t = lane & 3;
  return 8 * (gid >> 1) + 2 * t + (gid & 1);
}

struct Ctx {
  const unsigned char* kv;
  const int* lo;  // shared, per row: visible keys [lo, hi) (0, 0 for an empty row)
  const int* hi;
  int num_keys;
};

// Issue the loads of tile t (keys 32t..32t+31). entry: block-table entry of its page (-1: invalid), unused
// for contiguous keys. Only tiles some row can see are loaded (live != 0).
template <int KeyFp8, int Paged, int Rows, int L2Hint>
__device__ __forceinline__ void load_tile(KeyTile<KeyFp8>& kt, int t, int entry, const Ctx& c, int lane) {
  constexpr int kRowBytes = KeyFp8 ? kHeadDim : 2 * kHeadDim;
  constexpr int kPageBytes = KeyFp8 ? kFp8PageBytes : kBf16PageBytes;
  const int gid = lane >> 2, tq = lane & 3;
  const int tok0 = t * kTileKeys;
  kt.tok0 = tok0;
  kt.scale = 1.0f;
  kt.page_ok = Paged ? entry >= 0 : 1;
  const unsigned char* base = Paged ? c.kv + static_cast<i64>(entry < 0 ? 0 : entry) * kPageBytes : c.kv;
  unsigned live = 0;
#pragma unroll
  for (int r = 0; r < Rows; ++r)
    if (kt.page_ok && c.lo[r] < tok0 + kTileKeys && c.hi[r] > tok0) live |= 1u << r;
  kt.live = live;
  if (!live) return;
  const int slot0 = Paged ? (tok0 & (kPageSlots - 1)) : tok0;  // key index inside `base`
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int row = 8 * j + gid;
    const unsigned char* p = base + static_cast<i64>(slot0 + row) * kRowBytes + 16 * tq;
    const bool in = Paged || tok0 + row < c.num_keys;  // contiguous keys: never read past S
#pragma unroll
    for (int ch = 0; ch < KeyTile<KeyFp8>::kChunks; ++ch)
      kt.raw[j][ch] = in ? ldg_stream_v4<L2Hint>(p + 64 * ch) : make_uint4(0u, 0u, 0u, 0u);
  }
  if (KeyFp8)
    kt.scale = __ldg(reinterpret_cast<const float*>(base + kFp8ScaleOffset) + slot0 + key_of_lane(lane));
}

// The B words of a tile, W[j][s][w] (key 8j + gid, pair s, word w), in the mma input type: bf16 keys as loaded,
// fp8 keys as f16 of the value times 2^-8.
template <int KeyFp8>
__device__ __forceinline__ void key_words(const KeyTile<KeyFp8>& kt, u32 (&W)[4][4][4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (!KeyFp8) {
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint4 v = kt.raw[j][s];
        W[j][s][0] = v.x; W[j][s][1] = v.y; W[j][s][2] = v.z; W[j][s][3] = v.w;
      }
    } else {
#pragma unroll
      for (int g = 0; g < 2; ++g) {
        const uint4 v = kt.raw[j][g];
        const u32 x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          u32* w = W[j][2 * g + half];
          e4m3x4_to_f16x2_scaled(x[2 * half], w[0], w[1]);
          e4m3x4_to_f16x2_scaled(x[2 * half + 1], w[2], w[3]);
        }
      }
    }
  }
}

// The two ways a warp multiplies its q quads by a key tile: one k-step `ks` of m-tile accumulator acc (key
// n-tile j) from A quad `a`. Mma16: 8 k-steps of m16n8k16 (bf16, or f16 when F16) on the converted words
// W[j][pair][word] (k-step 2s + kk = words 2kk, 2kk+1 of pair s). MmaE4m3 (sm_89+): 4 k-steps of m16n8k32 on
// the raw key bytes: k-step ks uses chunk ks/2, words {x, y} (ks even) or {z, w} (ks odd); no conversion.
template <bool F16>
struct Mma16 {
  static constexpr int kSteps = 8;
  const u32 (&W)[4][4][4];
  __device__ __forceinline__ void step(float (&acc)[4], const uint4& a, int j, int ks) const {
    const u32* w = W[j][ks >> 1] + 2 * (ks & 1);
    mma_16816<F16>(acc, a.x, a.y, a.z, a.w, w[0], w[1]);
  }
};

struct MmaE4m3 {
  static constexpr int kSteps = 4;
  const uint4 (&raw)[4][2];
  __device__ __forceinline__ void step(float (&acc)[4], const uint4& a, int j, int ks) const {
    const uint4 v = raw[j][ks >> 1];
    mma_16832_e4m3(acc, a.x, a.y, a.z, a.w, (ks & 1) ? v.z : v.x, (ks & 1) ? v.w : v.y);
  }
};

// sum_h relu(q[r,h] . k) * w[r,h] for this thread's keys 8j + 2t + e (p[2j + e]), partial over its heads
// 16i + gid and 16i + gid + 8 (the reduction over gid follows). qs_row: A quads [m-tile i][k-step][lane]
// (Mma::kSteps k-steps); ws_row: weights as float2 (w[16i + gid], w[16i + gid + 8]) at [i][gid].
template <int MT, class Mma>
__device__ __forceinline__ void row_partials(const Mma& mma, const uint4* __restrict__ qs_row,
                                             const float2* __restrict__ ws_row, int lane, float (&p)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) p[i] = 0.0f;
#pragma unroll
  for (int i0 = 0; i0 < 4; i0 += MT) {
    float acc[MT][4][4];
#pragma unroll
    for (int ii = 0; ii < MT; ++ii)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[ii][j][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < Mma::kSteps; ++ks) {
#pragma unroll
      for (int ii = 0; ii < MT; ++ii) {
        const uint4 a = qs_row[((i0 + ii) * Mma::kSteps + ks) * 32 + lane];
#pragma unroll
        for (int j = 0; j < 4; ++j) mma.step(acc[ii][j], a, j, ks);
      }
    }
#pragma unroll
    for (int ii = 0; ii < MT; ++ii) {
      const float2 w = ws_row[(i0 + ii) * 8 + (lane >> 2)];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        p[2 * j] = fmaf(fmaxf(acc[ii][j][0], 0.0f), w.x, p[2 * j]);
        p[2 * j] = fmaf(fmaxf(acc[ii][j][2], 0.0f), w.y, p[2 * j]);
        p[2 * j + 1] = fmaf(fmaxf(acc[ii][j][1], 0.0f), w.x, p[2 * j + 1]);
        p[2 * j + 1] = fmaf(fmaxf(acc[ii][j][3], 0.0f), w.y, p[2 * j + 1]);
      }
    }
  }
}

// Sum of p[c] over the 8 lanes sharing t (lane bits 2..4), transposed: lane (gid, t) ends with the full sum
// of index c = gid, i.e. key key_of_lane(lane). Halving exchanges (4 + 2 + 1 shuffles); each sum is formed
// in exactly one lane, so results are deterministic.
__device__ __forceinline__ float gid_reduce(const float (&p)[8], int lane) {
  const bool b4 = (lane >> 4) & 1, b3 = (lane >> 3) & 1, b2 = (lane >> 2) & 1;
  float u[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // keep c = 4*b4 + q
    const float keep = b4 ? p[4 + q] : p[q], send = b4 ? p[q] : p[4 + q];
    u[q] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
  }
  float x[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {  // keep c = 4*b4 + 2*b3 + q
    const float keep = b3 ? u[2 + q] : u[q], send = b3 ? u[q] : u[2 + q];
    x[q] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
  }
  const float keep = b2 ? x[1] : x[0], send = b2 ? x[0] : x[1];  // keep c = 4*b4 + 2*b3 + b2 = gid
  return keep + __shfl_xor_sync(0xffffffffu, send, 4);
}

// ---- a bf16 q on fp8 keys: staged as f16 times 2^qs per head (logits_row_tile) ----
// 2^e as a float, e in [-126, 127].
__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }

// qs of a head whose max |q| is qmax: 2^qs puts qmax in [2^13, 2^14), clamped to [-100, 100]; 0 when qmax is 0
// or not finite.
__device__ __forceinline__ int q_scale_exp(float qmax) {
  int e = 0;
  frexpf(qmax, &e);  // qmax in [2^(e-1), 2^e)
  return qmax > 0.0f && isfinite(qmax) ? min(max(14 - e, -100), 100) : 0;
}

// 16 bytes of global memory, a load the compiler cannot merge with another of the same address.
__device__ __forceinline__ uint4 load_volatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// max(m, |x|) over 8 bf16 values (fmaxf: a NaN is skipped).
__device__ __forceinline__ float bf16x8_absmax(const uint4& x, float m) {
  const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
    m = fmaxf(m, fmaxf(fabsf(__uint_as_float(w[i] << 16)), fabsf(__uint_as_float(w[i] & 0xFFFF0000u))));
  return m;
}

// bf16x2 word -> f16x2 of its two values times `scale` (a power of two), rounded to nearest.
__device__ __forceinline__ u32 bf16x2_to_f16x2_scaled(u32 w, float scale) {
  const __half2 h = __floats2half2_rn(__uint_as_float(w << 16) * scale, __uint_as_float(w & 0xFFFF0000u) * scale);
  return *reinterpret_cast<const u32*>(&h);
}

}  // namespace logits
}  // namespace dsa

namespace dsa {
namespace logits {

// One launch's problem (see the kernels below for the tensor contracts).
struct Problem {
  const unsigned char* q;
  const float* weights;
  const unsigned char* kv;
  i64 kv_pages;
  const int* block_table;
  i64 bt_tile_stride;
  int bt_width;
  const int* lens0;
  const int* lens1;
  int mode;
  int row_start;
  int row_end;
  int num_keys;
  float* out;
  i64 out_stride;
  int width;
  int compressed;
  int clean;
};

// Rows row0 + i (i < Rows, row < rend) against their key tiles in [t_lo, t_hi) (32 keys each); `tile` picks the
// block-table row (block_table + tile * bt_tile_stride) and, for 1-D causal lengths, lens0[tile]. CTA part
// `part` of `parts` takes every parts-th group of Warps tiles. Called by every thread of the CTA; uses
// the dynamic shared memory for q, so a second call needs a barrier first.
template <int KeyFp8, int QFp8, int Rows, int Warps, int MT, int Paged, int Prefetch, int L2Hint, int Mma8>
__device__ __forceinline__ void logits_row_tile(const Problem& P, int tile, int row0, int rend, int t_lo, int t_hi,
                                                int part, int parts) {
  const unsigned char* __restrict__ q = P.q;
  const float* __restrict__ weights = P.weights;
  const unsigned char* __restrict__ kv = P.kv;
  const i64 kv_pages = P.kv_pages;
  const int* __restrict__ block_table = P.block_table;
  const i64 bt_tile_stride = P.bt_tile_stride;
  const int bt_width = P.bt_width;
  const int* __restrict__ lens0 = P.lens0;
  const int* __restrict__ lens1 = P.lens1;
  const int mode = P.mode, row_start = P.row_start, row_end = rend, num_keys = P.num_keys;
  float* __restrict__ out = P.out;
  const i64 out_stride = P.out_stride;
  const int width = P.width, compressed = P.compressed, clean = P.clean;
  static_assert(Rows >= 1 && Rows <= kMaxRows, "Rows");
  static_assert(Paged || !KeyFp8, "contiguous keys are bf16");
  // F8: fp8 keys x fp8 q with the e4m3 mma (Mma8 = 1; sm_89+ only: native on sm_89 / sm_120+, emulated by
  // ptxas on sm_90 / sm_100, where it is a layout test / bench variant).
  // F16: fp8 keys otherwise, on f16 mma of shift-expanded key bytes (values * 2^-8); an fp8 q expanded the same
  // way, a bf16 q (QScaled) as f16 times 2^qs_h per head h (below).
  static_assert(Mma8 == 0 || (Mma8 == 1 && KeyFp8 && QFp8 && kHasFp8Mma),
                "Mma8 = 1 is the fp8-key x fp8-q e4m3 mma of sm_89+ targets");
  constexpr bool F8 = Mma8 == 1;
  constexpr bool F16 = KeyFp8 && !F8;
  constexpr bool QScaled = KeyFp8 && !QFp8;
  static_assert(Warps == 4 || Warps == 8, "Warps");
  static_assert(MT == 1 || MT == 2 || MT == 4, "MT divides the 4 head m-tiles");
  // uint4 per row: A quads [m-tile][pair][k-step][lane] (16-bit), [m-tile][k-step][lane] (F8). The host
  // always reserves the 16-bit size (kRowTileSmemBytes).
  constexpr int kQWords = F8 ? kQWords16 / 2 : kQWords16;

  extern __shared__ uint4 smem[];
  uint4* qs = smem;                                                   // [Rows][kQWords]
  float2* ws = reinterpret_cast<float2*>(smem + Rows * kQWords);      // [Rows][4][8]: (w[16i+g], w[16i+g+8])
  __shared__ int s_lo[kMaxRows], s_hi[kMaxRows], s_off[kMaxRows];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // ---- per-row key ranges (every thread: a few cached loads) ----
  unsigned nonempty = 0;  // bit r: row r sees at least one key
  int lo_min = num_keys, hi_max = 0;
  int lo_r[Rows], hi_r[Rows];
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    const int row = row0 + r;
    int lo = 0, hi = 0;
    if (row < row_end) {
      if (mode == kCausal1D) {
        hi = lens0[tile] - (Rows - 1 - r);
      } else if (mode == kLens2D) {
        hi = lens0[row];
      } else {
        lo = max(lens0[row], 0);
        hi = lens1[row];
      }
      hi = min(hi, num_keys);
    }
    if (lo < hi) {
      nonempty |= 1u << r;
      lo_min = min(lo_min, lo);
      hi_max = max(hi_max, hi);
    }
    lo_r[r] = lo < hi ? lo : 0;
    hi_r[r] = lo < hi ? hi : 0;
  }
  // Tiles to visit: all of them when every masked column must become -inf (columns == keys then),
  // else the tiles some row can see.
  const bool fill = clean && !compressed;
  int t_begin = 0, t_end = (num_keys + kTileKeys - 1) / kTileKeys;
  if (!fill) {
    if (!nonempty) return;
    t_begin = lo_min / kTileKeys;
    t_end = (hi_max + kTileKeys - 1) / kTileKeys;
  }
  t_begin = max(t_begin, t_lo);
  t_end = min(t_end, t_hi);
  const int stride = parts * Warps;                      // tiles between a warp's consecutive tiles
  if (t_begin + part * Warps >= t_end) return;           // no tile for this CTA (CTA-uniform)
  const int t_warp = t_begin + part * Warps + warp;      // this warp's first tile

  // ---- stage row ranges, weights and q fragments (rows that see nothing are never read) ----
  if (tid < Rows) {
    const int r = tid;
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < Rows; ++i)
      if (i == r) { lo = lo_r[i]; hi = hi_r[i]; }
    s_lo[r] = lo;
    s_hi[r] = hi;
    s_off[r] = (compressed && row0 + r < row_end) ? lens0[row0 + r] : 0;
  }
  // q chunk D(s,t) of one head as the 4 mma words of the key layout's element order (a bf16 q on fp8 keys is
  // staged below, with its per-head scale).
  auto q_words = [&](i64 row, int head, int d) -> uint4 {
    const i64 elem = (row * kNumHeads + head) * kHeadDim + d;
    uint4 v;
    if (QFp8) {
      const uint2 x = *reinterpret_cast<const uint2*>(q + elem);
      if (F16) {  // same expansion as the keys: words (0,2) (1,3) (4,6) (5,7), values * 2^-8
        e4m3x4_to_f16x2_scaled(x.x, v.x, v.y);
        e4m3x4_to_f16x2_scaled(x.y, v.z, v.w);
      } else {    // bf16 keys: natural pairs, exact bf16
        const unsigned char* b = reinterpret_cast<const unsigned char*>(&x);
        v.x = pack_bf16x2(e4m3_to_float(b[0]), e4m3_to_float(b[1]));
        v.y = pack_bf16x2(e4m3_to_float(b[2]), e4m3_to_float(b[3]));
        v.z = pack_bf16x2(e4m3_to_float(b[4]), e4m3_to_float(b[5]));
        v.w = pack_bf16x2(e4m3_to_float(b[6]), e4m3_to_float(b[7]));
      }
    } else {  // bf16 q on bf16 keys: as stored
      v = *reinterpret_cast<const uint4*>(q + 2 * elem);
    }
    return v;
  };
  if (nonempty) {
    for (int i = tid; i < (QScaled ? 0 : Rows * kNumHeads / 2); i += Warps * 32) {  // QScaled: with its q below
      const int r = i / (kNumHeads / 2), m = (i >> 3) & 3, g = i & 7;
      if (!((nonempty >> r) & 1u)) continue;
      const float* wr = weights + static_cast<i64>(row0 + r) * kNumHeads;
      ws[i] = make_float2(wr[16 * m + g], wr[16 * m + g + 8]);
    }
    if constexpr (F8) {
      // A quad of (m-tile m, k-step ks, lane (g, t)): 8 raw q bytes at d0 = 64(ks/2) + 16t + 8(ks%2) of heads
      // h = 16m + g (x) and h + 8 (y): {x.lo, y.lo, x.hi, y.hi} = k 4t.., rows g, g+8, then k 4t+16...
      for (int i = tid; i < Rows * kQWords; i += Warps * 32) {
        const int r = i / kQWords, rem = i % kQWords;
        if (!((nonempty >> r) & 1u)) continue;
        const int m = rem >> 7, ks = (rem >> 5) & 3, ln = rem & 31;
        const int head = 16 * m + (ln >> 2), t = ln & 3;
        const i64 elem = ((static_cast<i64>(row0 + r) * kNumHeads + head) * kHeadDim) + 64 * (ks >> 1) + 16 * t +
                         8 * (ks & 1);
        const uint2 x = *reinterpret_cast<const uint2*>(q + elem);
        const uint2 y = *reinterpret_cast<const uint2*>(q + elem + 8 * kHeadDim);
        qs[static_cast<i64>(r) * kQWords + rem] = make_uint4(x.x, y.x, x.y, y.y);
      }
    } else {
      if constexpr (QScaled) {
        // Head h of row r as f16 of q_h * 2^qs_h, qs_h = q_scale_exp(max |q_h|), and its weight as
        // w_h * 2^(8 - qs_h): relu commutes with a positive power of two, so the products equal those of the
        // unscaled q (exactly, barring fp32 over/underflow of the weight). One pass, no CTA-wide max: the 4 lanes
        // t of a (m-tile, gid) hold all 128 elements of heads 16m + gid and + 8 over the 4 pairs s. Exact in f16
        // unless an element is below max |q_h| * 2^-30 (an f16 subnormal: error at most max |q_h| * 2^-38, far
        // below the fp32 sum's rounding) or a bf16 subnormal (zero: -ftz). Non-finite q: the max skips a NaN
        // (whose head's relu, fmaxf, gives 0 as on bf16 keys); an infinity gives qs_h = 0, the head staged
        // unscaled (f16 overflows from 65520 up; so does a finite max |q_h| from 2^116 up, at the clamp).
        for (int i = tid; i < Rows * 128; i += Warps * 32) {  // i % 32 == lane: a warp is one (row, m-tile)
          const int r = i >> 7, m = (i >> 5) & 3, ln = i & 31, g = ln >> 2, t = ln & 3;
          if (!((nonempty >> r) & 1u)) continue;  // warp-uniform
          const unsigned char* qh = q + 2 * ((static_cast<i64>(row0 + r) * kNumHeads + 16 * m + g) * kHeadDim);
          auto chunk = [&](int s, int h8) {  // 8 elements of head 16m + g (+ 8 if h8) at pair s
            return reinterpret_cast<const uint4*>(qh + 2 * (64 * (s >> 1) + 16 * t + 8 * (s & 1) + h8 * 8 * kHeadDim));
          };
          float mx0 = 0.0f, mx1 = 0.0f;
#pragma unroll
          for (int s = 0; s < 4; ++s) {  // volatile loads: the 8 chunks are read again below, not held in registers
            mx0 = bf16x8_absmax(load_volatile(chunk(s, 0)), mx0);
            mx1 = bf16x8_absmax(load_volatile(chunk(s, 1)), mx1);
          }
#pragma unroll
          for (int o = 1; o <= 2; o <<= 1) {  // over t (lane bits 0, 1)
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
          }
          const int qs0 = q_scale_exp(mx0), qs1 = q_scale_exp(mx1);
          const float sc0 = pow2(qs0), sc1 = pow2(qs1);
#pragma unroll
          for (int s = 0; s < 4; ++s) {  // fp8 key word order (0,2) (1,3) (4,6) (5,7)
            const uint4 a = *chunk(s, 0), b = *chunk(s, 1);  // again: 128 bytes just read (L1)
            uint4* dst = qs + static_cast<i64>(r) * kQWords + ((m * 4 + s) * 2) * 32 + ln;
            dst[0] = make_uint4(bf16x2_to_f16x2_scaled(__byte_perm(a.x, a.y, 0x5410), sc0),
                                bf16x2_to_f16x2_scaled(__byte_perm(b.x, b.y, 0x5410), sc1),
                                bf16x2_to_f16x2_scaled(__byte_perm(a.x, a.y, 0x7632), sc0),
                                bf16x2_to_f16x2_scaled(__byte_perm(b.x, b.y, 0x7632), sc1));  // k-step 2s
            dst[32] = make_uint4(bf16x2_to_f16x2_scaled(__byte_perm(a.z, a.w, 0x5410), sc0),
                                 bf16x2_to_f16x2_scaled(__byte_perm(b.z, b.w, 0x5410), sc1),
                                 bf16x2_to_f16x2_scaled(__byte_perm(a.z, a.w, 0x7632), sc0),
                                 bf16x2_to_f16x2_scaled(__byte_perm(b.z, b.w, 0x7632), sc1));  // k-step 2s+1
          }
          if (t == 0) {
            const float* wr = weights + static_cast<i64>(row0 + r) * kNumHeads + 16 * m + g;
            ws[i >> 2] = make_float2(wr[0] * pow2(8 - qs0), wr[8] * pow2(8 - qs1));  // [r][m][g]
          }
        }
      } else {
        for (int i = tid; i < Rows * kQWords / 2; i += Warps * 32) {  // both k-steps of a pair at once
          const int r = i / (kQWords / 2), rem = i % (kQWords / 2);
          if (!((nonempty >> r) & 1u)) continue;
          const int m = rem >> 7, s = (rem >> 5) & 3, ln = rem & 31;
          const int head = 16 * m + (ln >> 2), t = ln & 3;
          const int d = KeyFp8 ? 64 * (s >> 1) + 16 * t + 8 * (s & 1) : 32 * s + 8 * t;
          const uint4 v0 = q_words(row0 + r, head, d), v1 = q_words(row0 + r, head + 8, d);
          uint4* dst = qs + static_cast<i64>(r) * kQWords + ((m * 4 + s) * 2) * 32 + ln;
          dst[0] = make_uint4(v0.x, v1.x, v0.y, v1.y);   // k-step 2s
          dst[32] = make_uint4(v0.z, v1.z, v0.w, v1.w);  // k-step 2s+1
        }
      }
    }
  }
  __syncthreads();

  Ctx c;
  c.kv = kv;
  c.lo = s_lo;
  c.hi = s_hi;
  c.num_keys = num_keys;
  const float kNegInf = __int_as_float(0xff800000);
  const float epi_scale = F16 && QFp8 ? 65536.0f : 1.0f;  // QScaled: 2^(8 - qs_h) is in the head weights
  const int key_lane = key_of_lane(lane);  // this lane's output key inside a tile

  // Block-table entries of this warp's tiles k .. k+31, one per lane, refreshed every 32 tiles (one
  // coalesced-ish load instead of a dependent load per tile). Calls are warp-uniform.
  const int* bt = Paged ? block_table + static_cast<i64>(tile) * bt_tile_stride : nullptr;
  int ent_reg = -1, ent_k0 = -kTileKeys;
  auto entry_at = [&](int k) -> int {
    if (!Paged) return 0;
    if (k - ent_k0 >= 32) {
      ent_k0 = k;
      const int tl = t_warp + (k + lane) * stride;
      int e = -1;
      if (tl < t_end && (tl >> 1) < bt_width) {
        e = bt[tl >> 1];
        if (e < 0 || static_cast<i64>(e) >= kv_pages) e = -1;
      }
      ent_reg = e;
    }
    return __shfl_sync(0xffffffffu, ent_reg, k - ent_k0);
  };

  // Compute one loaded tile against every row and store its 32 columns per row.
  auto process = [&](const KeyTile<KeyFp8>& kt) {
    u32 W[4][4][4];
    if constexpr (!F8) {
      if (kt.live) key_words<KeyFp8>(kt, W);
    }
    const int n = kt.tok0 + key_lane;
    const float scale = kt.scale * epi_scale;
#pragma unroll 1
    for (int r = 0; r < Rows; ++r) {
      if (row0 + r >= row_end) break;
      float val = kNegInf;
      if ((kt.live >> r) & 1u) {
        float p[8];
        if constexpr (F8)
          row_partials<MT>(MmaE4m3{kt.raw}, qs + r * kQWords, ws + r * (kNumHeads / 2), lane, p);
        else
          row_partials<MT>(Mma16<F16>{W}, qs + r * kQWords, ws + r * (kNumHeads / 2), lane, p);
        const float sum = gid_reduce(p, lane);
        if (n >= s_lo[r] && n < s_hi[r]) val = sum * scale;
      }
      const int col = n - s_off[r];
      if (n < num_keys && col >= 0 && col < width)
        out[static_cast<i64>(row0 + r - row_start) * out_stride + col] = val;
    }
  };

  if (Prefetch) {
    KeyTile<KeyFp8> ka, kb;
    if (t_warp < t_end) load_tile<KeyFp8, Paged, Rows, L2Hint>(ka, t_warp, entry_at(0), c, lane);
    for (int k = 0; t_warp + k * stride < t_end; k += 2) {
      const int t1 = t_warp + (k + 1) * stride;
      if (t1 < t_end) load_tile<KeyFp8, Paged, Rows, L2Hint>(kb, t1, entry_at(k + 1), c, lane);
      process(ka);
      if (t1 >= t_end) break;
      const int t2 = t1 + stride;
      if (t2 < t_end) load_tile<KeyFp8, Paged, Rows, L2Hint>(ka, t2, entry_at(k + 2), c, lane);
      process(kb);
    }
  } else {
    for (int k = 0; t_warp + k * stride < t_end; ++k) {
      KeyTile<KeyFp8> ka;
      load_tile<KeyFp8, Paged, Rows, L2Hint>(ka, t_warp + k * stride, entry_at(k), c, lane);
      process(ka);
    }
  }
}

}  // namespace logits
}  // namespace dsa

#define DSA_LOGITS_ARGS                                                                                      \
  const unsigned char *__restrict__ q, const float *__restrict__ weights, const unsigned char *__restrict__ kv, \
      long long kv_pages, const int *__restrict__ block_table, long long bt_tile_stride, int bt_width,      \
      const int *__restrict__ lens0, const int *__restrict__ lens1, int mode, int row_start, int row_end,   \
      int num_keys, float *__restrict__ out, long long out_stride, int width, int compressed, int clean
#define DSA_LOGITS_PROBLEM                                                                                   \
  dsa::logits::Problem {                                                                                     \
    q, weights, kv, kv_pages, block_table, bt_tile_stride, bt_width, lens0, lens1, mode, row_start, row_end, \
        num_keys, out, out_stride, width, compressed, clean                                                  \
  }

// q: [rows_total, 64, 128] fp8 e4m3 (QFp8) or bf16; weights fp32 [rows_total, 64]; kv: paged cache rows
// (Paged; kv_pages pages, block table row of tile x at block_table + x * bt_tile_stride, bt_width entries) or
// contiguous bf16 keys [num_keys, 128]. Rows of tile x: row_start + x*Rows + i, i < Rows, < row_end.
// mode 0: len = lens0[x] - (Rows-1-i); mode 1: len = lens0[row]; mode 2: [lens0[row], lens1[row]).
// out row (row - row_start), stride out_stride, `width` columns. L2Hint: L2 prefetch size of the key loads
// (2: 256 B, 1: 128 B, 0: none). Mma8: fp8 keys x fp8 q on the e4m3 mma (1, sm_89+ targets) or
// not (0), see the header. Warps per CTA: Warps; dynamic shared memory: kRowTileSmemBytes<Rows>.
// Grid: x = row tile (the last first: causal prefill runs its heaviest tiles first), y = CTAs sharing its keys.
// Varlen (tile_plan != null, Paged, Rows == kVarlenTileRows): the rows of `batch` requests (cu_rows, see
// common.cuh), tile x of the plan holding rows of request x's request b only, its block-table row at
// block_table + b * bt_tile_stride; grid x is an upper bound of the tiles (the ones past the plan exit).
template <int KeyFp8, int QFp8, int Rows, int Warps, int MT, int Paged, int Prefetch, int L2Hint, int Mma8,
          int MinBlocks>
__global__ void __launch_bounds__(Warps * 32, MinBlocks)
    mqa_logits_kernel(DSA_LOGITS_ARGS, const long long* __restrict__ tile_plan, const int* __restrict__ cu_rows,
                      int batch) {
  const int x = gridDim.x - 1 - blockIdx.x;
  int b = 0, row0 = row_start + x * Rows, rend = row_end;  // one request: tile x of [row_start, row_end)
  if (tile_plan != nullptr) {
    if constexpr (Paged && Rows == dsa::kVarlenTileRows) {
      if (!dsa::varlen_tile(tile_plan, cu_rows, batch, row_start, row_end, x, b, row0, rend)) return;
    } else {
      __trap();  // the host launches varlen only on paged 4-row configs
    }
  }
  dsa::logits::logits_row_tile<KeyFp8, QFp8, Rows, Warps, MT, Paged, Prefetch, L2Hint, Mma8>(
      DSA_LOGITS_PROBLEM, b, row0, rend, 0, 0x7fffffff, blockIdx.y, gridDim.y);
}

// Paged decode with the balanced schedule: grid (C) = one wave, Warps warps, row tile = request b with its
// Rows = next_n rows (each key tile is loaded once and scored against all next_n rows of its request) (mode 0 or 1, row_start 0, row_end = batch * Rows, num_keys = width, compressed 0).
// CTA c runs the request segments of its share of the plan (int64 [batch + 1], see common.cuh), a segment of
// pages [p0, p1) being key tiles [2 p0, 2 p1); with `clean` it then writes -inf over its share of the pages
// no CTA computes.
template <int KeyFp8, int QFp8, int Rows, int Warps, int MT, int Prefetch, int L2Hint, int Mma8, int MinBlocks>
__global__ void __launch_bounds__(Warps * 32, MinBlocks)
    mqa_logits_decode_kernel(DSA_LOGITS_ARGS, const long long* __restrict__ plan, int batch) {
  static_assert(Rows <= 4, "decode: next_n <= 4");
  const dsa::logits::Problem P = DSA_LOGITS_PROBLEM;
  dsa::for_each_decode_segment(plan, batch, [&](int b, int p_begin, int p_end) {
    dsa::logits::logits_row_tile<KeyFp8, QFp8, Rows, Warps, MT, 1, Prefetch, L2Hint, Mma8>(
        P, b, b * Rows, P.row_end, 2 * p_begin, 2 * p_end, 0, 1);
  });
  if (clean) dsa::fill_uncomputed_pages(plan, batch, Rows, width, out, out_stride);
}

// ---- Prefill with q held in registers (the compute-bound mma.sync design; sm_120's prefill) -------------
//
// One warp per query row: the row's 64 heads x 128 dims of q are loaded once per work item as ready A fragments
// (4 m-tiles x 8 k-steps x 4 words = 128 registers) and stay in registers for the whole key loop; each warp sums
// relu(q . k) * w over its heads in registers (the weights in a shared-memory row per warp: the register file is
// full) and reduces over lanes as the row-tile kernel does (gid_reduce). A CTA is kQregWarps = 8 warps = 8
// consecutive rows sharing their keys, one CTA per SM (registers), so 8 warps per SM on every arch: 64-key chunks
// (one page of the paged layout) stream through a Stages-deep cp.async ring in shared memory, one barrier per
// chunk, and every warp reads them with ldmatrix (16 B of a key row per lane address, conflict-free by an XOR
// swizzle of the 16-byte column: column c of key n sits at c ^ (n & 7)). Per k-step a warp issues 2 ldmatrix.x4
// (the B fragments of 32 keys) for 16 mma (4 m-tiles x 4 n-tiles), in 4 / NT passes (qreg_partials): 8 mma per
// ldmatrix.x4, where the 4-row-tile kernel reads 512 B of q from shared memory (LDS.128) per 4 mma.
// Fragments (natural head_dim order, PTX ISA m16n8k16): mma k-step ks covers dims 16ks..16ks+15; ldmatrix of
// the 8 keys 8j.. at column 2ks (+1) gives lane (gid, t) key 8j + gid, dims 16ks + 2t, +1 (+8): B {b0, b1};
// q's A words are a0a1 = q[h][16ks + 2t..], a2a3 = q[h + 8][..], a4a5 = q[h][16ks + 8 + 2t..], a6a7 = q[h + 8][..]
// with h = 16i + gid (m-tile i).
// Persistent CTAs: work item i = (part p = i / tiles, row tile x = tiles - 1 - i % tiles) covers the chunks of
// [p * chunks_per_item, (p + 1) * chunks_per_item) that its rows can see (all of them with `clean`, as the row-tile
// kernel); CTA c takes items c, c + G, c + 2G ... (G = gridDim.x, one wave), and the ring runs on across its
// items, so nothing drains between them. The producer (every thread's cp.async share) and the consumer walk
// the same sequence of (item, chunk), the producer Stages - 1 chunks ahead. Masking and the columns written
// are the row-tile kernel's, at 64-key granularity: a visited chunk writes each row's 64 columns (value or -inf).
// bf16 keys only (contiguous or the paged bf16 layout); q fp8 (exact in bf16) or bf16; one request (no varlen).
namespace dsa {
namespace logits {

constexpr int kQregWarps = 8;
constexpr int kChunkKeys = 64;                         // keys per ring stage (one page)
constexpr int kChunkBytes = kChunkKeys * kHeadDim * 2;  // 16 KiB of bf16 keys
template <int Stages>
constexpr int kQregSmemBytes = Stages * kChunkBytes;

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// The (item, chunk) walk of one CTA, identical in every thread (CTA-uniform): the producer (ring refills) and
// the consumer (compute) each walk it, the producer Stages - 1 chunks ahead.
struct QregWork {
  int n_items, tiles, cpi;  // items, row tiles, chunks per item
};
constexpr int kQregDone = 0x7fffffff;
struct QregCursor {
  int item;      // current item (kQregDone: past the last)
  int row0;      // first row of the item's tile
  int c, c_end;  // current chunk, end of the item's chunks
};

// The visible range [lo, hi) of row `row` (0, 0 when it sees nothing or is outside the launch's rows).
__device__ __forceinline__ void qreg_row_range(const Problem& P, int row, int& lo, int& hi) {
  lo = 0;
  hi = 0;
  if (row < P.row_end) {
    lo = max(P.lens0[row], 0);
    hi = min(P.lens1[row], P.num_keys);
  }
  if (lo >= hi) lo = hi = 0;
}

// Moves to the next item with chunks to visit (or past the end: item >= n_items).
__device__ __forceinline__ void qreg_next_item(const Problem& P, const QregWork& W, QregCursor& k, int lane) {
  const bool fill = P.clean && !P.compressed;
  const int n_chunks = (P.num_keys + kChunkKeys - 1) / kChunkKeys;
  for (k.item += gridDim.x; k.item < W.n_items; k.item += gridDim.x) {
    const int p = k.item / W.tiles, x = W.tiles - 1 - k.item % W.tiles;
    k.row0 = P.row_start + x * kQregWarps;
    int lo, hi;
    qreg_row_range(P, k.row0 + (lane & (kQregWarps - 1)), lo, hi);
    int lo_min = lo < hi ? lo : 0x7fffffff, hi_max = hi;
#pragma unroll
    for (int m = 1; m < kQregWarps; m <<= 1) {
      lo_min = min(lo_min, __shfl_xor_sync(0xffffffffu, lo_min, m));
      hi_max = max(hi_max, __shfl_xor_sync(0xffffffffu, hi_max, m));
    }
    int c0 = 0, c1 = n_chunks;
    if (!fill) {
      if (hi_max == 0) continue;  // no row of the tile sees a key
      c0 = lo_min / kChunkKeys;
      c1 = (hi_max + kChunkKeys - 1) / kChunkKeys;
    }
    c0 = max(c0, p * W.cpi);
    c1 = min(c1, (p + 1) * W.cpi);
    if (c0 < c1) {
      k.c = c0;
      k.c_end = c1;
      return;
    }
  }
  k.item = kQregDone;
}

__device__ __forceinline__ void qreg_advance(const Problem& P, const QregWork& W, QregCursor& k, int lane) {
  if (++k.c >= k.c_end) qreg_next_item(P, W, k, lane);
}

// Block-table entry of chunk c (-1: not readable), or 0 for contiguous keys.
template <int Paged>
__device__ __forceinline__ int qreg_entry(const Problem& P, int c) {
  if (!Paged) return 0;
  if (c >= P.bt_width) return -1;
  const int e = P.block_table[c];
  return (e < 0 || static_cast<i64>(e) >= P.kv_pages) ? -1 : e;
}

// Issue chunk c's 64 keys into ring slot `dst` (every thread: 4 x 16 bytes; zeros for an unreadable page and for
// keys past num_keys, which are then never read).
template <int Paged>
__device__ __forceinline__ void qreg_issue(const Problem& P, int c, u32 dst, int tid) {
  const int entry = qreg_entry<Paged>(P, c);
  const unsigned char* base =
      Paged ? P.kv + static_cast<i64>(entry < 0 ? 0 : entry) * kBf16PageBytes
            : P.kv + static_cast<i64>(c) * kChunkBytes;
#pragma unroll
  for (int k = 0; k < kChunkBytes / 16 / (kQregWarps * 32); ++k) {
    const int idx = tid + k * kQregWarps * 32, key = idx >> 4, col = idx & 15;
    const bool in = entry >= 0 && (Paged || c * kChunkKeys + key < P.num_keys);
    const unsigned char* src = in ? base + key * (2 * kHeadDim) + 16 * col : P.kv;
    cp_async16(dst + key * (2 * kHeadDim) + 16 * (col ^ (key & 7)), src, in ? 16 : 0);
  }
}

// q fragments of row `row` (A words qa[m-tile][k-step][word]) and its weights as float2 (w[16i + g],
// w[16i + g + 8]) at ws[8i + g] (the warp's own shared-memory row: registers are all taken by q and the mma).
template <int QFp8>
__device__ __forceinline__ void qreg_load_q(const Problem& P, int row, int lane, u32 (&qa)[4][8][4],
                                            float2* ws) {
  const int gid = lane >> 2, t = lane & 3;
  {
    const float* wr = P.weights + static_cast<i64>(row) * kNumHeads + 16 * (lane >> 3) + (lane & 7);
    ws[lane] = make_float2(wr[0], wr[8]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
      for (int v = 0; v < 4; ++v) {  // v: a0a1, a2a3, a4a5, a6a7
        const int head = 16 * i + gid + 8 * (v & 1), d = 16 * ks + 2 * t + 8 * (v >> 1);
        const i64 elem = (static_cast<i64>(row) * kNumHeads + head) * kHeadDim + d;
        if (QFp8) {
          const unsigned short x = *reinterpret_cast<const unsigned short*>(P.q + elem);
          qa[i][ks][v] = pack_bf16x2(e4m3_to_float(x & 0xff), e4m3_to_float(x >> 8));
        } else {
          qa[i][ks][v] = *reinterpret_cast<const u32*>(P.q + 2 * elem);
        }
      }
    }
  }
}

// sum over the row's heads of relu(q . k) * w for the 32 keys of one half-chunk (B from the ring slot through
// ldmatrix; lane_addr: this lane's ldmatrix row address of the half-chunk, column 0; swz: its column swizzle), as
// p[2j + e] for key 8j + 2t + e, partial over the lane's heads (as row_partials). NT n-tiles (8 keys each) per
// pass: every k-step's B fragments (NT / 2 ldmatrix.x4) feed all 4 m-tiles (4 * NT mma), so each pass reads B
// once; NT 2 holds 32 accumulators, NT 4 holds 64.
template <int NT>
__device__ __forceinline__ void qreg_partials(const u32 (&qa)[4][8][4], const float2* ws, u32 lane_addr,
                                              u32 swz, float (&p)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) p[i] = 0.0f;
#pragma unroll
  for (int j0 = 0; j0 < 4; j0 += NT) {
    float acc[4][NT][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int jj = 0; jj < NT; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][jj][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      u32 b[2 * NT];
      const u32 col = ((2 * ks) ^ swz) * 16;  // swizzled 16-byte column 2ks (+1 for lanes 8-15, 24-31)
#pragma unroll
      for (int jj = 0; jj < NT; jj += 2)        // n-tiles j0 + jj, j0 + jj + 1: keys 8 (j0 + jj) ..
        ldsm_x4(lane_addr + (j0 + jj) * 8 * (2 * kHeadDim) + col, b[2 * jj], b[2 * jj + 1], b[2 * jj + 2],
                b[2 * jj + 3]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32* a = qa[i][ks];
#pragma unroll
        for (int jj = 0; jj < NT; ++jj)
          mma_16816<false>(acc[i][jj], a[0], a[1], a[2], a[3], b[2 * jj], b[2 * jj + 1]);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 wi = ws[8 * i + (threadIdx.x & 31) / 4];
#pragma unroll
      for (int jj = 0; jj < NT; ++jj) {
        const int j = j0 + jj;
        p[2 * j] = fmaf(fmaxf(acc[i][jj][0], 0.0f), wi.x, p[2 * j]);
        p[2 * j] = fmaf(fmaxf(acc[i][jj][2], 0.0f), wi.y, p[2 * j]);
        p[2 * j + 1] = fmaf(fmaxf(acc[i][jj][1], 0.0f), wi.x, p[2 * j + 1]);
        p[2 * j + 1] = fmaf(fmaxf(acc[i][jj][3], 0.0f), wi.y, p[2 * j + 1]);
      }
    }
  }
}

}  // namespace logits
}  // namespace dsa

// Prefill (mode ks / ke, one request) with q in registers, see above. Grid: one wave of persistent CTAs of
// kQregWarps warps; tiles = ceil((row_end - row_start) / 8) row tiles, chunks_per_item: 64-key chunks per work
// item; dynamic shared memory kQregSmemBytes<Stages>. One CTA barrier per chunk shares the ring. (Tried on the
// H200 and slower, 2026-12-04: both halves of a chunk in one branch-free block so that ptxas overlaps one half's
// epilogue with the other's mma, -7%; full / empty mbarriers per slot letting warps drift up to a chunk apart,
// -4%; both, -13%.)
template <int QFp8, int Paged, int Stages, int NT>
__global__ void __launch_bounds__(dsa::logits::kQregWarps * 32, 1)
    mqa_logits_qreg_kernel(DSA_LOGITS_ARGS, int tiles, int chunks_per_item) {
  using namespace dsa;
  using namespace dsa::logits;
  static_assert(Stages >= 2 && (NT == 2 || NT == 4), "Stages, NT");
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float2 s_w[kQregWarps][32];  // each warp's row weights (qreg_load_q)
  const Problem P = DSA_LOGITS_PROBLEM;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const u32 ring = smem_u32(smem);

  const QregWork W{tiles * ((P.num_keys + chunks_per_item * kChunkKeys - 1) / (chunks_per_item * kChunkKeys)), tiles,
                   chunks_per_item};
  QregCursor prod;
  prod.item = static_cast<int>(blockIdx.x) - static_cast<int>(gridDim.x);
  qreg_next_item(P, W, prod, lane);
  QregCursor cons = prod;

  // Issue chunk g of the walk (the producer cursor's chunk) into slot g % Stages and commit a cp.async group
  // (always, so that wait_group counts chunks).
  auto produce = [&](int g) {
    if (prod.item != kQregDone) {
      qreg_issue<Paged>(P, prod.c, ring + (g % Stages) * kChunkBytes, tid);
      qreg_advance(P, W, prod, lane);
    }
    cp_async_commit();
  };

  // ldmatrix row of this lane inside a half-chunk: key 8 * (lane / 16) + lane % 8 (n-tiles j, j + 1), column
  // 2ks + (lane / 8) % 2, swizzled by key & 7 = lane & 7
  const u32 lane_row = (8 * (lane >> 4) + (lane & 7)) * (2 * kHeadDim);
  const u32 swz = ((lane >> 3) & 1) ^ (lane & 7);
  const float kNegInf = __int_as_float(0xff800000);
  const int key_lane = key_of_lane(lane);

#pragma unroll
  for (int s = 0; s < Stages - 1; ++s) produce(s);

  u32 qa[4][8][4];
  float2* const ws = s_w[warp];
  int row = -1, lo = 0, hi = 0, off = 0, cur_item = -1;
  for (int k = 0; cons.item != kQregDone; ++k) {
    const int slot = k % Stages;
    cp_async_wait<Stages - 2>();
    __syncthreads();  // chunk k landed for every thread; slot (k - 1) % Stages is free
    produce(k + Stages - 1);
    if (cons.item != cur_item) {  // a new item (CTA-uniform): this warp's row, its range and q fragments
      cur_item = cons.item;
      row = cons.row0 + warp;
      qreg_row_range(P, row, lo, hi);
      off = (P.compressed && row < P.row_end) ? P.lens0[row] : 0;
      if (lo < hi) {
        __syncwarp();  // the warp's previous item is done with its weights
        qreg_load_q<QFp8>(P, row, lane, qa, ws);
        __syncwarp();
      }
    }
    if (row < P.row_end) {
      const int tok0 = cons.c * kChunkKeys;
      const bool ok = qreg_entry<Paged>(P, cons.c) >= 0;   // the chunk's page is readable
      const u32 base = ring + slot * kChunkBytes + lane_row;
      float sum[2] = {kNegInf, kNegInf};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (lo < tok0 + 32 * half + 32 && hi > tok0 + 32 * half) {  // warp-uniform
          float p[8];
          qreg_partials<NT>(qa, ws, base + 32 * half * (2 * kHeadDim), swz, p);
          sum[half] = gid_reduce(p, lane);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int n = tok0 + 32 * half + key_lane, col = n - off;
        if (n < P.num_keys && col >= 0 && col < P.width)
          P.out[static_cast<i64>(row - P.row_start) * P.out_stride + col] =
              (ok && n >= lo && n < hi) ? sum[half] : kNegInf;
      }
    }
    qreg_advance(P, W, cons, lane);
  }
  cp_async_wait<0>();
}

namespace dsa {
// plan[0] = 0, plan[b + 1] = plan[b] + count(b): one CTA of 1024 threads, a block-wide inclusive scan per 1024
// requests (the plans of decode and varlen prefill).
template <class Count>
__device__ __forceinline__ void block_scan_plan(int batch, Count count, long long* __restrict__ plan) {
  __shared__ long long s_warp[32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) plan[0] = 0;
  long long carry = 0;
  for (int base = 0; base < batch; base += 1024) {
    const int b = base + tid;
    long long x = b < batch ? count(b) : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const long long y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) s_warp[warp] = x;
    __syncthreads();
    if (warp == 0) {
      long long y = s_warp[lane];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const long long z = __shfl_up_sync(0xffffffffu, y, o);
        if (lane >= o) y += z;
      }
      s_warp[lane] = y;
    }
    __syncthreads();
    if (b < batch) plan[b + 1] = carry + (warp > 0 ? s_warp[warp - 1] : 0) + x;
    carry += s_warp[31];
    __syncthreads();
  }
}
}  // namespace dsa

// The plan of a decode batch (common.cuh): plan[b + 1] = plan[b] + decode_pages(b); lens as for the decode kernels.
__global__ void __launch_bounds__(1024) paged_mqa_logits_plan_kernel(const int* __restrict__ lens, int lens_2d,
                                                                     int batch, int next_n,
                                                                     long long* __restrict__ plan) {
  dsa::block_scan_plan(batch, [&](int b) -> long long { return dsa::decode_pages(lens, lens_2d, next_n, b); }, plan);
}

// The plan of a varlen prefill launch (common.cuh): plan[b + 1] = plan[b] + the 4-row tiles of request b's rows
// within [row_start, row_end).
__global__ void __launch_bounds__(1024) mqa_logits_plan_kernel(const int* __restrict__ cu_rows, int batch,
                                                               int row_start, int row_end,
                                                               long long* __restrict__ plan) {
  dsa::block_scan_plan(batch, [&](int b) -> long long { return dsa::varlen_tiles(cu_rows, b, row_start, row_end); },
                       plan);
}
#undef DSA_LOGITS_PROBLEM
#undef DSA_LOGITS_ARGS
