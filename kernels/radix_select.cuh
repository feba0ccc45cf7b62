// Block-wide radix selection over a query row's logits, shared by the top-k (kernels/topk.cu) and the fp8-rescore
// candidates (kernels/rescore_topk.cu).
//
// A row's keys order its visible logits descending with ties to the lower position: the 64-bit unsigned key of
// column c is (logit_key(logits[c]) << 32) | (0xFFFFFFFF - c), where logit_key is the fp32 value's
// order-preserving 32 bits (NaN above +inf, as torch ranks it; -0.0 as +0.0). Keys are distinct, so a row's top-k
// set is unique. select_row finds the k-th greatest key T with 12-bit digits (the first digit counted while the
// row is read, once, into shared memory when it fits; the rest among the keys of T's first-digit bin, collected)
// and hands the keys >= T out in position order: the same keys in the same slots on every run.
#pragma once
#include "common.cuh"

namespace dsa {
namespace radix {

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

// The fp32 value's order-preserving int32: NaN (any sign, any payload) above +inf, as torch ranks it; -0.0
// counts as +0.0.
__device__ __forceinline__ int ordered_bits(float value) {
  const int b = __float_as_int(value);
  if ((b & 0x7FFFFFFF) > 0x7F800000) return 0x7FFFFFFF;
  if (b == static_cast<int>(0x80000000u)) return 0;
  return b >= 0 ? b : b ^ 0x7FFFFFFF;
}

// A key that sorts as signed int64 by (value, tie), both descending: ordered_bits(value) in the high half,
// `tie` (greater = earlier) in the low half.
__device__ __forceinline__ long long order_key(float value, u32 tie) {
  return static_cast<long long>((static_cast<u64>(static_cast<u32>(ordered_bits(value))) << 32) | tie);
}

// The same order as an unsigned one (the radix select's digits) and back.
__device__ __forceinline__ u64 unsigned_key(long long key) { return static_cast<u64>(key) ^ (1ull << 63); }
__device__ __forceinline__ long long signed_key(u64 key) { return static_cast<long long>(key ^ (1ull << 63)); }

// The position i a key's low half holds as 0xFFFFFFFF - i (stage-1 and stage-2 keys alike).
__device__ __forceinline__ u32 tie_index(long long key) {
  return 0xFFFFFFFFu - static_cast<u32>(static_cast<u64>(key));
}

// ---- block-wide radix selection (kSelectThreads threads, kRadixBins bins of shared or global counts) --------
constexpr int kSelectThreads = 512;
// The per-row select kernels' launch bounds (Cluster: CTAs per row): at least 2 CTAs per SM on sm_120 / sm_121, whose
// 1,536 threads per SM make ptxas otherwise aim at three 512-thread CTAs (40 registers) and spill, and for a cluster
// per row (two CTAs per SM is what cupy_dsa.topk.select_cluster counts on; sm_100's ptxas otherwise aims at four and
// spills); elsewhere ptxas's own choice (a minimum of 0 CTAs).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define DSA_SELECT_LAUNCH_BOUNDS(Cluster) __launch_bounds__(dsa::radix::kSelectThreads, 2)
#else
#define DSA_SELECT_LAUNCH_BOUNDS(Cluster) __launch_bounds__(dsa::radix::kSelectThreads, (Cluster) > 1 ? 2 : 0)
#endif
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kDigitBits = 12;
constexpr int kRadixBins = 1 << kDigitBits;
constexpr int kBinsPerThread = kRadixBins / kSelectThreads;
static_assert(kBinsPerThread * kSelectThreads == kRadixBins && kSelectWarps <= 32, "select: whole bins per thread");

struct BinFound {
  int bin;      // the bin holding the need-th greatest key
  int above;    // keys in the bins above it
  int count;    // keys in it
};

// The bin where the keys counted in `hist` (bin = digit, greater digit = greater key) reach `need` >= 1 from
// the top, given that they hold at least `need`. Every thread of the block calls it; `scratch` is shared
// (kSelectWarps + 3 ints); every thread returns the same answer.
__device__ __forceinline__ BinFound find_bin(const int* hist, int need, int* scratch) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int mine[kBinsPerThread];
  int sum = 0;
#pragma unroll
  for (int i = 0; i < kBinsPerThread; ++i) {
    mine[i] = hist[tid * kBinsPerThread + i];
    sum += mine[i];
  }
  // keys in the bins of the threads above this one: a suffix scan (warp, then warps)
  int incl = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_down_sync(0xffffffffu, incl, d);
    if (lane + d < 32) incl += v;
  }
  if (lane == 0) scratch[warp] = incl;
  __syncthreads();
  int warps_above = 0;
  for (int w = warp + 1; w < kSelectWarps; ++w) warps_above += scratch[w];
  int above = warps_above + incl - sum;
  if (above < need && above + sum >= need) {
    int bin = -1, count = 0;
#pragma unroll
    for (int i = kBinsPerThread - 1; i >= 0; --i) {  // static indices: mine[] stays in registers
      if (bin < 0) {
        if (above + mine[i] >= need) {
          bin = i;
          count = mine[i];
        } else {
          above += mine[i];
        }
      }
    }
    scratch[kSelectWarps] = tid * kBinsPerThread + bin;
    scratch[kSelectWarps + 1] = above;
    scratch[kSelectWarps + 2] = count;
  }
  __syncthreads();
  const BinFound f = {scratch[kSelectWarps], scratch[kSelectWarps + 1], scratch[kSelectWarps + 2]};
  __syncthreads();  // scratch is reused by the next call
  return f;
}

