// Two-level index keys (cupy_dsa.rescore): stage 2 of the fp8-rescore top-k and its small helpers.
//
// Stage 1 (cupy_dsa's fp8 logits, or the caller's) gives each query row its logits; rescore_candidates (one CTA
// per row, radix_select.cuh) or, for few long rows, rescore_histogram, rescore_gather and rescore_boundary (column
// chunks) select the row's K' best (logit descending, ties: lower position) as int32 positions, -1 padded; the
// caller may hand in its own (SGLang's top-k at k = K', arrival order).
// rescore_topk_kernel scores every candidate from its fp8 "hi" and int8 "lo" pages with one f16 key,
//   score = sum_h fmax(256 hi_scale * (q_h . c), 0) * w_h,
//   c = f16_rn(e4m3(hi) * 2^-8 + lo * ratio8),  ratio8 = (lo_scale / hi_scale) * 2^-8   (fp32 steps),
// k_hat = e4m3(hi) * hi_scale + lo * lo_scale rounded to 11 significant bits: one mma per candidate and k-step on
// f16 tensor cores (q exact in f16, see "Stage 2 multiplies" below; every product exact) with fp32 accumulation,
// then an fp32 epilogue. It writes one int64 key per candidate (the score, ties: lower position), and
// rescore_finish radix-selects the row's index_topk greatest into SGLang's outputs in position order.
// rescore_candidates writes a row's candidates in position order, the column chunks in arrival order (the
// selection is then sorted by position): every rerun selects the same keys in the same order.
//
// Stage-2 work split: one CTA per (query row, chunk of candidates), one wave of them; 4 or 8 warps, each scoring
// 16-candidate tiles (two mma n-tiles of 8) fed by its cp.async ring. q is staged once per CTA in shared memory
// as ready A quads (heads = M, 4 m-tiles of 16 heads), in the element order of fp8 key rows that cupy_dsa's
// logits kernel uses for fp8 keys (kernels/mqa_logits.cu): thread (gid = lane / 4, t = lane % 4) loads, for
// candidate 8j + gid of its tile,
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
#include "radix_select.cuh"

namespace dsa {
namespace rescore {

constexpr int kNumHeads = 64;
constexpr int kTileCands = 16;                       // candidates per warp tile (two mma n-tiles)
constexpr int kQWords = 4 * 8 * 32;                   // A quads per row: [m-tile][k-step][lane]
constexpr int kMaxTopK = 2048;                        // rescore_finish holds a row's selection in shared memory
using namespace dsa::radix;                           // rows, order keys, the block-wide radix select
constexpr long long kInvalidKey = static_cast<long long>(0x8000000000000000ull);  // below every valid key

// Stage 2 multiplies on f16 tensor cores: the combined key c (its f16 rounding is the contract:
// cupy_dsa.rescore.combined_key_reference), and q times 2^qs (a power of two that puts max |q| in [2^13, 2^14)). A bf16 or e4m3 q element
// is exact in f16 there unless it is below max |q| * 2^-30 (an f16 subnormal keeps fewer bits; its error, at most
// max |q| * 2^-39, is far below the fp32 sum's rounding). The epilogue takes the powers of two back through the
// scale: hi_scale * 2^(8 - qs).

// Four int8 codes x = [c0 c1 c2 c3] (c0 lowest) -> even = f16x2 (c0, c2), odd = (c1, c3) (exact): offset binary
// c + 128 in the low mantissa bits of 1024.0 (0x6400), then 1152 taken off.
__device__ __forceinline__ void int8x4_to_f16x2(u32 x, u32& even, u32& odd) {
  const u32 biased = x ^ 0x80808080u;
  const __half2 offset = __floats2half2_rn(1152.0f, 1152.0f);
  u32 e = __byte_perm(biased, 0x64646464u, 0x4240), o = __byte_perm(biased, 0x64646464u, 0x4341);
  const __half2 he = __hsub2(*reinterpret_cast<const __half2*>(&e), offset);
  const __half2 ho = __hsub2(*reinterpret_cast<const __half2*>(&o), offset);
  even = *reinterpret_cast<const u32*>(&he);
  odd = *reinterpret_cast<const u32*>(&ho);
}

// 8 consecutive q elements of one head (bytes of `q` at element offset `elem`) as floats.
template <int QFp8>
__device__ __forceinline__ void q_floats(const unsigned char* __restrict__ q, i64 elem, float (&v)[8]) {
  if (QFp8) {
    const uint2 x = *reinterpret_cast<const uint2*>(q + elem);
    const unsigned char* b = reinterpret_cast<const unsigned char*>(&x);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = e4m3_to_float(b[i]);
  } else {
    const uint4 x = *reinterpret_cast<const uint4*>(q + 2 * elem);
    const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  }
}

// Those 8 elements times `scale` as the mma words of the fp8 key order: f16x2 (0,2) (1,3) (4,6) (5,7).
__device__ __forceinline__ uint4 q_words(const float (&v)[8], float scale) {
  auto pack = [&](int lo, int hi) {
    const __half2 h = __floats2half2_rn(v[lo] * scale, v[hi] * scale);
    return *reinterpret_cast<const u32*>(&h);
  };
  return make_uint4(pack(0, 2), pack(1, 3), pack(4, 6), pack(5, 7));
}

// One f16x2 B word of the combined key from four hi codes x and four lo codes y: `even` the elements (0, 2),
// `odd` (1, 3), each f16_rn(e4m3(hi) * 2^-8 + float(lo) * ratio8) with ratio8 = (lo_scale / hi_scale) * 2^-8: a
// product and a sum in fp32, then one conversion (cupy_dsa.rescore.combined_key_reference rounds the same way).
__device__ __forceinline__ void combined_x4(u32 x, u32 y, float ratio8, u32& even, u32& odd) {
  u32 he, ho, le, lo;
  e4m3x4_to_f16x2_scaled(x, he, ho);
  int8x4_to_f16x2(y, le, lo);
  auto word = [&](u32 h, u32 l) {
    const float2 fh = __half22float2(*reinterpret_cast<const __half2*>(&h));
    const float2 fl = __half22float2(*reinterpret_cast<const __half2*>(&l));
    const __half2 c = __floats2half2_rn(__fadd_rn(fh.x, __fmul_rn(fl.x, ratio8)), __fadd_rn(fh.y, __fmul_rn(fl.y, ratio8)));
    return *reinterpret_cast<const u32*>(&c);
  };
  even = word(he, le);
  odd = word(ho, lo);
}

// B words of a tile from the raw hi and lo chunks: W[j][s][w] (candidate 8j + gid, pair s, word w).
__device__ __forceinline__ void combined_words(const uint4 (&hraw)[2][2], const uint4 (&lraw)[2][2],
                                               const float (&ratio8)[2], u32 (&W)[2][4][4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const u32 x[4] = {hraw[j][g].x, hraw[j][g].y, hraw[j][g].z, hraw[j][g].w};
      const u32 y[4] = {lraw[j][g].x, lraw[j][g].y, lraw[j][g].z, lraw[j][g].w};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        u32* w = W[j][2 * g + half];
        combined_x4(x[2 * half], y[2 * half], ratio8[j], w[0], w[1]);
        combined_x4(x[2 * half + 1], y[2 * half + 1], ratio8[j], w[2], w[3]);
      }
    }
}

// 2^e as a float, e in [-126, 127].
__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }

}  // namespace rescore
}  // namespace dsa

