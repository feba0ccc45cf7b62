// Paged decode logits for bf16 keys with Hopper wgmma (sm_90a only; the kernel body traps elsewhere):
//   logits[r, n] = sum_{h<64} relu(q[r,h,:] . k[n,:]) * w[r,h]
// for the next_n rows r of one request (q [B, next_n, 64, 128] fp8 e4m3 or bf16, weights fp32 [B*next_n, 64],
// keys: bf16 pages uint8 [P, 16384] = 64 slots x 128 bf16, block_table int32 [B, max_pages]).
//
// Keys as M ("KV-as-M"): one page of 64 keys is the A operand (M = 64), the request's next_n*64 (row, head)
// pairs are B (N = 64 * NextN), K = head_dim = 128 in 8 k16 steps of wgmma.m64nNk16.f32.bf16.bf16, both
// operands K-major from shared memory with the 128-byte swizzle. A row of 128 bf16 is 256 B = two swizzle
// atoms wide, so each operand is stored as two tiles (head_dim halves 0..63, 64..127), each [rows x 128 B]:
// row i at byte 128 i, its 16-byte chunk c at chunk c ^ (i % 8); 8-row groups 1024 B apart (SBO), LBO unused
// (1) for swizzled K-major; k-step kk inside a half advances the descriptor start address by 32 B.
// Accumulator (PTX fragment layout of m64nNk16 f32, warp w of the warpgroup, gid = lane/4, t = lane%4):
// register 4j+e holds key 16w + gid + 8*(e>>1), column 8j + 2t + (e&1); column = 64 r + head. So a thread
// holds 16 heads of 2 keys per row: relu * w summed in-thread, then over the 4 lanes sharing gid (2 xor
// shuffles, deterministic), and the logits stored straight from registers.
//
// One CTA = one warpgroup (128 threads) over contiguous page ranges of requests (the schedule below; the grid
// depends on the device only, CUDA-graph safe). Every thread streams 8 of a page's 1024 16-byte chunks
// with cp.async.cg into a Stages-deep ring of 16 KiB stages (Stages-1 pages in flight), writing the swizzled
// layout directly; q (fp8 converted exactly to bf16) and the weights are staged once per segment. Per page: wait
// for its cp.async group, fence.proxy.async (generic-proxy smem writes -> wgmma's async proxy), barrier,
// issue the next page's copies into the stage freed by the previous page, then the wgmma: with Split > 1 the
// B rows are cut into Split chunks (NextN/Split query rows each), one commit group per chunk, and chunk c's
// epilogue runs after wgmma.wait_group(Split-1-c), overlapping the tensor-core work of the later chunks.
// Every group retires before the next page; several CTAs per SM overlap one CTA's epilogue with another's
// wgmma. (Keeping a group in flight across the loop back-edge, or issuing and waiting under separate
// branches, makes ptxas serialize every wgmma: C7514.)
//
// Schedule: one wave of CTAs over the batch's plan (common.cuh): CTA c runs the request segments of its even
// share of all computed pages (run_pages per segment), so the time depends on the pages in all, not on the
// mix of lengths.
//
// Masking as in mqa_logits.cu (decode): row r sees keys [0, hi_r), hi_r = lens[b] - (next_n-1-r) (1-D lens)
// or lens[b*next_n + r] (2-D), clipped to [0, width]; a page is read only when its block-table index is
// < bt_width, its entry is in [0, P) and some row sees one of its keys; every column of a computed page below
// `width` is written (value or -inf); with `clean`, the pages no row sees are written -inf by
// fill_uncomputed_pages. The arithmetic order of a logit is fixed (independent of grid and stages).
#pragma once
#include "common.cuh"