// The least key T such that exactly `need` >= 1 of the keys `src` yields (distinct unsigned keys whose top
// `known` bits equal `prefix`'s; src.get(i, key) -> false skips slot i of src.size()) are >= T, given that it
// yields at least `need`. 12-bit digits from the top; a pass stops early when its bin holds exactly the keys
// still needed. `hist`: kRadixBins shared ints; every thread returns the same T.
template <class Source>
__device__ u64 radix_threshold(const Source& src, int known, u64 prefix, int need, int* hist, int* scratch) {
  int lo_bit = 64 - known;
  while (lo_bit > 0) {
    const int width = min(kDigitBits, lo_bit), shift = lo_bit - width;
    for (int i = threadIdx.x; i < kRadixBins; i += kSelectThreads) hist[i] = 0;
    __syncthreads();
    const int n = src.size();
    for (int i = threadIdx.x; i < n; i += kSelectThreads) {
      u64 key;
      if (src.get(i, key) && (lo_bit == 64 || (key >> lo_bit) == (prefix >> lo_bit)))
        atomicAdd(&hist[static_cast<int>((key >> shift) & ((1ull << width) - 1))], 1);
    }
    __syncthreads();
    const BinFound f = find_bin(hist, need, scratch);
    prefix |= static_cast<u64>(f.bin) << shift;
    need -= f.above;
    lo_bit = shift;
    if (f.count == need) break;
  }
  return prefix;
}


// ---- one CTA selects one row ---------------------------------------------------------------------------
__device__ __forceinline__ u32 logit_key(float value) { return static_cast<u32>(ordered_bits(value)) ^ 0x80000000u; }
__device__ __forceinline__ u64 full_key(u32 logit, int pos) {
  return (static_cast<u64>(logit) << 32) | (0xFFFFFFFFu - static_cast<u32>(pos));
}

constexpr int kListCap = 2048;  // keys of the k-th key's first-digit bin that select_row collects in shared memory
constexpr int kRunBins = 64;    // a cluster finds the k-th key's bin in two steps of 64: its run of bins, then the bin

// A row's visible logits [lo, lo + n) as logit keys, addressed by "slot" c = pad + i (i = c - pad the row's element):
// slot 0 of the row (row - pad) is 16-byte aligned, so four slots from a multiple of 4 are one 16-byte load, from
// the CTA's shared copy (cache[c]) when the row was read into it, else from the row (again: L2).
struct RowLogits {
  const float* row;   // the logit of position lo
  const u32* cache;   // null: read the row
  int pad, lo, n;