// ---- stage-1 candidates: the K' greatest visible keys of each row --------------------------------------
// A row's stage-1 keys are order_key(logits[r, c], 0xFFFFFFFF - c) over its visible columns c in [lo, hi)
// (only those are read: a caller's logits may hold anything elsewhere); they are distinct, so its top-K' set is
// unique (logit descending, ties to the lower position), and written in no particular order (stage 2 and the
// selection do not depend on it). Three launches, for rows that see more than index_topk keys (the others are
// selected without scores): rescore_histogram counts the keys' top 12 bits (grid (rows, column chunks)),
// rescore_gather writes the keys of the bins above the K'-th key's bin b and collects the keys of bin b
// (same grid), rescore_boundary (one CTA per row) radix-selects what is still needed among bin b's keys.
// `work` (int32 [rows, kRadixBins + 2], zeroed): the histogram, then the above and bin-b counts.
constexpr int kWorkInts = dsa::rescore::kRadixBins + 2;

#define DSA_SELECT_ROW                                                                              \
  const int r = blockIdx.x;                                                                         \
  const dsa::rescore::RowKeys rk = dsa::rescore::row_keys(DSA_ROW_SPEC, r);                          \
  if (rk.hi - rk.lo <= index_topk) return; /* CTA-uniform: selected without scores */               \
  const float* __restrict__ row = logits + static_cast<long long>(r) * logits_stride;                \
  int* __restrict__ hist = work + static_cast<long long>(r) * kWorkInts;                            \
  const int c_begin = rk.lo + blockIdx.y * cols_per_cta, c_end = min(rk.hi, c_begin + cols_per_cta); \
  if (c_begin >= c_end) return;

// Grid (rows, ceil(width / cols_per_cta)), kSelectThreads threads.
__global__ void __launch_bounds__(dsa::rescore::kSelectThreads) rescore_histogram(
    const float* __restrict__ logits, long long logits_stride, DSA_ROW_SPEC_ARGS, int cols_per_cta,
    int index_topk, int* __restrict__ work) {
  using namespace dsa;
  using namespace dsa::rescore;
  __shared__ int counts[kRadixBins];
  for (int i = threadIdx.x; i < kRadixBins; i += kSelectThreads) counts[i] = 0;
  __syncthreads();
  DSA_SELECT_ROW
  for (int c = c_begin + threadIdx.x; c < c_end; c += kSelectThreads)
    atomicAdd(&counts[unsigned_key(order_key(row[c], 0u)) >> (64 - kDigitBits)], 1);
  __syncthreads();
  for (int i = threadIdx.x; i < kRadixBins; i += kSelectThreads)
    if (counts[i] != 0) atomicAdd(&hist[i], counts[i]);
}

namespace dsa {
namespace rescore {

// Slots for this thread's a and b items in two row-wide lists whose lengths count_a / count_b hold: one atomic
// per CTA and list (not one per warp: a row's CTAs would queue on its two counters), then an exclusive prefix
// over the threads. `s`: 2 * kSelectWarps + 2 shared ints.
__device__ __forceinline__ void reserve_slots(int a, int b, int* count_a, int* count_b, int& at_a, int& at_b,
                                              int* s) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int ia = a, ib = b;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int va = __shfl_up_sync(0xffffffffu, ia, d), vb = __shfl_up_sync(0xffffffffu, ib, d);
    if (lane >= d) {
      ia += va;
      ib += vb;
    }
  }
  if (lane == 31) {
    s[warp] = ia;
    s[kSelectWarps + warp] = ib;
  }
  __syncthreads();
  if (tid == 0) {
    int ta = 0, tb = 0;
    for (int w = 0; w < kSelectWarps; ++w) {
      const int x = s[w], y = s[kSelectWarps + w];
      s[w] = ta;
      s[kSelectWarps + w] = tb;
      ta += x;
      tb += y;
    }
    s[2 * kSelectWarps] = ta ? atomicAdd(count_a, ta) : 0;
    s[2 * kSelectWarps + 1] = tb ? atomicAdd(count_b, tb) : 0;
  }
  __syncthreads();
  at_a = s[2 * kSelectWarps] + s[warp] + ia - a;
  at_b = s[2 * kSelectWarps + 1] + s[kSelectWarps + warp] + ib - b;
}

}  // namespace rescore
}  // namespace dsa

