// Indexer logits for bf16 keys with Hopper wgmma (sm_90a only; the kernel bodies trap elsewhere):
//   logits[r, n] = sum_{h<64} relu(q[r,h,:] . k[n,:]) * w[r,h]
// q fp8 e4m3 (converted exactly to bf16 in shared memory) or bf16, weights fp32 [rows, 64], keys bf16 in
// blocks of 64 keys x 256 B (a page of the bf16 cache, or 64 consecutive rows of contiguous [S, 128] keys).
// Two kernels share the tile operations below: paged decode (mqa_logits_sm90_decode_kernel, a request's
// next_n rows) and prefill (mqa_logits_sm90_prefill_kernel, 4 query rows of one request per CTA).
//
// Keys as M ("KV-as-M"): one block of 64 keys is the A operand (M = 64), the rows' (row, head) pairs are B
// (N = 64 * rows), K = head_dim = 128 in 8 k16 steps of wgmma.m64nNk16.f32.bf16.bf16, both operands K-major
// from shared memory with the 128-byte swizzle. A row of 128 bf16 is 256 B = two swizzle atoms wide, so each
// operand is stored as two tiles (head_dim halves 0..63, 64..127), each [rows x 128 B]: row i at byte 128 i,
// its 16-byte chunk c at chunk c ^ (i % 8); 8-row groups 1024 B apart (SBO), LBO unused (1) for swizzled
// K-major; k-step kk inside a half advances the descriptor start address by 32 B.
// Accumulator (PTX fragment layout of m64nNk16 f32, warp w of the warpgroup, gid = lane/4, t = lane%4):
// register 4j+e holds key 16w + gid + 8*(e>>1), column 8j + 2t + (e&1); column = 64 r + head. So a thread
// holds 16 heads of 2 keys per row: relu * w summed in-thread, then over the 4 lanes sharing gid (2 xor
// shuffles, deterministic), and the logits stored straight from registers.
//
// Pipeline (per key group of one warpgroup, 128 threads): every thread streams 8 of a block's 1024 16-byte
// chunks with cp.async.cg into the group's Stages-deep ring of 16 KiB stages (Stages-1 blocks in flight),
// writing the swizzled layout directly; q and the weights are staged once per row tile for all groups. Per
// block: wait for its cp.async group, fence.proxy.async (generic-proxy smem writes -> wgmma's async proxy),
// the group's barrier, then the wgmma, then the next block's copies into the stage freed by the previous
// block: with Split > 1 the B rows are
// cut into Split chunks (rows / Split query rows each), one commit group per chunk, and chunk c's epilogue
// runs after wgmma.wait_group(Split-1-c), overlapping the tensor-core work of the later chunks. Every group
// retires before the next block; other warpgroups (several CTAs per SM, or a CTA's two key groups taking
// turns at the tensor cores) overlap one warpgroup's epilogue with another's wgmma. (Keeping a group in flight across the loop
// back-edge, or issuing and waiting under separate branches, makes ptxas serialize every wgmma: C7514.)
//
// Decode schedule: one wave of CTAs over the batch's plan (common.cuh): CTA c runs the request segments of
// its even share of all computed pages (run_pages per segment; with two key groups they take a segment's
// pages alternately), so the time depends on the pages in all, not on the mix of lengths. Masking as in mqa_logits.cu (decode): row r sees keys [0, hi_r), hi_r = lens[b] -
// (next_n-1-r) (1-D lens) or lens[b*next_n + r] (2-D), clipped to [0, width]; a page is read only when its
// block-table index is < bt_width, its entry is in [0, P) and some row sees one of its keys; every column of a
// computed page below `width` is written (value or -inf); with `clean`, the pages no row sees are written
// -inf by fill_uncomputed_pages.
//
// Prefill schedule: grid x = row tile of 4 query rows (the last first: causal prefill runs its heaviest
// tiles first), y = parts of the tile's key blocks. The two warpgroups of a CTA share the q tile and take
// alternate key blocks of the CTA's part, each with its own stage ring and barrier. Row i sees keys
// [ks[i], ke[i]) (clipped to [0, S)); only the blocks some row of the tile sees are read; the keys of an
// invalid block-table entry are masked; with `clean` (full width) every other column of the rows is -inf.
// The arithmetic order of a logit is fixed (independent of grid, parts and stages): reruns are bitwise equal.
#pragma once
#include "common.cuh"