  // the keys of slots c0 .. c0 + 3 (c0 a multiple of 4) and whether each is one of the row's
  __device__ __forceinline__ void quad(int c0, u32 (&key)[4], bool (&valid)[4]) const {
    const int i0 = c0 - pad;
    if (cache != nullptr) {
      const uint4 v = *reinterpret_cast<const uint4*>(cache + c0);
      key[0] = v.x, key[1] = v.y, key[2] = v.z, key[3] = v.w;
    } else if (i0 >= 0 && i0 + 3 < n) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(row + i0));
      key[0] = logit_key(v.x), key[1] = logit_key(v.y), key[2] = logit_key(v.z), key[3] = logit_key(v.w);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) key[e] = (i0 + e >= 0 && i0 + e < n) ? logit_key(row[i0 + e]) : 0u;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) valid[e] = i0 + e >= 0 && i0 + e < n;
  }
  __device__ __forceinline__ int slots() const { return pad + n; }
  __device__ __forceinline__ u32 bits(int i) const { return cache != nullptr ? cache[pad + i] : logit_key(row[i]); }
};

// The keys of a row (every one: the flat-row fallback of select_row) and of a collected list.
struct RowKeySource {
  RowLogits r;
  __device__ int size() const { return r.n; }
  __device__ bool get(int i, u64& key) const {
    key = full_key(r.bits(i), r.lo + i);
    return true;
  }
};

struct ListKeySource {
  const u64* keys;
  int n;
  __device__ int size() const { return n; }
  __device__ bool get(int i, u64& key) const {
    key = keys[i];
    return true;
  }
};

// Reads the row's n logits once (16-byte loads, four in flight per thread), counting their first digits into
// `hist` and, with a cache, keeping their keys at cache[pad + i]. Returns pad.
__device__ __forceinline__ int load_row(const float* __restrict__ row, int n, u32* cache, int* hist) {
  const int tid = threadIdx.x;
  const int head = min(n, static_cast<int>(((16u - (reinterpret_cast<unsigned long long>(row) & 15u)) & 15u) >> 2));
  const int pad = (4 - head) & 3;
  auto take = [&](int i, float v) {
    const u32 key = logit_key(v);
    if (cache != nullptr) cache[pad + i] = key;
    atomicAdd(&hist[key >> (32 - kDigitBits)], 1);
  };
  if (tid < head) take(tid, row[tid]);
  const float4* __restrict__ body = reinterpret_cast<const float4*>(row + head);
  const int n4 = (n - head) >> 2;
  constexpr int kInFlight = 4;
  for (int j0 = tid; j0 < n4; j0 += kInFlight * kSelectThreads) {
    float4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int j = j0 + u * kSelectThreads;
      v[u] = j < n4 ? __ldg(body + j) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int j = j0 + u * kSelectThreads;
      if (j < n4) {
        const int i = head + 4 * j;
        take(i, v[u].x);
        take(i + 1, v[u].y);
        take(i + 2, v[u].z);
        take(i + 3, v[u].w);
      }
    }
  }
  const int tail = head + 4 * n4 + tid;
  if (tail < n) take(tail, row[tail]);  // fewer than 4 left
  return pad;
}

// Each warp's contiguous stretch of slots, 128 (32 lanes x 4) at a time: warp w holds slots [w * stretch_slots,
// (w + 1) * stretch_slots).
__device__ __forceinline__ int stretch_slots(const RowLogits& r) {
  return ((r.slots() + kSelectWarps - 1) / kSelectWarps + 127) & ~127;
}
__device__ __forceinline__ void warp_stretch(const RowLogits& r, int& begin, int& end) {
  const int per_warp = stretch_slots(r);
  begin = (threadIdx.x >> 5) * per_warp;
  end = min(r.slots(), begin + per_warp);
}

// The keys of slots c0 .. c0 + 3 (c0 a multiple of 4), which of them are >= t, and how many.
__device__ __forceinline__ int pick_quad(const RowLogits& r, u64 t, int c0, u32 (&key)[4], bool (&take)[4]) {
  bool valid[4];
  r.quad(c0, key, valid);
  int m = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    take[e] = valid[e] && full_key(key[e], r.lo + c0 + e - r.pad) >= t;
    m += take[e];
  }
  return m;
}