// Keys of the bins above b -> candidates[r, 0 ..) and keys of bin b -> boundary[r, 0 .. cap) (counted past
// cap): a counting pass over the CTA's columns, one reservation per CTA and list, a writing pass (the columns
// again, from L1 / L2). A row that sees at most k_prime keys writes them all as "above". Grid and block as
// rescore_histogram.
__global__ void __launch_bounds__(dsa::rescore::kSelectThreads) rescore_gather(
    const float* __restrict__ logits, long long logits_stride, DSA_ROW_SPEC_ARGS, int cols_per_cta,
    int index_topk, int* __restrict__ work, int k_prime, int* __restrict__ candidates,
    long long* __restrict__ boundary, int cap) {
  using namespace dsa;
  using namespace dsa::rescore;
  __shared__ int scratch[2 * kSelectWarps + 2];
  DSA_SELECT_ROW
  // the bin of the k_prime-th key (every CTA of the row finds the same one); -1: every key is taken
  const int b = rk.hi - rk.lo > k_prime ? find_bin(hist, k_prime, scratch).bin : -1;
  auto digit_of = [&](int c) { return static_cast<int>(unsigned_key(order_key(row[c], 0u)) >> (64 - kDigitBits)); };
  int n_take = 0, n_tie = 0;
  for (int c = c_begin + threadIdx.x; c < c_end; c += kSelectThreads) {
    const int digit = digit_of(c);
    n_take += digit > b;
    n_tie += digit == b;
  }
  int take_at, tie_at;
  reserve_slots(n_take, n_tie, hist + kRadixBins, hist + kRadixBins + 1, take_at, tie_at, scratch);
  int* __restrict__ cand = candidates + static_cast<long long>(r) * k_prime;
  long long* __restrict__ bnd = boundary + static_cast<long long>(r) * cap;
  for (int c = c_begin + threadIdx.x; c < c_end; c += kSelectThreads) {
    const long long key = order_key(row[c], 0xFFFFFFFFu - static_cast<unsigned>(c));
    const int digit = static_cast<int>(unsigned_key(key) >> (64 - kDigitBits));
    if (digit > b) {
      cand[take_at++] = c;
    } else if (digit == b) {
      if (tie_at < cap) bnd[tie_at] = key;
      ++tie_at;
    }
  }
}

namespace dsa {
namespace rescore {

// A list of signed keys as a radix-select source: bin b's stage-1 keys as collected (none is kInvalidKey: no
// logit's order bits are the lowest int32), or a row's stage-2 keys (kInvalidKey, an unscored candidate, skipped).
struct SignedKeys {
  const long long* keys;
  int n;
  __device__ int size() const { return n; }
  __device__ bool get(int i, u64& key) const {
    const long long k = keys[i];
    key = unsigned_key(k);
    return k != kInvalidKey;
  }
};

// Bin b's keys read from the row itself (more than cap of them: ties in a flat stretch of logits).
struct RowBinKeys {
  const float* row;
  int lo, n, bin;
  __device__ int size() const { return n; }
  __device__ bool get(int i, u64& key) const {
    key = unsigned_key(order_key(row[lo + i], 0xFFFFFFFFu - static_cast<u32>(lo + i)));
    return static_cast<int>(key >> (64 - kDigitBits)) == bin;
  }
};

// A signed key with its halves swapped, as a signed key: ordering these descending orders the keys by ascending
// position (the tie half 0xFFFFFFFF - position first). Its own inverse; no key maps to kInvalidKey.
__device__ __forceinline__ long long position_first(long long key) {
  const u64 u = static_cast<u64>(key) ^ (1ull << 63);
  return static_cast<long long>(((u << 32) | (u >> 32)) ^ (1ull << 63));
}

// Writes the positions of the `need` keys of src that are >= t to out[0 ..) (slots in arrival order).
template <class Source>
__device__ void write_at_least(const Source& src, u64 t, int* __restrict__ out, int* slot) {
  const int n = src.size();
  for (int i = threadIdx.x; i < n; i += kSelectThreads) {
    u64 key;
    if (src.get(i, key) && key >= t) out[atomicAdd(slot, 1)] = static_cast<int>(tie_index(signed_key(key)));
  }
}

}  // namespace rescore
}  // namespace dsa

// The rest of row r's candidates: the (k_prime - above) greatest keys of bin b, from the collected ones or,
// past cap, from the row; slots a row does not fill (it sees fewer than k_prime keys) get -1.
// Grid (rows), kSelectThreads threads.
__global__ void __launch_bounds__(dsa::rescore::kSelectThreads) rescore_boundary(
    const float* __restrict__ logits, long long logits_stride, DSA_ROW_SPEC_ARGS, int index_topk,
    const int* __restrict__ work, int k_prime, int* __restrict__ candidates,
    const long long* __restrict__ boundary, int cap) {
  using namespace dsa;
  using namespace dsa::rescore;
  __shared__ int counts[kRadixBins];
  __shared__ int scratch[kSelectWarps + 3];
  __shared__ int slot;
  const int r = blockIdx.x;
  const RowKeys rk = row_keys(DSA_ROW_SPEC, r);
  const int n = rk.hi - rk.lo;
  if (n <= index_topk) return;  // CTA-uniform
  const int* hist = work + static_cast<long long>(r) * kWorkInts;
  int* __restrict__ cand = candidates + static_cast<long long>(r) * k_prime;
  if (n <= k_prime) {
    for (int i = n + threadIdx.x; i < k_prime; i += kSelectThreads) cand[i] = -1;
    return;
  }
  const BinFound f = find_bin(hist, k_prime, scratch);
  const int need = k_prime - f.above, in_bin = hist[kRadixBins + 1];
  if (threadIdx.x == 0) slot = 0;
  const int known = kDigitBits;
  const u64 prefix = static_cast<u64>(f.bin) << (64 - kDigitBits);
  int* out = cand + f.above;
  if (in_bin <= cap) {
    const SignedKeys src{boundary + static_cast<long long>(r) * cap, in_bin};
    const u64 t = need == in_bin ? prefix : radix_threshold(src, known, prefix, need, counts, scratch);
    __syncthreads();
    write_at_least(src, t, out, &slot);
  } else {
    const RowBinKeys src{logits + static_cast<long long>(r) * logits_stride, rk.lo, n, f.bin};
    const u64 t = radix_threshold(src, known, prefix, need, counts, scratch);
    __syncthreads();
    write_at_least(src, t, out, &slot);
  }
}

