// The indexer's top-k in SGLang's output form (cupy_dsa.topk): what SGLang's topk_transform_paged kernels compute
// after the logits, here for the benches' stock step (the stand-in for SGLang's own top-k where it cannot run).
//
// Row r sees positions [0, n), n = clamp(lens[r], 0, width). A row with n <= index_topk selects 0 .. n - 1 without
// reading logits (SGLang's trivial path); any other row its index_topk greatest logits (ties: lower position) by
// one CTA's radix select (kernels/radix_select.cuh), in position order. Outputs, int32 [rows, index_topk], -1
// padded: page_indices (SGLang's slot transform, (page_table[r, i >> 6] << 6) | (i & 63)) and, when not null,
// raw_indices (the positions i). Nothing is read past a row's n logits or its page-table entries of them.
#include "radix_select.cuh"

// Grid (rows * Cluster): one CTA per row, or on sm_90+ a cluster of Cluster CTAs per row, each reading a slice
// (select_row); kSelectThreads threads; dynamic shared memory: CacheEntries u32 and, with clusters, kListCap u64
// (a row or slice that does not fit is read again from L2 by each radix pass).
template <int CacheEntries, int Cluster>
__global__ void DSA_SELECT_LAUNCH_BOUNDS(Cluster) DSA_CLUSTER_DIMS(Cluster) paged_topk_kernel(
    const float* __restrict__ logits, long long logits_stride, int width, const int* __restrict__ lens,
    const int* __restrict__ page_table, long long pt_stride, int index_topk, int* __restrict__ page_indices,
    int* __restrict__ raw_indices) {
  using namespace dsa;
  using namespace dsa::radix;
  extern __shared__ u32 row_cache[];
  __shared__ RowSelectShared shared;
  const int r = blockIdx.x / Cluster;
  const int n = max(0, min(lens[r], width));
  const int* __restrict__ pt = page_table + static_cast<i64>(r) * pt_stride;
  int* __restrict__ out = page_indices + static_cast<i64>(r) * index_topk;
  int* __restrict__ raw = raw_indices == nullptr ? nullptr : raw_indices + static_cast<i64>(r) * index_topk;
  auto slot_of = [&](int pos) {
    return static_cast<int>((static_cast<u32>(pt[pos >> kPageBits]) << kPageBits) |
                            static_cast<u32>(pos & (kPageSlots - 1)));
  };
  if (n <= index_topk) {  // uniform over the cluster
    for (int i = (blockIdx.x % Cluster) * kSelectThreads + threadIdx.x; i < index_topk; i += Cluster * kSelectThreads) {
      out[i] = i < n ? slot_of(i) : -1;
      if (raw != nullptr) raw[i] = i < n ? i : -1;
    }
    return;
  }
  const int slice = select_slice<Cluster>(n);
  select_row<Cluster>(logits + static_cast<i64>(r) * logits_stride, 0, n, index_topk,
                      CacheEntries >= kSelectCache(slice) ? row_cache : nullptr,
                      select_merged(row_cache, CacheEntries), shared,
                      [&](int slot, int pos, u64) {
                        out[slot] = slot_of(pos);
                        if (raw != nullptr) raw[slot] = pos;
                      });
}