// Each warp stretch's count of the row's keys >= t, into counts[warp] (kSelectWarps shared ints).
__device__ __forceinline__ void count_selected(const RowLogits& r, u64 t, int* counts) {
  const int lane = threadIdx.x & 31;
  int begin, end, count = 0;
  warp_stretch(r, begin, end);
  for (int c0 = begin + 4 * lane; c0 < end; c0 += 128) {
    u32 key[4];
    bool take[4];
    count += pick_quad(r, t, c0, key, take);
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) count += __shfl_xor_sync(0xffffffffu, count, d);
  if (lane == 0) counts[threadIdx.x >> 5] = count;
}

// Hands the row's keys >= t to out(slot, position, key) in position order (slots base, base + 1, ...): each warp
// writes its stretch from its offset (a prefix over the lanes per 128 slots). `counts`: each warp stretch's count of
// keys >= t (count_selected, or select_row's counts made while it collects), in shared memory, complete.
template <class Out>
__device__ __forceinline__ void write_selected(const RowLogits& r, u64 t, const int* counts, int base,
                                               const Out& out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int begin, end;
  warp_stretch(r, begin, end);
  int at = base;
  for (int w = 0; w < warp; ++w) at += counts[w];
  for (int b = begin; b < end; b += 128) {  // warp-uniform
    const int c0 = b + 4 * lane;
    u32 key[4];
    bool take[4] = {false, false, false, false};
    const int m = c0 < end ? pick_quad(r, t, c0, key, take) : 0;
    int incl = m;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    int slot = at + incl - m;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (take[e]) {
        const int i = c0 + e - r.pad;
        out(slot++, r.lo + i, full_key(key[e], r.lo + i));
      }
    at += __shfl_sync(0xffffffffu, incl, 31);
  }
}

// select_row's shared memory besides the row's cache: the digit counts, the block scans' scratch, the collected bin.
struct alignas(16) RowSelectShared {
  int hist[kRadixBins];
  int scratch[kSelectWarps + 3];
  int warp_count[kSelectWarps];  // select_row: each warp stretch's keys >= T
  u64 list[kListCap];
  int list_n;
  // select_row with Cluster > 1: this CTA's first-digit counts summed over runs of kRunBins bins, the found bin
  // (index, above, count), and this CTA's count of keys >= T
  int runs[kRadixBins / kRunBins];
  int found[3];
  int total;
};

// Dynamic shared memory of a per-row select kernel: its row cache (CacheEntries u32) and, with a cluster per row,
// the cluster's collected keys of the k-th key's bin, merged (kListCap u64, 8-byte aligned), after it.
template <int CacheEntries, int Cluster>
constexpr int kSelectSmemBytes = ((CacheEntries + 1) & ~1) * 4 + (Cluster > 1 ? kListCap * 8 : 0);
__device__ __forceinline__ u64* select_merged(u32* dynamic_smem, int cache_entries) {
  return reinterpret_cast<u64*>(dynamic_smem + ((cache_entries + 1) & ~1));
}

// One warp finds, among 64 counts (index = digit, greater = greater key; count(i) from `count`) holding at least
// `need` >= 1 keys, the index where they reach `need` from the top: {index, keys above it, its count} -> out[0..2]
// (shared), written by the one lane that holds it.
template <class Count>
__device__ __forceinline__ void warp_find_64(const Count& count, int need, int* out) {
  const int lane = threadIdx.x & 31;
  const int c0 = count(2 * lane), c1 = count(2 * lane + 1);
  const int sum = c0 + c1;
  int incl = sum;  // keys in this lane's pair and every pair above it
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_down_sync(0xffffffffu, incl, d);
    if (lane + d < 32) incl += v;
  }
  const int above = incl - sum;
  if (above < need && above + sum >= need) {
    const bool upper = above + c1 >= need;
    out[0] = upper ? 2 * lane + 1 : 2 * lane;
    out[1] = upper ? above : above + c1;
    out[2] = upper ? c1 : c0;
  }
}

// The keys of each CTA's slice of a row of n (the last may hold fewer): whole quads.
template <int Cluster>
__host__ __device__ constexpr int select_slice(int n) {
  return Cluster > 1 ? ((n + Cluster - 1) / Cluster + 3) & ~3 : n;
}