#undef DSA_SELECT_ROW

// The same K' candidates with one CTA per row (select_row; the heuristic in cupy_dsa.rescore picks it where the
// rows fill the GPU or fit in shared memory), or a cluster of Cluster CTAs per row on sm_90+ (each reads a slice:
// cupy_dsa.topk.select_cluster picks it where the rows alone would leave SMs idle): one read of the row instead of
// two plus a work buffer, written in position order. A row that sees at most k_prime keys writes them all, then
// kInvalidKey. Grid (rows * Cluster), kSelectThreads threads; dynamic shared memory: CacheEntries u32 and, with
// clusters, kListCap u64 (a row or slice that does not fit is read again from L2 by each radix pass).
template <int CacheEntries, int Cluster>
__global__ void DSA_SELECT_LAUNCH_BOUNDS(Cluster) DSA_CLUSTER_DIMS(Cluster) rescore_candidates(
    const float* __restrict__ logits, long long logits_stride, DSA_ROW_SPEC_ARGS, int index_topk, int k_prime,
    int* __restrict__ candidates) {
  using namespace dsa;
  using namespace dsa::rescore;
  extern __shared__ u32 row_cache[];
  __shared__ RowSelectShared shared;
  const int r = blockIdx.x / Cluster;
  const RowKeys rk = row_keys(DSA_ROW_SPEC, r);
  const int n = rk.hi - rk.lo;
  if (n <= index_topk) return;  // uniform over the cluster: selected without scores
  const float* __restrict__ row = logits + static_cast<i64>(r) * logits_stride + rk.lo;
  int* __restrict__ cand = candidates + static_cast<i64>(r) * k_prime;
  if (n <= k_prime) {
    for (int i = (blockIdx.x % Cluster) * kSelectThreads + threadIdx.x; i < k_prime; i += Cluster * kSelectThreads)
      cand[i] = i < n ? rk.lo + i : -1;
    return;
  }
  const int slice = select_slice<Cluster>(n);
  select_row<Cluster>(row, rk.lo, n, k_prime, CacheEntries >= kSelectCache(slice) ? row_cache : nullptr,
                      select_merged(row_cache, CacheEntries), shared,
                      [&](int slot, int position, u64) { cand[slot] = position; });
}

namespace dsa {
namespace rescore {

// Stage 2's ring: one warp's tile in flight, as each lane's own chunks. Lane (gid, t) copies, for candidates
// 8j + gid, the 16-byte chunks 16t + 64g of the hi and lo rows, the two scales and the tile's cache slots, and
// later reads back exactly what it copied: no barrier, only the lane's own cp.async.wait_group.
struct RingStage {
  uint4 rows[8][32];   // [4 * kind + 2 * j + g][lane], kind 0 = hi, 1 = lo
  float scales[4][32]; // [2 * kind + j][lane]
  u32 slots[2][32];    // [j][lane]: block-table entry * 64 + slot, or kNoSlot
};
constexpr u32 kNoSlot = 0xFFFFFFFFu;
// Candidates of one stage-2 CTA (their cache slots are kept in shared memory): 16 per thread, 2,048 for 4 warps;
// 1,024 for 8 (8 KiB of slots would not fit beside the 8-warp ring in a 100 KB arch's 99 KiB).
template <int Warps>
constexpr int kMaxChunk = Warps == 4 ? 2048 : 1024;

}  // namespace rescore
}  // namespace dsa