namespace dsa {
namespace sm90 {

constexpr int kHeads = 64;
constexpr int kStageBytes = kBf16PageBytes;   // one block of 64 keys: two [64 x 128 B] swizzled tiles
constexpr int kHalfTileBytes = kStageBytes / 2;

// Dynamic shared memory of the decode kernel (host mirror in the caller): 1 KiB alignment slack, q tiles,
// each key group's stages, weights.
template <int NextN, int Stages, int KeyGroups>
struct Smem {
  static constexpr int kQBytes = NextN * kHeads * kHeadDim * 2;
  static constexpr int kBytes = 1024 + kQBytes + KeyGroups * Stages * kStageBytes + NextN * kHeads * 4;
};

// Prefill: 4 query rows per CTA (B = 256 (row, head) pairs: the keys of a block are read from L2 once per 4
// rows); two key groups take alternate key blocks, each with a ring of Stages blocks, and each key group is
// WGs / 2 warpgroups that split the 4 rows.
constexpr int kPrefillRows = 4;
constexpr int kPrefillKeyGroups = 2;
template <int Stages>
struct PrefillSmem {
  static constexpr int kQBytes = kPrefillRows * kHeads * kHeadDim * 2;
  static constexpr int kBytes =
      1024 + kQBytes + kPrefillKeyGroups * Stages * kStageBytes + kPrefillRows * kHeads * 4;
};

// Byte offset of 16-byte chunk c (0..15) of row i in a two-tile operand of `rows` rows.
__device__ __forceinline__ u32 swz_offset(int i, int c, int rows) {
  return static_cast<u32>((c >> 3) * rows * 128 + i * 128 + (((c & 7) ^ (i & 7)) << 4));
}

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

__device__ __forceinline__ void wgmma_m64n192k16_bf16_ss(float (&d)[96], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %98, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
      "}, %96, %97, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "l"(da), "l"(db), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_m64n256k16_bf16_ss(float (&d)[128], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <int N>
__device__ __forceinline__ void wgmma_bf16_ss(float (&d)[N / 2], u64 da, u64 db, int scale_d) {
  static_assert(N == 64 || N == 128 || N == 192 || N == 256, "wgmma shapes n64, n128, n192, n256");
  if constexpr (N == 64) wgmma_m64n64k16_bf16_ss(d, da, db, scale_d);
  else if constexpr (N == 128) wgmma_m64n128k16_bf16_ss(d, da, db, scale_d);
  else if constexpr (N == 192) wgmma_m64n192k16_bf16_ss(d, da, db, scale_d);
  else wgmma_m64n256k16_bf16_ss(d, da, db, scale_d);
}
// cp.async of 16 bytes that reads src_bytes (16 or 0) and zero-fills the rest.
__device__ __forceinline__ void cp_async16_zfill(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Named barriers (id 0 is __syncthreads): wait for `count` threads, or arrive without waiting.
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// ---- tile operations ----------------------------------------------------------------------------

// One block of 64 keys x 256 B (contiguous in global memory) into a swizzled A stage, issued by Threads
// threads (ctid = thread among them): 1024 / Threads 16-byte chunks each. With Partial, keys >= valid_keys
// are zero-filled without being read (the end of contiguous keys).
template <bool Partial, int Threads = 128>
__device__ __forceinline__ void copy_key_block(u32 dst, const unsigned char* src, int valid_keys, int ctid) {
#pragma unroll
  for (int k = 0; k < 1024 / Threads; ++k) {
    const int ch = ctid + Threads * k;  // 16-byte chunk of the block: key ch/16, chunk ch%16
    const int key = ch >> 4, c = ch & 15;
    if (Partial) {
      const bool in = key < valid_keys;
      cp_async16_zfill(dst + swz_offset(key, c, kPageSlots), in ? src + 16 * ch : src, in ? 16 : 0);
    } else {
      cp_async16(dst + swz_offset(key, c, kPageSlots), src + 16 * ch);
    }
  }
}

// Pairs [0, N) of the B operand: pair p = (row, head) at q element (first + p) * 128, as swizzled bf16 (fp8
// converted exactly); pairs >= valid are zero. Threads tid of nthreads share the work.
template <int QFp8, int N>
__device__ __forceinline__ void stage_q_operand(unsigned char* dst, const unsigned char* __restrict__ q, i64 first,
                                                int valid, int tid, int nthreads) {
  for (int i = tid; i < N * 16; i += nthreads) {
    const int p = i >> 4, c = i & 15;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (p < valid) {
      const i64 elem = (first + p) * kHeadDim + 8 * c;
      if (QFp8) {
        const uint2 x = *reinterpret_cast<const uint2*>(q + elem);
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
        v = *reinterpret_cast<const uint4*>(q + 2 * elem);
      }
    }
    *reinterpret_cast<uint4*>(dst + swz_offset(p, c, N)) = v;
  }
}

// acc = keys of the stage at a_addr (M = 64) x pairs [c0, c0 + NC) of the N-pair B operand at b_addr:
// 8 wgmma k-steps, one commit group.
template <int N, int NC>
__device__ __forceinline__ void mma_key_block(u32 a_addr, u32 b_addr, int c0, float (&acc)[NC / 2]) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const int hf = kk >> 2, ks = kk & 3;
    const u64 da = desc_sw128(a_addr + hf * kHalfTileBytes + 32 * ks);
    const u64 db = desc_sw128(b_addr + hf * (N * 128) + c0 * 128 + 32 * ks);
    wgmma_bf16_ss<NC>(acc, da, db, kk > 0 ? 1 : 0);
  }
  wgmma_commit();
}

// Logits of one query row for this thread's keys 16w + gid (s0) and +8 (s1), from the row's 32 accumulators
// x (heads 8jj + 2t, +1) and its 64 weights in shared memory, permuted so that lane t's 16 are contiguous
// (wp[16 t + 2 jj + e] = w[8 jj + 2 t + e], see row_pair_logit): relu * w over the 16 heads in-thread, then
// over the 4 lanes t (2 xor shuffles, fixed order).
__device__ __forceinline__ void row_logits(const float* x, const float* wp_row, int t, float& s0, float& s1) {
  const float* w = wp_row + 16 * t;
  s0 = 0.0f;
  s1 = 0.0f;
#pragma unroll
  for (int q4 = 0; q4 < 4; ++q4) {
    const float4 wv = *reinterpret_cast<const float4*>(w + 4 * q4);  // jj = 2 q4 (x, y), 2 q4 + 1 (z, w)
    const float* xx = x + 8 * q4;
    s0 = fmaf(fmaxf(xx[0], 0.0f), wv.x, s0);
    s0 = fmaf(fmaxf(xx[1], 0.0f), wv.y, s0);
    s1 = fmaf(fmaxf(xx[2], 0.0f), wv.x, s1);
    s1 = fmaf(fmaxf(xx[3], 0.0f), wv.y, s1);
    s0 = fmaf(fmaxf(xx[4], 0.0f), wv.z, s0);
    s0 = fmaf(fmaxf(xx[5], 0.0f), wv.w, s0);
    s1 = fmaf(fmaxf(xx[6], 0.0f), wv.z, s1);
    s1 = fmaf(fmaxf(xx[7], 0.0f), wv.w, s1);
  }
  s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
  s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
}

// Logits of a pair of query rows (r, r+1) for this thread's keys 16w + gid (+0, +8) from the rows' 32
// accumulators each (heads 8jj + 2t, +1) and their weights in shared memory, permuted so that lane t's 16
// weights of a row are contiguous (wp[16 t + 2 jj + e] = w[8 jj + 2 t + e]): relu * w over the 16 heads
// in-thread (two partial sums per key), then a transposing reduction over the 4 lanes t (3 shuffles): lane t
// ends with row r + (t >> 1), key +8 (t & 1), summed in a fixed order.
__device__ __forceinline__ float row_pair_logit(const float* x0, const float* x1, const float* wp0,
                                                const float* wp1, int t) {
  float p[2][2];  // [row][key]
  const float* xs[2] = {x0, x1};
  const float* ws[2] = {wp0 + 16 * t, wp1 + 16 * t};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float a0 = 0.0f, a1 = 0.0f, b0 = 0.0f, b1 = 0.0f;  // key +0 / +8, even / odd jj
#pragma unroll
    for (int q4 = 0; q4 < 4; ++q4) {
      const float4 w = *reinterpret_cast<const float4*>(ws[r] + 4 * q4);  // jj = 2 q4, 2 q4 + 1
      const float* x = xs[r] + 8 * q4;
      a0 = fmaf(fmaxf(x[0], 0.0f), w.x, a0);
      a0 = fmaf(fmaxf(x[1], 0.0f), w.y, a0);
      b0 = fmaf(fmaxf(x[2], 0.0f), w.x, b0);
      b0 = fmaf(fmaxf(x[3], 0.0f), w.y, b0);
      a1 = fmaf(fmaxf(x[4], 0.0f), w.z, a1);
      a1 = fmaf(fmaxf(x[5], 0.0f), w.w, a1);
      b1 = fmaf(fmaxf(x[6], 0.0f), w.z, b1);
      b1 = fmaf(fmaxf(x[7], 0.0f), w.w, b1);
    }
    p[r][0] = a0 + a1;
    p[r][1] = b0 + b1;
  }
  const bool odd = t & 1, high = t & 2;
  float k0 = odd ? p[0][1] : p[0][0], k1 = odd ? p[1][1] : p[1][0];  // kept: key (t & 1) of both rows
  k0 += __shfl_xor_sync(0xffffffffu, odd ? p[0][0] : p[0][1], 1);
  k1 += __shfl_xor_sync(0xffffffffu, odd ? p[1][0] : p[1][1], 1);
  float v = high ? k1 : k0;                                         // kept: row (t >> 1)
  v += __shfl_xor_sync(0xffffffffu, high ? k0 : k1, 2);
  return v;
}

// The 64 weights of each of `rows` query rows (from global row `first`) into shared memory, permuted for
// row_logits / row_pair_logit: wp[64 r + 16 t + k] = w[r][8 (k >> 1) + 2 t + (k & 1)]; rows >= valid are zero.
__device__ __forceinline__ void stage_weights_permuted(float* wp, const float* __restrict__ weights, i64 first,
                                                       int rows, int valid, int tid, int nthreads) {
  for (int i = tid; i < rows * kHeads; i += nthreads) {
    const int r = i / kHeads, k = i % 16, tt = (i % kHeads) / 16;
    const int head = 8 * (k >> 1) + 2 * tt + (k & 1);
    wp[i] = r < valid ? weights[(first + r) * kHeads + head] : 0.0f;
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

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

// Pages [p_begin, p_end) of request b (a segment of the plan: pages some row sees). Called by all 128 *
// KeyGroups threads; may be called again for another range after a __syncthreads(). Key group kg (warpgroup
// kg) takes the segment's pages kg + KeyGroups * i into its own stage ring; the q tile and the weights are
// staged once for all groups. With two groups and Turns they take turns issuing their wgmma (named barriers
// 3 + kg), so one group's epilogue and copies run under the other's tensor-core work: a verify row tile (n
// rows x 64 heads as B) then keeps the tensor cores busy where one warpgroup alternated MMA and epilogue;
// without Turns the groups run free.
template <int QFp8, int NextN, int Stages, int Split, int KeyGroups, int Turns>
__device__ __forceinline__ void run_pages(const Args& A, int b, int p_begin, int p_end,
                                          unsigned char* smem_raw) {
  static_assert(NextN >= 1 && NextN <= 4 && Stages >= 2 && (KeyGroups == 1 || KeyGroups == 2) &&
                (KeyGroups == 2 || !Turns), "config");
  constexpr int N = NextN * kHeads;  // B rows: (row, head)
  static_assert(NextN % Split == 0, "Split must divide NextN");
  constexpr int NC = N / Split;      // B rows per wgmma (chunk of NextN / Split query rows)
  constexpr int RC = NC / 2;         // accumulator registers per thread and chunk
  constexpr int RPC = NextN / Split; // query rows per chunk
  constexpr int kThreads = 128 * KeyGroups;
  constexpr bool kTurns = Turns != 0;
  const unsigned char* __restrict__ kv = A.kv;
  const long long kv_pages = A.kv_pages;
  const int bt_width = A.bt_width;
  const int width = A.width;
  float* __restrict__ out = A.out;
  const long long out_stride = A.out_stride;

  const int tid = threadIdx.x, kg = tid >> 7, gtid = tid & 127, lane = tid & 31, warp = (tid >> 5) & 3;
  const int gid = lane >> 2, t = lane & 3;
  // The plan's pages are those some row sees, so the copies are issued before the lengths arrive (they
  // are needed by the epilogue only); pages at or past `width` have no column to write.
  const int cnt_c = max(0, min(p_end, (width + kPageSlots - 1) / kPageSlots) - p_begin);
  if (cnt_c == 0) return;  // CTA-uniform
  const int cnt = max(0, (cnt_c - kg + KeyGroups - 1) / KeyGroups);  // this group's pages
  auto page_of = [&](int i) { return kg + KeyGroups * i; };          // its i-th, in the segment
  int hi[NextN];  // row lengths, loaded once the first copies are in flight

  // ---- shared memory: [align][q: 2 x N x 128 B][key groups x stages][weights] (tiles 1024-aligned) ----
  using S = Smem<NextN, Stages, KeyGroups>;
  const u32 raw_addr = static_cast<u32>(__cvta_generic_to_shared(smem_raw));
  const u32 pad = ((raw_addr + 1023u) & ~1023u) - raw_addr;
  unsigned char* sbase = smem_raw + pad;
  const u32 q_addr = raw_addr + pad;
  const u32 st_addr = q_addr + S::kQBytes + static_cast<u32>(kg * Stages * kStageBytes);
  float* s_w = reinterpret_cast<float*>(sbase + S::kQBytes + KeyGroups * Stages * kStageBytes);

  const int* bt = A.block_table + static_cast<i64>(b) * A.bt_stride;
  // Block-table entry of page p, or -1 when it must not be read (beyond the table / out of [0, P)).
  auto entry_of = [&](int p) -> int {
    if (p >= bt_width) return -1;
    const int e = __ldg(bt + p);
    return (e >= 0 && static_cast<i64>(e) < kv_pages) ? e : -1;
  };
  // Issue this group's page i's copies (if it exists and may be read) into its stage; always one commit group.
  auto issue = [&](int i) {
    if (i < cnt) {
      const int e = entry_of(p_begin + page_of(i));
      if (e >= 0)
        copy_key_block<false>(st_addr + static_cast<u32>(i % Stages) * kStageBytes,
                              kv + static_cast<i64>(e) * kBf16PageBytes, kPageSlots, gtid);
    }
    cp_async_commit();
  };

  const i64 row0 = static_cast<i64>(b) * NextN;
  const float kNegInf = __int_as_float(0xff800000);
  const int key_in_page0 = 16 * warp + gid;  // this thread's keys in a page: +0 and +8
  // Rows of chunk c of segment page j: row pairs by the transposing reduction (lane t stores row t >> 1,
  // key +8 (t & 1)), an odd last row by lanes 0-1; a page that must not be read is -inf.
  auto epilogue = [&](int j, int c, const float (&a)[RC], bool live) {
    const int n0 = (p_begin + j) * kPageSlots + key_in_page0;
#pragma unroll
    for (int pr = 0; pr < RPC / 2; ++pr) {
      const int r = c * RPC + 2 * pr;
      const float v = live ? row_pair_logit(a + 64 * pr, a + 64 * pr + 32, s_w + r * kHeads,
                                            s_w + (r + 1) * kHeads, t)
                           : 0.0f;
      const int mine = t >> 1, n = n0 + 8 * (t & 1);
      const int h = mine ? hi[r + 1] : hi[r];
      if (n < width) out[(row0 + r + mine) * out_stride + n] = (live && n < h) ? v : kNegInf;
    }
    if (RPC % 2) {
      const int r = c * RPC + RPC - 1;
      float s0 = 0.0f, s1 = 0.0f;
      if (live) row_logits(a + 32 * (RPC - 1), s_w + r * kHeads, t, s0, s1);
      const int n = n0 + 8 * t;
      if (t < 2 && n < width) out[(row0 + r) * out_stride + n] = (live && n < hi[r]) ? (t ? s1 : s0) : kNegInf;
    }
  };

  float acc[Split][RC];
#pragma unroll
  for (int c = 0; c < Split; ++c)
#pragma unroll
    for (int i = 0; i < RC; ++i) acc[c][i] = 0.0f;
#pragma unroll
  for (int i = 0; i < Stages - 1; ++i) issue(i);
#pragma unroll
  for (int r = 0; r < NextN; ++r) hi[r] = row_len<NextN>(A, b, r);
  // q (swizzled B operand) and weights while the first pages stream in
  stage_q_operand<QFp8, N>(sbase, A.q, row0 * kHeads, N, tid, kThreads);
  stage_weights_permuted(s_w, A.weights, row0, NextN, NextN, tid, kThreads);
  fence_proxy_async_smem();  // q -> the async proxy
  __syncthreads();           // q and weights of all threads
  // Per page: its copies landed (cp.async group + the group's barrier), the turn (two groups), all chunks
  // issued, chunk c's epilogue after wgmma.wait_group(Split-1-c); every group retires before the next page (a
  // group in flight across the loop back-edge makes ptxas serialize, C7514). With turns both groups run
  // ceil(pages / 2) iterations (the barrier counts must match); the second may have one page less.
  const int iters = kTurns ? (cnt_c + 1) / 2 : cnt;
  if (kTurns && kg == 1) named_arrive(3, kThreads);
  for (int i = 0; i < iters; ++i) {
    cp_async_wait<Stages - 2>();  // page i's group (this thread's copies) has landed
    fence_proxy_async_smem();     // make them visible to the async proxy
    named_sync(1 + kg, 128);      // the group's copies of page i; page i-1 retired by all of the group
    if (kTurns) named_sync(3 + kg, kThreads);
    const bool signal = kTurns && !(kg == 1 && i == iters - 1);
    if (i < cnt) {
      const int j = page_of(i);
      const bool live = entry_of(p_begin + j) >= 0;  // uniform over the group
      const u32 a_addr = st_addr + static_cast<u32>(i % Stages) * kStageBytes;
      if (live) {  // issue and wait under one branch (else ptxas serializes the wgmma: C7514 / C7518)
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < Split; ++c) mma_key_block<N, NC>(a_addr, q_addr, c * NC, acc[c]);
        if (signal) named_arrive(4 - kg, kThreads);
        issue(i + Stages - 1);  // into the stage page i-1 used
#pragma unroll
        for (int c = 0; c < Split; ++c) {
          wgmma_wait_dyn(Split - 1 - c);
          fence_regs<RC>(acc[c]);
          epilogue(j, c, acc[c], true);
        }
      } else {
        if (signal) named_arrive(4 - kg, kThreads);
        issue(i + Stages - 1);
#pragma unroll
        for (int c = 0; c < Split; ++c) epilogue(j, c, acc[c], false);
      }
    } else {
      if (signal) named_arrive(4 - kg, kThreads);
      issue(i + Stages - 1);
    }
  }
  cp_async_wait<0>();  // no copy may outlive the segment
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ---- prefill --------------------------------------------------------------------------------------

struct PrefillArgs {
  const unsigned char* q;        // [T, 64, 128] fp8 or bf16
  const float* weights;          // [T, 64]
  const unsigned char* kv;       // Paged: bf16 cache pages [kv_pages, 16384]; else keys [num_keys, 128] bf16
  long long kv_pages;
  const int* block_table;        // Paged: [bt_width] (num_keys = 64 * bt_width); varlen: [batch, bt_stride]
  long long bt_stride;           // varlen: block-table row stride of a request
  int bt_width;
  const int* ks;                 // [T]: row i sees keys [ks[i], ke[i])
  const int* ke;
  int row_start;                 // rows row_start .. row_end-1; out row = row - row_start
  int row_end;
  int num_keys;
  float* out;
  long long out_stride;
  int width;                     // columns: num_keys, or max_seqlen_k when compressed
  int compressed;                // column = key - ks[row]
  int clean;                     // full width: -inf in every column a row does not see
  const long long* tile_plan;    // varlen (non-null): the tiles of `batch` requests (common.cuh)
  const int* cu_rows;            // varlen: request b owns rows [cu_rows[b], cu_rows[b + 1])
  int batch;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The row tile of rows row0 + r (r < 4, row < rend) against the paged keys of block-table row `bt` (or the
// contiguous keys), part `part` of `parts` of its key blocks. Called by all 128 WGs threads of the CTA. Key group kg (= warpgroup / (WGs / 2)) takes the blocks p_begin + kg + 2 i; its
// WGs / 2 warpgroups share them and split the rows. Sched 2: the key groups take turns issuing their wgmma
// (named barriers 3 + kg), so one's epilogue runs under the other's tensor-core work.
template <int QFp8, int Paged, int Stages, int Split, int WGs, int Sched>
__device__ __forceinline__ void prefill_row_tile(const PrefillArgs& A, const int* __restrict__ bt, int row0,
                                                 int rend, int part, int parts, unsigned char* smem_raw) {
  constexpr int R = kPrefillRows, N = R * kHeads;
  constexpr int kRowGroups = WGs / kPrefillKeyGroups;      // warpgroups per key group
  constexpr int RW = R / kRowGroups, NW = RW * kHeads;     // rows and B pairs per warpgroup
  constexpr int kGroupThreads = 128 * kRowGroups;
  static_assert((WGs == 2 || WGs == 4) && Stages >= 2 && RW % Split == 0 && (RW / Split) % 2 == 0, "config");
  constexpr int NC = NW / Split, RC = NC / 2, RPC = RW / Split;  // pairs, registers and rows per chunk
  const int num_keys = A.num_keys, width = A.width, row_start = A.row_start, row_end = rend;
  float* __restrict__ out = A.out;
  const i64 out_stride = A.out_stride;
  const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, warp = (tid >> 5) & 3;
  const int kg = wg / kRowGroups, rg = wg % kRowGroups, gtid = tid % kGroupThreads;
  const int t = lane & 3, gid = lane >> 2;
  const int valid_rows = min(R, row_end - row0);
  const float kNegInf = __int_as_float(0xff800000);

  // ---- per-row key ranges of this warpgroup's rows, and the blocks some row of the tile sees ----
  int lo[RW], hi[RW], off[RW];
  int lo_min = num_keys, hi_max = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    int l = 0, h = 0, o = 0;
    if (r < valid_rows) {
      l = max(A.ks[row0 + r], 0);
      h = min(A.ke[row0 + r], num_keys);
      o = A.compressed ? A.ks[row0 + r] : 0;
    }
    if (l < h) {
      lo_min = min(lo_min, l);
      hi_max = max(hi_max, h);
    } else {
      l = h = 0;
    }
    if (r / RW == rg) {
      lo[r % RW] = l;
      hi[r % RW] = h;
      off[r % RW] = o;
    }
  }
  int b_begin = 0, b_end = 0;
  if (lo_min < hi_max) {
    b_begin = lo_min / kPageSlots;
    b_end = (hi_max + kPageSlots - 1) / kPageSlots;
  }
  const i64 nb = b_end - b_begin;
  const int p_begin = b_begin + static_cast<int>(nb * part / parts);
  const int p_end = b_begin + static_cast<int>(nb * (part + 1) / parts);

  // ---- clean, full width: -inf in the columns outside the tile's blocks (this part's share of them) ----
  if (A.clean && !A.compressed) {
    const int c_lo = static_cast<int>(static_cast<i64>(num_keys) * part / parts);
    const int c_hi = static_cast<int>(static_cast<i64>(num_keys) * (part + 1) / parts);
    const int k_lo = b_begin * kPageSlots, k_hi = min(b_end * kPageSlots, num_keys);
    for (int r = 0; r < valid_rows; ++r) {
      float* row_out = out + static_cast<i64>(row0 + r - row_start) * out_stride;
      for (int n = c_lo + tid; n < c_hi; n += blockDim.x)
        if (n < k_lo || n >= k_hi) row_out[n] = kNegInf;
    }
  }
  if (p_begin >= p_end) return;  // CTA-uniform

  // ---- shared memory: [align][q: 2 x N x 128 B][2 key groups x stages][weights] (tiles 1024-aligned) ----
  const u32 raw_addr = static_cast<u32>(__cvta_generic_to_shared(smem_raw));
  const u32 pad = ((raw_addr + 1023u) & ~1023u) - raw_addr;
  unsigned char* sbase = smem_raw + pad;
  const u32 q_addr = raw_addr + pad;
  const u32 st_addr = q_addr + PrefillSmem<Stages>::kQBytes + static_cast<u32>(kg * Stages * kStageBytes);
  float* s_w = reinterpret_cast<float*>(sbase + PrefillSmem<Stages>::kQBytes +
                                        kPrefillKeyGroups * Stages * kStageBytes);

  // This key group's blocks: p_begin + kg + 2 i, i < cnt.
  const int cnt = max(0, (p_end - p_begin - kg + 1) / 2);
  auto block_of = [&](int i) { return p_begin + kg + 2 * i; };
  // Cache page of block j, or -1 when it must not be read (entry out of [0, P)).
  auto entry_of = [&](int j) -> int {
    if (!Paged) return j;
    if (j >= A.bt_width) return -1;
    const int e = __ldg(bt + j);
    return (e >= 0 && static_cast<i64>(e) < A.kv_pages) ? e : -1;
  };
  // Issue this thread's share of block i's copies (if it exists and may be read) into its stage; always one
  // commit group. The block-table entry is loaded one call ahead (next_entry), so no copy waits for it.
  int next_entry = cnt > 0 ? entry_of(block_of(0)) : -1;
  auto issue = [&](int i) {
    const int e = next_entry;
    if (i + 1 < cnt) next_entry = entry_of(block_of(i + 1));
    if (i < cnt) {
      const int j = block_of(i);
      const u32 dst = st_addr + static_cast<u32>(i % Stages) * kStageBytes;
      if (Paged) {
        if (e >= 0)
          copy_key_block<false, kGroupThreads>(dst, A.kv + static_cast<i64>(e) * kBf16PageBytes, kPageSlots,
                                               gtid);
      } else {
        const unsigned char* src = A.kv + static_cast<i64>(j) * kBf16PageBytes;
        const int valid = num_keys - j * kPageSlots;
        if (valid >= kPageSlots) copy_key_block<false, kGroupThreads>(dst, src, kPageSlots, gtid);
        else copy_key_block<true, kGroupThreads>(dst, src, valid, gtid);
      }
    }
    cp_async_commit();
  };

#pragma unroll
  for (int i = 0; i < Stages - 1; ++i) issue(i);
  // q (swizzled B operand, rows past row_end zero) and the permuted weights, shared by all warpgroups
  stage_q_operand<QFp8, N>(sbase, A.q, static_cast<i64>(row0) * kHeads, valid_rows * kHeads, tid, blockDim.x);
  stage_weights_permuted(s_w, A.weights, row0, R, valid_rows, tid, blockDim.x);

  const int key0 = 16 * warp + gid;  // this thread's keys in a block: +0 and +8
  // Chunk c (rows c*RPC .. of this warpgroup) of block i: each lane stores one (row, key) per row pair.
  // Invalid block-table entries are masked (their stage was not refilled).
  auto epilogue = [&](int i, int c, const float (&a)[RC]) {
    const int j = block_of(i);
    const bool live = entry_of(j) >= 0;
    const int n = j * kPageSlots + key0 + 8 * (t & 1);
#pragma unroll
    for (int pr = 0; pr < RPC / 2; ++pr) {
      const int rl = c * RPC + 2 * pr;  // first row of the pair, in this warpgroup
      const int r = rg * RW + rl;       // in the tile
      const float v = row_pair_logit(a + 64 * pr, a + 64 * pr + 32, s_w + r * kHeads, s_w + (r + 1) * kHeads, t);
      const int mine = t >> 1;          // this lane's row of the pair
      const int lo_r = mine ? lo[rl + 1] : lo[rl], hi_r = mine ? hi[rl + 1] : hi[rl];
      const int col = n - (mine ? off[rl + 1] : off[rl]);
      if (r + mine < valid_rows && n < num_keys && col >= 0 && col < width) {
        const bool seen = live && n >= lo_r && n < hi_r;
        out[static_cast<i64>(row0 + r + mine - row_start) * out_stride + col] = seen ? v : kNegInf;
      }
    }
  };

  float acc[Split][RC];
#pragma unroll
  for (int c = 0; c < Split; ++c)
#pragma unroll
    for (int k = 0; k < RC; ++k) acc[c][k] = 0.0f;
  // Per block i: all chunks issued, chunk c's epilogue after wgmma.wait_group(Split-1-c); every group retires
  // before the next block (a group in flight across the loop back-edge makes ptxas serialize, C7514).
  const int iters = Sched == 2 ? (p_end - p_begin + 1) / 2 : cnt;  // Sched 2: both key groups take turns
  const int kTurnThreads = 2 * kGroupThreads;
  if (Sched == 2 && kg == 1 && iters > 0) named_arrive(3, kTurnThreads);
  for (int i = 0; i < iters; ++i) {
    cp_async_wait<Stages - 2>();  // block i's group (this thread's copies) has landed
    fence_proxy_async_smem();     // the copies (and q, weights) -> the async proxy
    if (i == 0) __syncthreads();  // q and weights of all warpgroups
    else named_sync(1 + kg, kGroupThreads);  // the group's copies of block i; block i-1 retired by all of it
    if (Sched == 2) named_sync(3 + kg, kTurnThreads);
    const bool signal = Sched == 2 && !(kg == 1 && i == iters - 1);
    if (i < cnt) {
      const u32 a_addr = st_addr + static_cast<u32>(i % Stages) * kStageBytes;
      wgmma_fence();
#pragma unroll
      for (int c = 0; c < Split; ++c) mma_key_block<N, NC>(a_addr, q_addr, rg * NW + c * NC, acc[c]);
      if (signal) named_arrive(4 - kg, kTurnThreads);
      issue(i + Stages - 1);  // into the stage of block i-1
#pragma unroll
      for (int c = 0; c < Split; ++c) {
        wgmma_wait_dyn(Split - 1 - c);
        fence_regs<RC>(acc[c]);
        epilogue(i, c, acc[c]);
      }
    } else {
      if (signal) named_arrive(4 - kg, kTurnThreads);
      issue(i + Stages - 1);
    }
  }
  cp_async_wait<0>();
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace sm90
}  // namespace dsa
#define DSA_SM90_ARGS                                                                                       \
  const unsigned char *__restrict__ q, const float *__restrict__ weights, const unsigned char *__restrict__ kv, \
      long long kv_pages, const int *__restrict__ block_table, long long bt_stride, int bt_width,           \
      const int *__restrict__ lens, int lens_2d, int width, float *__restrict__ out, long long out_stride,   \
      int clean

// Balanced schedule: grid (C) = one wave, block 128 * KeyGroups, shared memory Smem<NextN, Stages, KeyGroups>. CTA c runs the request segments of
// its share of the batch's computed pages (plan: int64 [batch + 1], see for_each_decode_segment in
// common.cuh), q and weights re-staged per segment; with `clean` it then writes -inf over its share of the
// pages no CTA computes. The time no longer depends on the mix of lengths, only on the pages in all.
template <int QFp8, int NextN, int Stages, int MinBlocks, int Split, int KeyGroups, int Turns>
__global__ void __launch_bounds__(128 * KeyGroups, MinBlocks)
    mqa_logits_sm90_decode_kernel(DSA_SM90_ARGS, const long long* __restrict__ plan, int batch) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace dsa::sm90;
  extern __shared__ unsigned char smem_raw[];
  const Args A{q, weights, kv, kv_pages, block_table, bt_stride, bt_width, lens, lens_2d, width, out, out_stride,
               clean};
  dsa::for_each_decode_segment(plan, batch, [&](int b, int p_begin, int p_end) {
    run_pages<QFp8, NextN, Stages, Split, KeyGroups, Turns>(A, b, p_begin, p_end, smem_raw);
  });
  if (clean) dsa::fill_uncomputed_pages(plan, batch, NextN, width, out, out_stride);
#else
  __trap();
#endif
}
#undef DSA_SM90_ARGS

// Prefill of one request's query rows against its bf16 keys (contiguous [S, 128] or the paged cache through
// its block table): grid (ceil(rows / 4), parts), block 128 WGs, shared memory PrefillSmem<Stages>::kBytes.
// Varlen (tile_plan != null, Paged): the rows of `batch` requests (cu_rows, common.cuh), tile x of the plan
// holding rows of one request b only, read against its block-table row block_table + b * bt_stride; grid x
// is an upper bound of the tiles (the ones past the plan exit).
template <int QFp8, int Paged, int Stages, int Split, int WGs, int Sched>
__global__ void __launch_bounds__(128 * WGs, 1)
    mqa_logits_sm90_prefill_kernel(const unsigned char* __restrict__ q, const float* __restrict__ weights,
                                   const unsigned char* __restrict__ kv, long long kv_pages,
                                   const int* __restrict__ block_table, long long bt_stride, int bt_width,
                                   const int* __restrict__ ks, const int* __restrict__ ke, int row_start,
                                   int row_end, int num_keys, float* __restrict__ out, long long out_stride,
                                   int width, int compressed, int clean, const long long* __restrict__ tile_plan,
                                   const int* __restrict__ cu_rows, int batch) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  const dsa::sm90::PrefillArgs A{q,      weights,    kv,    kv_pages,  block_table, bt_stride, bt_width,
                                 ks,     ke,         row_start, row_end, num_keys, out,     out_stride,
                                 width,  compressed, clean, tile_plan, cu_rows,     batch};
  const int x = gridDim.x - 1 - blockIdx.x;
  static_assert(dsa::sm90::kPrefillRows == dsa::kVarlenTileRows, "varlen tiles are prefill row tiles");
  int b = 0, row0 = row_start + x * dsa::sm90::kPrefillRows, rend = row_end;  // one request: tile x
  if (tile_plan != nullptr &&
      (!Paged || !dsa::varlen_tile(tile_plan, cu_rows, batch, row_start, row_end, x, b, row0, rend)))
    return;
  dsa::sm90::prefill_row_tile<QFp8, Paged, Stages, Split, WGs, Sched>(
      A, block_table + static_cast<long long>(b) * bt_stride, row0, rend, blockIdx.y, gridDim.y, smem_raw);
#else
  __trap();
#endif
}