namespace dsa {
namespace sm90 {

constexpr int kHeads = 64;
constexpr int kStageBytes = kBf16PageBytes;   // one page: two [64 x 128 B] swizzled tiles
constexpr int kHalfTileBytes = kStageBytes / 2;

// Dynamic shared memory of an instantiation (host mirror in the caller): 1 KiB alignment slack, q tiles,
// stages, weights.
template <int NextN, int Stages>
struct Smem {
  static constexpr int kQBytes = NextN * kHeads * kHeadDim * 2;
  static constexpr int kBytes = 1024 + kQBytes + Stages * kStageBytes + NextN * kHeads * 4;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// 128-byte-swizzle K-major shared-memory matrix descriptor (PTX "Matrix Descriptor"): start address >> 4 in
// bits 0-13, leading byte offset >> 4 in 16-29 (unused for swizzled K-major: 1), stride byte offset >> 4 in
// 32-45 (1024 B between 8-row groups), base offset 0 (tiles 1024-aligned), swizzle mode 1 (128 B) in 62-63.
__device__ __forceinline__ u64 desc_sw128(u32 smem_addr) {
  return static_cast<u64>((smem_addr & 0x3FFFFu) >> 4) | (static_cast<u64>(1) << 16) |
         (static_cast<u64>(1024 >> 4) << 32) | (static_cast<u64>(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// wgmma_wait<n> for an n that is a constant after unrolling (0..3).
__device__ __forceinline__ void wgmma_wait_dyn(int n) {
  if (n <= 0) wgmma_wait<0>();
  else if (n == 1) wgmma_wait<1>();
  else if (n == 2) wgmma_wait<2>();
  else wgmma_wait<3>();
}
// Keep the compiler from moving accumulator reads across wgmma.wait_group (the asm above names no registers).
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// D (+)= A * B, wgmma.mma_async m64nNk16 .f32.bf16.bf16, A and B from shared memory (descriptors), both
// K-major (imm-trans 0), scale-d = 0 on the first k-step (D = A*B). Generated register lists.
__device__ __forceinline__ void wgmma_m64n64k16_bf16_ss(float (&d)[32], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_m64n128k16_bf16_ss(float (&d)[64], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <int N>
__device__ __forceinline__ void wgmma_bf16_ss(float (&d)[N / 2], u64 da, u64 db, int scale_d) {
  static_assert(N == 64 || N == 128, "the shipped configurations use n64 and n128");
  if constexpr (N == 64) wgmma_m64n64k16_bf16_ss(d, da, db, scale_d);
  else wgmma_m64n128k16_bf16_ss(d, da, db, scale_d);
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Byte offset of 16-byte chunk c (0..15) of row i in a two-tile operand of `rows` rows.
__device__ __forceinline__ u32 swz_offset(int i, int c, int rows) {
  return static_cast<u32>((c >> 3) * rows * 128 + i * 128 + (((c & 7) ^ (i & 7)) << 4));
}

}  // namespace sm90
}  // namespace dsa

namespace dsa {
namespace sm90 {

struct Args {
  const unsigned char* q;
  const float* weights;
  const unsigned char* kv;
  long long kv_pages;
  const int* block_table;
  long long bt_stride;
  int bt_width;
  const int* lens;
  int lens_2d;
  int width;
  float* out;
  long long out_stride;
  int clean;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Visible length of row r of request b (clipped to [0, width]).
template <int NextN>
__device__ __forceinline__ int row_len(const Args& A, int b, int r) {
  const int h = A.lens_2d ? A.lens[b * NextN + r] : A.lens[b] - (NextN - 1 - r);
  return min(max(h, 0), A.width);
}

// Pages [p_begin, p_end) of request b (a segment of the plan: pages some row sees). Called by all 128
// threads; may be called again for another range after a __syncthreads().
template <int QFp8, int NextN, int Stages, int Split>
__device__ __forceinline__ void run_pages(const Args& A, int b, int p_begin, int p_end,
                                          unsigned char* smem_raw) {
  static_assert(NextN >= 1 && NextN <= 4 && Stages >= 2, "config");
  constexpr int N = NextN * kHeads;  // B rows: (row, head)
  static_assert(NextN % Split == 0, "Split must divide NextN");
  constexpr int NC = N / Split;      // B rows per wgmma (chunk of NextN / Split query rows)
  constexpr int RC = NC / 2;         // accumulator registers per thread and chunk
  const unsigned char* __restrict__ q = A.q;
  const float* __restrict__ weights = A.weights;
  const unsigned char* __restrict__ kv = A.kv;
  const long long kv_pages = A.kv_pages;
  const int bt_width = A.bt_width;
  const int width = A.width;
  float* __restrict__ out = A.out;
  const long long out_stride = A.out_stride;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t = lane & 3;
  // The plan's pages are those some row sees, so the copies are issued before the lengths arrive (they
  // are needed by the epilogue only); pages at or past `width` have no column to write.
  const int cnt_c = max(0, min(p_end, (width + kPageSlots - 1) / kPageSlots) - p_begin);
  if (cnt_c == 0) return;  // CTA-uniform
  int hi[NextN];  // row lengths, loaded once the first copies are in flight

  // ---- shared memory: [align][q: 2 x N x 128 B][stages][weights] (tiles 1024-aligned) ----
  const u32 raw_addr = static_cast<u32>(__cvta_generic_to_shared(smem_raw));
  const u32 pad = ((raw_addr + 1023u) & ~1023u) - raw_addr;
  unsigned char* sbase = smem_raw + pad;
  const u32 q_addr = raw_addr + pad;
  const u32 st_addr = q_addr + Smem<NextN, Stages>::kQBytes;
  float* s_w = reinterpret_cast<float*>(sbase + Smem<NextN, Stages>::kQBytes + Stages * kStageBytes);

  const int* bt = A.block_table + static_cast<i64>(b) * A.bt_stride;
  // Block-table entry of page p, or -1 when it must not be read (beyond the table / out of [0, P)).
  auto entry_of = [&](int p) -> int {
    if (p >= bt_width) return -1;
    const int e = __ldg(bt + p);
    return (e >= 0 && static_cast<i64>(e) < kv_pages) ? e : -1;
  };
  // Issue page j's copies (if it exists and some row sees it) into its stage; always one commit group.
  auto issue = [&](int j) {
    if (j < cnt_c) {
      const int p = p_begin + j;
      const int e = entry_of(p);
      if (e >= 0) {
        const unsigned char* src = kv + static_cast<i64>(e) * kBf16PageBytes;
        const u32 dst = st_addr + static_cast<u32>(j % Stages) * kStageBytes;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const int ch = tid + 128 * k;      // 16-byte chunk of the page: key ch/16, chunk ch%16
          const int key = ch >> 4, c = ch & 15;
          cp_async16(dst + swz_offset(key, c, kPageSlots), src + 16 * ch);
        }
      }
    }
    cp_async_commit();
  };

  // ---- stage q (swizzled B operand, bf16) and weights while the first pages stream in ----
  const i64 row0 = static_cast<i64>(b) * NextN;
  auto stage_q = [&]() {
    for (int i = tid; i < N * 16; i += 128) {
      const int nrow = i >> 4, c = i & 15;  // nrow = 64 r + head
      uint4 v;
      if (QFp8) {
        const uint2 x = *reinterpret_cast<const uint2*>(q + (row0 * kHeads + nrow) * kHeadDim + 8 * c);
        const u32 w2[2] = {x.x, x.y};
        u32 o[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          u32 ev, od;  // bytes [e0 e2 e1 e3] -> even = (e0, e1), odd = (e2, e3), values * 2^-8 (exact)
          e4m3x4_to_f16x2_scaled(__byte_perm(w2[h], 0u, 0x3120), ev, od);
          o[2 * h] = f16x2_scaled_to_bf16x2(ev);
          o[2 * h + 1] = f16x2_scaled_to_bf16x2(od);
        }
        v = make_uint4(o[0], o[1], o[2], o[3]);
      } else {
        v = *reinterpret_cast<const uint4*>(q + ((row0 * kHeads + nrow) * kHeadDim + 8 * c) * 2);
      }
      *reinterpret_cast<uint4*>(sbase + swz_offset(nrow, c, N)) = v;
    }
    for (int i = tid; i < N; i += 128) s_w[i] = weights[row0 * kHeads + i];
  };

  const float kNegInf = __int_as_float(0xff800000);
  const int key_in_page0 = 16 * warp + gid;  // this thread's keys in a page: +0 and +8
  auto page_live = [&](int j) -> bool { return entry_of(p_begin + j) >= 0; };  // CTA-uniform
  // Page j (stage j % Stages) against chunk c of the B rows (rows c*RC .. of q): 8 wgmma k-steps into a,
  // committed as one group.
  auto mma_chunk = [&](int j, int c, float (&a)[RC]) {
    const u32 a_addr = st_addr + static_cast<u32>(j % Stages) * kStageBytes;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const int hf = kk >> 2, ks = kk & 3;
      const u64 da = desc_sw128(a_addr + hf * kHalfTileBytes + 32 * ks);
      const u64 db = desc_sw128(q_addr + hf * (N * 128) + c * (NC * 128) + 32 * ks);
      wgmma_bf16_ss<NC>(a, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  };
  // Rows of chunk c: relu * w over this thread's 16 heads per row, then over the 4 lanes t; masked store.
  auto epilogue = [&](int j, int c, const float (&a)[RC], bool live) {
    const int p = p_begin + j;
    const int n0 = p * kPageSlots + key_in_page0;
#pragma unroll
    for (int rr = 0; rr < NextN / Split; ++rr) {
      const int r = c * (NextN / Split) + rr;
      float s0 = 0.0f, s1 = 0.0f;
      if (live) {
        const float2* w2 = reinterpret_cast<const float2*>(s_w + r * kHeads);
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const float2 w = w2[4 * jj + t];  // heads 8jj + 2t, +1
          const float* x = a + 32 * rr + 4 * jj;
          s0 = fmaf(fmaxf(x[0], 0.0f), w.x, s0);
          s0 = fmaf(fmaxf(x[1], 0.0f), w.y, s0);
          s1 = fmaf(fmaxf(x[2], 0.0f), w.x, s1);
          s1 = fmaf(fmaxf(x[3], 0.0f), w.y, s1);
        }
        s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
        s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
        s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
        s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
      }
      // lanes t = 2 (r & 1) + half store key n0 + 8 half of row r (rows alternate between lane pairs)
      if ((t >> 1) == (r & 1)) {
        const int half = t & 1;
        const int n = n0 + 8 * half;
        const float v = half ? s1 : s0;
        if (n < width) out[(row0 + r) * out_stride + n] = (live && n < hi[r]) ? v : kNegInf;
      }
    }
  };

  float acc[Split][RC];
#pragma unroll
  for (int c = 0; c < Split; ++c)
#pragma unroll
    for (int i = 0; i < RC; ++i) acc[c][i] = 0.0f;
#pragma unroll
  for (int j = 0; j < Stages - 1; ++j) issue(j);
#pragma unroll
  for (int r = 0; r < NextN; ++r) hi[r] = row_len<NextN>(A, b, r);
  stage_q();
  for (int j = 0; j < cnt_c; ++j) {
    cp_async_wait<Stages - 2>();  // page j's group (this thread's copies) has landed
    fence_proxy_async_smem();     // make them (and q) visible to the async proxy
    __syncthreads();              // all threads' copies; every thread is past page j-1's wgmma
    issue(j + Stages - 1);        // into the stage page j-1 used
    const bool live = page_live(j);
    if (live) {
      wgmma_fence();
#pragma unroll
      for (int c = 0; c < Split; ++c) mma_chunk(j, c, acc[c]);
      // chunk c's epilogue overlaps the wgmma of chunks c+1.. (all groups retired before the next page)
#pragma unroll
      for (int c = 0; c < Split; ++c) {
        wgmma_wait_dyn(Split - 1 - c);
        fence_regs<RC>(acc[c]);
        epilogue(j, c, acc[c], true);
      }
    } else {
#pragma unroll
      for (int c = 0; c < Split; ++c) epilogue(j, c, acc[c], false);
    }
  }
  cp_async_wait<0>();  // no copy may outlive the segment
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace sm90
}  // namespace dsa

#define DSA_SM90_ARGS                                                                                       \
  const unsigned char *__restrict__ q, const float *__restrict__ weights, const unsigned char *__restrict__ kv, \
      long long kv_pages, const int *__restrict__ block_table, long long bt_stride, int bt_width,           \
      const int *__restrict__ lens, int lens_2d, int width, float *__restrict__ out, long long out_stride,   \
      int clean

// Balanced schedule: grid (C) = one wave, block 128, same shared memory. CTA c runs the request segments of
// its share of the batch's computed pages (plan: int64 [batch + 1], see for_each_decode_segment in
// common.cuh), q and weights re-staged per segment; with `clean` it then writes -inf over its share of the
// pages no CTA computes. The time no longer depends on the mix of lengths, only on the pages in all.
template <int QFp8, int NextN, int Stages, int MinBlocks, int Split>
__global__ void __launch_bounds__(128, MinBlocks)
    mqa_logits_sm90_decode_kernel(DSA_SM90_ARGS, const long long* __restrict__ plan, int batch) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace dsa::sm90;
  extern __shared__ unsigned char smem_raw[];
  const Args A{q, weights, kv, kv_pages, block_table, bt_stride, bt_width, lens, lens_2d, width, out, out_stride,
               clean};
  dsa::for_each_decode_segment(plan, batch, [&](int b, int p_begin, int p_end) {
    run_pages<QFp8, NextN, Stages, Split>(A, b, p_begin, p_end, smem_raw);
  });
  if (clean) dsa::fill_uncomputed_pages(plan, batch, NextN, width, out, out_stride);
#else
  __trap();
#endif
}
#undef DSA_SM90_ARGS