// Stage 2. q: [rows, 64, 128] fp8 e4m3 (QFp8) or bf16; weights: fp32 [rows, 64]; hi_cache / lo_cache: fp8-geometry
// page rows (8448 B), num_pages each; block_table: int32, row b at block_table + b * bt_stride, bt_width entries;
// candidates: int64 [rows, k_prime], row r's candidates (any order), each naming its position
// (tie_index); keys (out): int64 [rows, k_prime], order_key(score, 0xFFFFFFFF - its position), or
// kInvalidKey where the row does not see the position, its page is not in the caches, or the row sees at most
// index_topk keys (selected without scores). Grid (rows, ceil(k_prime / cands_per_cta)), 32 * Warps threads;
// cands_per_cta a multiple of 16 * Warps, at most kMaxChunk<Warps>; dynamic shared memory Warps * Stages RingStages.
// Warps: 4 where three CTAs fit an SM (sm_80 / sm_90 / sm_100), 8 on the 100 KB archs, where one CTA holds the
// SM and its 8 warps share one staged q (issue 22's rule: at least 8 warps resident per SM).
// The CTA first finds its chunk's cache slots (kMaxChunk<Warps> at most), then each warp walks its tiles (16
// candidates, every Warps-th tile of the chunk) through a Stages-deep cp.async ring: the rows of tile
// i + Stages - 1 are in flight while tile i is scored. The first tiles are issued before q is staged, so their
// loads overlap q's.
template <int QFp8, int Stages, int Warps>
__global__ void __launch_bounds__(32 * Warps, Warps == 4 ? (Stages <= 2 ? 3 : 2) : 1)
    rescore_topk_kernel(
    const unsigned char* __restrict__ q, const float* __restrict__ weights, const unsigned char* __restrict__ hi_cache,
    const unsigned char* __restrict__ lo_cache, long long num_pages, const int* __restrict__ block_table,
    long long bt_stride, int bt_width, DSA_ROW_SPEC_ARGS, const int* __restrict__ candidates, int k_prime,
    int cands_per_cta, int index_topk, long long* __restrict__ keys) {
  using namespace dsa;
  using namespace dsa::rescore;
  static_assert(Stages >= 2, "stage 2: at least one tile in flight while one is scored");
  const int r = blockIdx.x;
  const int c_begin = blockIdx.y * cands_per_cta;
  const int c_end = min(k_prime, c_begin + cands_per_cta);
  if (c_begin >= c_end) return;  // CTA-uniform
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // the row's q, read first (nothing it depends on), then scaled into f16 (see q_words) once the block's max |q|
  // is known
  constexpr int kThreads = 32 * Warps;
  static_assert((kQWords / 2) % kThreads == 0 && kMaxChunk<Warps> % kThreads == 0, "stage 2: whole items per thread");
  constexpr int kQItems = kQWords / 2 / kThreads;  // items (both k-steps of a pair) per thread
  float qv[kQItems][2][8];
  float qmax = 0.0f;
#pragma unroll
  for (int u = 0; u < kQItems; ++u) {
    const int i = u * kThreads + tid;
    const int m = i >> 7, s = (i >> 5) & 3, ln = i & 31;
    const int head = 16 * m + (ln >> 2), tq = ln & 3;
    const i64 elem = (static_cast<i64>(r) * kNumHeads + head) * kHeadDim + 64 * (s >> 1) + 16 * tq + 8 * (s & 1);
    q_floats<QFp8>(q, elem, qv[u][0]);
    q_floats<QFp8>(q, elem + 8 * kHeadDim, qv[u][1]);
  }
  const RowKeys rk = row_keys(DSA_ROW_SPEC, r);
  long long* __restrict__ out = keys + static_cast<i64>(r) * k_prime;
  if (rk.hi - rk.lo <= index_topk) {  // CTA-uniform: a row selected without scores
    for (int c = c_begin + tid; c < c_end; c += blockDim.x) out[c] = kInvalidKey;
    return;
  }
  extern __shared__ __align__(16) unsigned char stage2_ring[];
  RingStage* ring = reinterpret_cast<RingStage*>(stage2_ring) + warp * Stages;
  __shared__ uint4 qs[kQWords];                      // A quads [m-tile][k-step][lane]
  __shared__ float2 ws[kNumHeads / 2];               // [m-tile][gid]: (w[16i + gid], w[16i + gid + 8])
  __shared__ u32 chunk_slots[kMaxChunk<Warps>];
  __shared__ float qmax_warp[Warps];

  const int* __restrict__ bt = block_table + static_cast<i64>(rk.table_row) * bt_stride;
  const int* __restrict__ cand = candidates + static_cast<i64>(r) * k_prime;
  const int gid = lane >> 2, t = lane & 3;
  const int b4 = (lane >> 4) & 1, b3 = (lane >> 3) & 1;
  // The cache slot (block-table entry * 64 + slot) of every candidate of the CTA's chunk, found up front: all of
  // a thread's candidate loads in flight at once, then all of their block-table loads (two latencies per CTA,
  // not two per tile); kNoSlot where the row does not see the position or its page is not in the caches.
  constexpr int kLocateBatch = kMaxChunk<Warps> / kThreads;
  for (int c0 = c_begin; c0 < c_end; c0 += kLocateBatch * kThreads) {
    u32 pos[kLocateBatch];
#pragma unroll
    for (int u = 0; u < kLocateBatch; ++u) {
      const int c = c0 + u * kThreads + tid;
      pos[u] = c < c_end ? static_cast<u32>(cand[c]) : 0xFFFFFFFFu;  // -1 (none) fails the range test
    }
#pragma unroll
    for (int u = 0; u < kLocateBatch; ++u) {
      const int c = c0 + u * kThreads + tid;
      u32 loc = kNoSlot;
      if (pos[u] >= static_cast<u32>(rk.lo) && pos[u] < static_cast<u32>(rk.hi) &&
          static_cast<int>(pos[u] >> kPageBits) < bt_width) {
        const int e = bt[pos[u] >> kPageBits];
        if (e >= 0 && static_cast<i64>(e) < num_pages && e < (1 << (32 - kPageBits)) - 1)
          loc = (static_cast<u32>(e) << kPageBits) | (pos[u] & (kPageSlots - 1));
      }
      if (c < c_end) chunk_slots[c - c_begin] = loc;
    }
  }
  // the warps' max |q| (their q loads have been in flight since the start)
#pragma unroll
  for (int u = 0; u < kQItems; ++u)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 8; ++e) qmax = fmaxf(qmax, fabsf(qv[u][h][e]));
  qmax = warp_max(qmax);
  if (lane == 0) qmax_warp[warp] = qmax;
  __syncthreads();  // the chunk's slots and the warps' max |q|
  auto locate = [&](int tile0, u32 (&loc)[2]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = tile0 + 8 * j + gid;
      loc[j] = c < c_end ? chunk_slots[c - c_begin] : kNoSlot;
    }
  };
  // copy this lane's share of a located tile into a ring stage and commit it as one group (an empty group for
  // a tile without slots, so that group i is always tile i); a candidate without a slot gets zeros
  auto issue = [&](const u32 (&loc)[2], RingStage& st) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      st.slots[j][lane] = loc[j];
      if (loc[j] != kNoSlot) {
        const i64 base = static_cast<i64>(loc[j] >> kPageBits) * kFp8PageBytes;
        const int slot = static_cast<int>(loc[j] & (kPageSlots - 1));
        const i64 row_off = base + static_cast<i64>(slot) * kHeadDim + 16 * t;
#pragma unroll
        for (int g = 0; g < 2; ++g) {
          cp_async16(smem_u32(&st.rows[2 * j + g][lane]), hi_cache + row_off + 64 * g, 16);
          cp_async16(smem_u32(&st.rows[4 + 2 * j + g][lane]), lo_cache + row_off + 64 * g, 16);
        }
        cp_async4(smem_u32(&st.scales[j][lane]), hi_cache + base + kFp8ScaleOffset + 4 * slot);
        cp_async4(smem_u32(&st.scales[2 + j][lane]), lo_cache + base + kFp8ScaleOffset + 4 * slot);
      } else {
#pragma unroll
        for (int g = 0; g < 2; ++g)
          st.rows[2 * j + g][lane] = st.rows[4 + 2 * j + g][lane] = make_uint4(0u, 0u, 0u, 0u);
        st.scales[j][lane] = st.scales[2 + j][lane] = 0.0f;
      }
    }
    cp_async_commit();
  };
  const int first = c_begin + warp * kTileCands, step = Warps * kTileCands;