// The k greatest keys of a row that sees n > k >= 1 positions [lo, lo + n) (`row`: the logit of position lo), handed
// to out(slot, position, key) in position order, slots 0 .. k - 1. Every thread of the block calls it. Three passes
// over the row: the read (first digits counted), the collection of the keys in the k-th key's first-digit bin
// (radix-selected in shared memory) while each warp counts its stretch's keys above that bin, the write (its
// offsets: those counts plus the collected keys >= T of each stretch). A bin of more than kListCap keys (ties of a
// flat row) is selected over the row, and the write counts first. `cache`: null, or kSelectCache(slice) shared u32;
// `merged` (Cluster > 1): kListCap shared u64.
//
// Cluster > 1 (sm_90+, a cluster of that many CTAs per row): CTA rank j reads only its slice of the row (the j-th
// of Cluster stretches of whole quads) and counts its first digits; each CTA sums the cluster's counts from the
// CTAs' shared memory and finds the same bin; each collects its slice's keys of that bin and counts its stretches'
// keys above it; each merges the cluster's collected keys (at most kListCap) and radix-selects T among them, so every
// CTA finds the same T; each writes its slice's keys >= T from the slot that the counts of the CTAs before it give.
// Position order and the slots are those of one CTA per row: the result does not depend on Cluster. A bin past
// kListCap is selected by each CTA over the whole row (from L2: ties of a flat row, the slow path).
template <int Cluster, class Out>
__device__ void select_row(const float* __restrict__ row, int lo, int n, int k, u32* cache, u64* merged,
                           RowSelectShared& sh, const Out& out) {
  static_assert(Cluster == 1 || (kHasClusters && Cluster <= 8), "select_row: clusters of 2-8 CTAs on sm_90+ only");
  int* hist = sh.hist;
  int* scratch = sh.scratch;
  u64* list = sh.list;
  int* list_n = &sh.list_n;
  const u32 rank = Cluster > 1 ? cluster_rank() : 0u;
  // this CTA's slice [s, s + ns) of the row, whole quads
  const int per = select_slice<Cluster>(n);
  const int s = min(n, static_cast<int>(rank) * per), ns = min(n, s + per) - s;
  for (int i = threadIdx.x; i < kRadixBins; i += kSelectThreads) hist[i] = 0;
  if (threadIdx.x == 0) *list_n = 0;
  __syncthreads();
  const int pad = load_row(row + s, ns, cache, hist);
  BinFound f;
  if constexpr (Cluster > 1) {
    // The cluster's counts are the sum of its CTAs'. Reading all 4096 of every CTA's (16 KB x Cluster per CTA) would
    // cost more than the select (distributed shared memory is far slower than a CTA's own): each CTA sums its bins
    // over runs of kRunBins, then finds the run holding the k-th key from the CTAs' run sums and the bin from that
    // run's counts, 2 x 64 counts per CTA of the cluster.
    __syncthreads();
    static_assert(kBinsPerThread * 8 == kRunBins, "select_row: a run's bins are eight threads'");
    int run = 0;
#pragma unroll
    for (int i = 0; i < kBinsPerThread; ++i) run += hist[threadIdx.x * kBinsPerThread + i];
    run += __shfl_xor_sync(0xffffffffu, run, 1);
    run += __shfl_xor_sync(0xffffffffu, run, 2);
    run += __shfl_xor_sync(0xffffffffu, run, 4);
    if ((threadIdx.x & 7) == 0) sh.runs[threadIdx.x >> 3] = run;
    cluster_sync();  // every CTA's counts and run sums are complete
    auto summed = [&](const int* counts) {
      return [=](int i) {
        int sum = 0;
#pragma unroll
        for (int j = 0; j < Cluster; ++j) sum += cluster_ld_s32(cluster_map(counts + i, static_cast<u32>(j)));
        return sum;
      };
    };
    if (threadIdx.x < 32) warp_find_64(summed(sh.runs), k, sh.found);
    __syncthreads();
    const int run_index = sh.found[0], run_above = sh.found[1];
    __syncthreads();  // found is written again
    if (threadIdx.x < 32) warp_find_64(summed(hist + run_index * kRunBins), k - run_above, sh.found);
    __syncthreads();
    f = BinFound{run_index * kRunBins + sh.found[0], run_above + sh.found[1], sh.found[2]};
  } else {
    __syncthreads();
    f = find_bin(hist, k, scratch);
  }
  const RowLogits r{row + s, cache, pad, lo + s, ns};
  const int need = k - f.above;
  const u64 prefix = static_cast<u64>(f.bin) << (64 - kDigitBits);
  u64 t = prefix;  // need == f.count: the whole bin
  const bool counted = f.count <= kListCap;  // uniform over the cluster
  if (counted) {
    const int lane = threadIdx.x & 31;
    int begin, end, above = 0;
    warp_stretch(r, begin, end);
    for (int c0 = begin + 4 * lane; c0 < end; c0 += 128) {
      u32 key[4];
      bool valid[4];
      r.quad(c0, key, valid);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int digit = static_cast<int>(key[e] >> (32 - kDigitBits));
        above += valid[e] && digit > f.bin;
        if (valid[e] && digit == f.bin) list[atomicAdd(list_n, 1)] = full_key(key[e], r.lo + c0 + e - pad);
      }
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) above += __shfl_xor_sync(0xffffffffu, above, d);
    if (lane == 0) sh.warp_count[threadIdx.x >> 5] = above;
    const u64* keys = list;
    if constexpr (Cluster > 1) {
      // every CTA's list is complete, and no CTA reads another's counts any more (hist is free again)
      cluster_sync();
      if (need != f.count) {
        int at = 0;
        for (int j = 0; j < Cluster; ++j) {
          const int m = cluster_ld_s32(cluster_map(list_n, static_cast<u32>(j)));
          const u32 from = cluster_map(list, static_cast<u32>(j));
          for (int i = threadIdx.x; i < m; i += kSelectThreads) merged[at + i] = cluster_ld_u64(from + 8 * i);
          at += m;
        }
        keys = merged;
        __syncthreads();
      }
    } else {
      __syncthreads();
    }
    if (need != f.count) t = radix_threshold(ListKeySource{keys, f.count}, kDigitBits, prefix, need, hist, scratch);
    // each stretch's collected keys >= t join its count (key -> position -> slot -> the stretch holding it)
    const int per_warp = stretch_slots(r), mine = *list_n;
    for (int i = threadIdx.x; i < mine; i += kSelectThreads)
      if (list[i] >= t) {
        const int slot = static_cast<int>(0xFFFFFFFFu - static_cast<u32>(list[i])) - r.lo + pad;
        atomicAdd(&sh.warp_count[slot / per_warp], 1);
      }
  } else {
    if constexpr (Cluster > 1) cluster_sync();  // no CTA reads another's counts any more
    if (need != f.count)  // over the whole row: every CTA finds the same T
      t = radix_threshold(RowKeySource{RowLogits{row, nullptr, 0, lo, n}}, kDigitBits, prefix, need, hist, scratch);
    __syncthreads();
    count_selected(r, t, sh.warp_count);
  }
  __syncthreads();
  int base = 0;  // the slot of this CTA's first key: the keys >= T of the CTAs before it
  if constexpr (Cluster > 1) {
    if (threadIdx.x == 0) {
      int total = 0;
      for (int w = 0; w < kSelectWarps; ++w) total += sh.warp_count[w];
      sh.total = total;
    }
    cluster_sync();  // every CTA's total is known, and every merge of the lists is done
    for (int j = 0; j < static_cast<int>(rank); ++j) base += cluster_ld_s32(cluster_map(&sh.total, static_cast<u32>(j)));
    cluster_arrive();  // this CTA reads no other CTA's shared memory from here on
  }
  write_selected(r, t, sh.warp_count, base, out);
  if constexpr (Cluster > 1) cluster_wait();  // no CTA exits while another may still read its shared memory
}

// Shared u32 a row of n visible logits takes in select_row's cache: its slots, rounded up to whole 16-byte quads.
__host__ __device__ constexpr int kSelectCache(int n) { return (n + 3 + 3) & ~3; }

}  // namespace radix
}  // namespace dsa

#define DSA_ROW_SPEC_ARGS                                                                                  \
  const int *__restrict__ lens0, const int *__restrict__ lens1, const int *__restrict__ cu_rows, int mode, \
      int next_n, int batch, int width
#define DSA_ROW_SPEC \
  dsa::radix::RowSpec { lens0, lens1, cu_rows, mode, next_n, batch, width }