#pragma unroll
  for (int s = 0; s < Stages - 1; ++s) {
    u32 loc[2];
    locate(first + s * step, loc);
    issue(loc, ring[s]);
  }
  qmax = qmax_warp[0];
#pragma unroll
  for (int w = 1; w < Warps; ++w) qmax = fmaxf(qmax, qmax_warp[w]);
  int qmax_exp = 0;
  frexpf(qmax, &qmax_exp);                        // qmax in [2^(e-1), 2^e)
  const int qs_exp = qmax > 0.0f && qmax <= 3.0e38f ? min(max(14 - qmax_exp, -100), 100) : 0;
  const float q_scale = pow2(qs_exp);
#pragma unroll
  for (int u = 0; u < kQItems; ++u) {
    const int i = u * kThreads + tid;
    const int m = i >> 7, s = (i >> 5) & 3, ln = i & 31;
    const uint4 v0 = q_words(qv[u][0], q_scale), v1 = q_words(qv[u][1], q_scale);
    uint4* dst = qs + (m * 8 + 2 * s) * 32 + ln;
    dst[0] = make_uint4(v0.x, v1.x, v0.y, v1.y);   // k-step 2s
    dst[32] = make_uint4(v0.z, v1.z, v0.w, v1.w);  // k-step 2s + 1
  }

  const float unscale = pow2(8 - qs_exp);
  if (tid < kNumHeads / 2) {
    const float* wr = weights + static_cast<i64>(r) * kNumHeads;
    ws[tid] = make_float2(wr[16 * (tid >> 3) + (tid & 7)], wr[16 * (tid >> 3) + (tid & 7) + 8]);
  }
  __syncthreads();

  int stage = 0;
  for (int tile0 = first; tile0 < c_end; tile0 += step) {
    // the candidate this lane holds after the reduction, and its position for the tie-break: loaded first, so the
    // load's latency hides behind the tile's mma instead of stalling the write at its end (ncu, 2048 rows over
    // L2-resident keys: the wait on this load was 9% of stage 2's warp samples)
    const int c_out = tile0 + 8 * b4 + 2 * t + b3;
    const bool writer = (lane & 4) == 0 && c_out < c_end;
    const u32 tie_out = writer ? 0xFFFFFFFFu - static_cast<u32>(cand[c_out]) : 0u;
    {  // tile + Stages - 1 into the stage the previous tile freed
      u32 loc[2];
      locate(tile0 + (Stages - 1) * step, loc);
      issue(loc, ring[stage == 0 ? Stages - 1 : stage - 1]);
    }
    cp_async_wait<Stages - 1>();  // this tile's group has landed
    const RingStage& st = ring[stage];
    stage = stage + 1 == Stages ? 0 : stage + 1;
    int ok[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) ok[j] = st.slots[j][lane] != kNoSlot;
    if (!__any_sync(0xffffffffu, ok[0] | ok[1])) {  // warp-uniform: nothing to score in this tile
      if (writer) out[c_out] = kInvalidKey;
      continue;
    }
    uint4 hraw[2][2], lraw[2][2];
    float hsc[2], lsc[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int g = 0; g < 2; ++g) {
        hraw[j][g] = st.rows[2 * j + g][lane];
        lraw[j][g] = st.rows[4 + 2 * j + g][lane];
      }
      hsc[j] = st.scales[j][lane];
      lsc[j] = st.scales[2 + j][lane];
    }
    // scales and validity of the epilogue's candidates 8j + 2t + e, held by lane 4 (2t + e)
    float ehs[2][2];
    int eok[2][2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int src = 4 * (2 * t + e);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        ehs[j][e] = __shfl_sync(0xffffffffu, hsc[j], src) * unscale;  // exact: a power of two
        eok[j][e] = __shfl_sync(0xffffffffu, ok[j], src);
      }
    }
    // the combined key in units of 256 hi_scale (a page never stored: both scales 0, the key 0)
    float ratio8[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) ratio8[j] = hsc[j] != 0.0f ? __fmul_rn(__fdiv_rn(lsc[j], hsc[j]), 0.00390625f) : 0.0f;
    u32 W[2][4][4];
    combined_words(hraw, lraw, ratio8, W);

    float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // [2j + e]: candidate 8j + 2t + e over this lane's heads
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float acc[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        const uint4 a = qs[(i * 8 + ks) * 32 + lane];
        const int s = ks >> 1, w0 = 2 * (ks & 1);
#pragma unroll
        for (int j = 0; j < 2; ++j) mma_16816<true>(acc[j], a.x, a.y, a.z, a.w, W[j][s][w0], W[j][s][w0 + 1]);
      }
      const float2 w = ws[i * 8 + gid];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // e: (head 16i + gid, +8 for e >= 2) x (candidate 8j + 2t + e % 2)
          const int col = e & 1;
          const float v = __fmul_rn(ehs[j][col], acc[j][e]);
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
    if (writer) out[c_out] = valid ? order_key(score, tie_out) : kInvalidKey;  // ties: position
  }
}

// SGLang's outputs of the selection: int32 [rows, index_topk] page_indices (block-table entry * 64 + slot),
// raw_indices (positions) and, when fp8_rank is not null, each key's stage-1 rank; -1 padded. A row that sees
// n <= index_topk keys selects lo .. lo + n - 1 in order (its rank counted over its visible logits: greater, or
// equal at a lower position); any other row selects its min(index_topk, scored) greatest stage-2 keys (a radix
// select over keys[r, 0 .. k_prime)), written in position order: where the candidates are in position order
// (`in_position_order`: rescore_candidates writes them so), by a compaction of the selected slots (each warp a
// contiguous stretch, ballots for the offsets); otherwise (the column-chunk candidates, in arrival order) by a
// bitonic sort of the selection on position in shared memory. A key's stage-1 rank is how many of the row's
// candidates have a greater stage-1 key (they hold every key that does). The row's keys are read once, into shared
// memory when k_prime <= CachedKeys (every later pass runs there), their first 12-bit digit counted on the way;
// the keys of the index_topk-th key's bin are collected and radix-selected in shared memory. Grid (rows),
// kSelectThreads threads, dynamic shared memory: CachedKeys int64; index_topk <= kMaxTopK.
template <int CachedKeys>
__global__ void DSA_SELECT_LAUNCH_BOUNDS(1) rescore_finish(
    const long long* __restrict__ keys, int k_prime, const int* __restrict__ candidates,
    const float* __restrict__ logits, long long logits_stride, const int* __restrict__ block_table,
    long long bt_stride, DSA_ROW_SPEC_ARGS, int index_topk, int* __restrict__ page_indices,
    int* __restrict__ raw_indices, int* __restrict__ fp8_rank, int in_position_order) {
  using namespace dsa;
  using namespace dsa::rescore;
  extern __shared__ long long cached_keys[];
  __shared__ int counts[kRadixBins];
  __shared__ int scratch[kSelectWarps + 3];
  __shared__ long long chosen[kMaxTopK];
  __shared__ int n_chosen, n_scored;
  const int r = blockIdx.x, tid = threadIdx.x;
  const RowKeys rk = row_keys(DSA_ROW_SPEC, r);
  const int n = rk.hi - rk.lo;
  const int* __restrict__ bt = block_table + static_cast<i64>(rk.table_row) * bt_stride;
  const float* __restrict__ row = logits + static_cast<i64>(r) * logits_stride;
  const i64 o = static_cast<i64>(r) * index_topk;
  auto write = [&](int i, int raw, int rank) {
    // entry * 64 + slot in 32 bits, wrapping as the reference's int64 -> int32 conversion does
    page_indices[o + i] = raw < 0 ? -1
                                  : static_cast<int>(static_cast<u32>(bt[raw >> kPageBits]) * kPageSlots +
                                                     static_cast<u32>(raw & (kPageSlots - 1)));
    raw_indices[o + i] = raw;
    if (fp8_rank != nullptr) fp8_rank[o + i] = rank;
  };
  if (n <= index_topk) {  // CTA-uniform
    for (int i = tid; i < index_topk; i += kSelectThreads) {
      int raw = -1, rank = -1;
      if (i < n) {
        raw = rk.lo + i;
        if (fp8_rank != nullptr) {
          const float v = row[raw];
          int ahead = 0;
          for (int c = rk.lo; c < rk.hi; ++c) {
            const float x = row[c];
            ahead += (x > v) || (x == v && c < raw);
          }
          rank = ahead;
        }
      }
      write(i, raw, rank);
    }
    return;
  }
  const long long* __restrict__ row_keys_g = keys + static_cast<i64>(r) * k_prime;
  const bool in_smem = k_prime <= CachedKeys;
  for (int i = tid; i < kRadixBins; i += kSelectThreads) counts[i] = 0;
  if (tid == 0) n_chosen = n_scored = 0;
  __syncthreads();
  int scored = 0;
  constexpr int kInFlight = 4;  // loads of a thread issued together
  for (int i0 = tid; i0 < k_prime; i0 += kInFlight * kSelectThreads) {
    long long k[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = i0 + u * kSelectThreads;
      k[u] = i < k_prime ? row_keys_g[i] : kInvalidKey;
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = i0 + u * kSelectThreads;
      if (in_smem && i < k_prime) cached_keys[i] = k[u];
      if (k[u] != kInvalidKey) {
        ++scored;
        atomicAdd(&counts[unsigned_key(k[u]) >> (64 - kDigitBits)], 1);
      }
    }
  }
  atomicAdd(&n_scored, scored);
  __syncthreads();
  const SignedKeys src{in_smem ? cached_keys : row_keys_g, k_prime};
  const int m = min(index_topk, n_scored);
  if (m > 0) {
    u64 t = 0ull;  // m == n_scored: every scored key
    if (m < n_scored) {
      const BinFound f = find_bin(counts, m, scratch);
      const int need = m - f.above;
      const u64 prefix = static_cast<u64>(f.bin) << (64 - kDigitBits);
      t = prefix;  // need == f.count: the whole bin
      if (need != f.count && f.count <= kMaxTopK) {  // the bin's keys, collected in `chosen`, select the rest
        for (int i = tid; i < k_prime; i += kSelectThreads) {
          u64 key;
          if (src.get(i, key) && static_cast<int>(key >> (64 - kDigitBits)) == f.bin)
            chosen[atomicAdd(&n_chosen, 1)] = static_cast<long long>(key);
        }
        __syncthreads();
        t = radix_threshold(ListKeySource{reinterpret_cast<const u64*>(chosen), f.count}, kDigitBits, prefix,
                            need, counts, scratch);
      } else if (need != f.count) {
        t = radix_threshold(src, kDigitBits, prefix, need, counts, scratch);
      }
      __syncthreads();
    }
    if (in_position_order) {
      // the selected slots in slot (= position) order: each warp counts its stretch, then writes from its offset
      const int lane = tid & 31, warp = tid >> 5;
      const int per_warp = ((k_prime + kSelectWarps - 1) / kSelectWarps + 31) & ~31;
      const int begin = warp * per_warp, end = min(k_prime, begin + per_warp);
      auto taken = [&](int i, u64& key) { return i < end && src.get(i, key) && key >= t; };
      int count = 0;
      for (int i = begin + lane; i < end; i += 32) {
        u64 key;
        count += taken(i, key);
      }
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) count += __shfl_xor_sync(0xffffffffu, count, d);
      if (lane == 0) scratch[warp] = count;
      __syncthreads();
      int at = 0;
      for (int w = 0; w < warp; ++w) at += scratch[w];
      for (int base = begin; base < end; base += 32) {  // warp-uniform
        u64 key;
        const bool take = taken(base + lane, key);
        const unsigned ballot = __ballot_sync(0xffffffffu, take);
        if (take) chosen[at + __popc(ballot & ((1u << lane) - 1u))] = signed_key(key);
        at += __popc(ballot);
      }
    } else {
      if (tid == 0) n_chosen = 0;
      __syncthreads();
      for (int i = tid; i < k_prime; i += kSelectThreads) {
        u64 key;
        if (src.get(i, key) && key >= t) chosen[atomicAdd(&n_chosen, 1)] = position_first(signed_key(key));
      }
    }
  }
  if (!in_position_order) {
    // position order: a bitonic sort of the m selected keys with their halves swapped (position_first: descending
    // = ascending position), padded with keys below them all to n2 (a power of two, at least the block). Thread
    // tid holds elements u * kSelectThreads + tid: strides below 32 pair lanes of one warp (shuffles, no barrier),
    // larger strides pair elements through shared memory.
    int n2 = kSelectThreads;
    while (n2 < m) n2 <<= 1;
    constexpr int kMaxPerThread = kMaxTopK / kSelectThreads;
    const int per_thread = n2 / kSelectThreads;
    __syncthreads();
    long long x[kMaxPerThread];
#pragma unroll
    for (int u = 0; u < kMaxPerThread; ++u) {
      const int e = u * kSelectThreads + tid;
      x[u] = u < per_thread && e < m ? chosen[e] : kInvalidKey;
    }
    for (int size = 2; size <= n2; size <<= 1) {
      int stride = size >> 1;
      if (stride >= 32) {
        __syncthreads();  // the previous shared-memory stages' reads are done
#pragma unroll
        for (int u = 0; u < kMaxPerThread; ++u)
          if (u < per_thread) chosen[u * kSelectThreads + tid] = x[u];
        __syncthreads();
        for (; stride >= 32; stride >>= 1) {
          for (int i = tid; i < (n2 >> 1); i += kSelectThreads) {
            const int a = 2 * i - (i & (stride - 1)), b = a + stride;  // a has bit `stride` clear
            const long long p = chosen[a], q = chosen[b];
            if (((a & size) == 0) == (p < q)) {  // descending runs where bit `size` of a is clear
              chosen[a] = q;
              chosen[b] = p;
            }
          }
          __syncthreads();
        }
#pragma unroll
        for (int u = 0; u < kMaxPerThread; ++u)
          if (u < per_thread) x[u] = chosen[u * kSelectThreads + tid];
      }
      for (; stride >= 1; stride >>= 1) {
        const bool lower = (tid & stride) == 0;
#pragma unroll
        for (int u = 0; u < kMaxPerThread; ++u)
          if (u < per_thread) {  // block-uniform
            const long long y = __shfl_xor_sync(0xffffffffu, x[u], stride);
            const bool descending = ((u * kSelectThreads + tid) & size) == 0;
            x[u] = (lower == descending) ? max(x[u], y) : min(x[u], y);  // the pair's lower element: the greater
          }
      }
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kMaxPerThread; ++u)
      if (u < per_thread) chosen[u * kSelectThreads + tid] = position_first(x[u]);  // its own inverse
  }
  __syncthreads();
  const int* __restrict__ cand = candidates + static_cast<i64>(r) * k_prime;
  for (int i = tid; i < index_topk; i += kSelectThreads) {
    if (i >= m) {
      write(i, -1, -1);
      continue;
    }
    const long long key = chosen[i];
    const int slot = i;
    const int raw = static_cast<int>(tie_index(key));
    int rank = -1;
    if (fp8_rank != nullptr) {
      // the candidates with a greater stage-1 key (they hold every visible key that has one)
      const long long key1 = order_key(row[raw], static_cast<u32>(key));
      rank = 0;
      for (int j = 0; j < k_prime; ++j) {
        const int c = cand[j];
        rank += c >= rk.lo && c < rk.hi && order_key(row[c], 0xFFFFFFFFu - static_cast<u32>(c)) > key1;
      }
    }
    write(slot, raw, rank);
  }
}

#undef DSA_ROW_SPEC
#undef DSA_ROW_SPEC_ARGS
