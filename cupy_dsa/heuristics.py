"""Which kernel config each logits problem gets on each arch: the launch specs of ``kernels/mqa_logits.cu``
(template parameters, arguments, block size, shared memory) and the per-arch selection with the measurements
behind it, apart from the ops (``cupy_dsa.logits`` keeps the contracts, the dispatch and the references).

Every product config keeps at least ``arch.MIN_WARPS_PER_SM`` warps resident per SM on every target arch
(``tests/test_compile.py`` checks it with ptxas's registers). On the 100 KB-per-SM archs (sm_86 / sm_89 /
sm_120 / sm_121) a 4-row tile's staged q (66.5 KB) leaves room for one CTA, so the mma.sync kernels run
8 warps on it there (they share the CTA's q); elsewhere 4-warp CTAs, several per SM.
"""

from __future__ import annotations

from . import arch as arch_limits
from . import launch
from .launch import I32, I64, PTR
from .layouts import BF16_PAGE_BYTES, HEAD_DIM, N_HEADS

_SRC = "mqa_logits.cu"
_STATIC_SMEM = 96       # the row-tile kernels' static shared memory (per-row key ranges; ptxas reports it)


# --------------------------------------------------------------------------------------------------
# Kernel specs (kernels/mqa_logits.cu, kernels/mqa_logits_sm90.cuh) and the configs each problem gets
# --------------------------------------------------------------------------------------------------

# Arguments of mqa_logits_kernel (DSA_LOGITS_ARGS); the decode kernels append (plan, batch).
_ROW_TILE_ARGS = (("q", PTR), ("weights", PTR), ("kv", PTR), ("kv_pages", I64), ("block_table", PTR),
                  ("bt_tile_stride", I64), ("bt_width", I32), ("lens0", PTR), ("lens1", PTR), ("mode", I32),
                  ("row_start", I32), ("row_end", I32), ("num_keys", I32), ("out", PTR), ("out_stride", I64),
                  ("width", I32), ("compressed", I32), ("clean", I32))
_PLAN_ARGS = (("plan", PTR), ("batch", I32))


def _row_tile_bytes(rows: int) -> int:
    """dsa::logits::kRowTileSmemBytes<rows>: q as 16-bit mma quads + weights, per row of the tile."""
    return rows * (N_HEADS * HEAD_DIM * 2 + N_HEADS * 4)


def _row_tile_smem(cfg) -> int:
    return _row_tile_bytes(cfg.Rows)


def _row_tile_threads(cfg) -> int:
    return 32 * cfg.Warps


def _row_tile_smem_padded(cfg) -> int:
    """The dynamic shared memory launched with: the row tile's plus ``smem_pad`` (a bench-only host parameter
    that holds an H200 SM to another arch's CTAs per SM, ``cupy-dsa bench variants --emulate``)."""
    return _row_tile_smem(cfg) + cfg.smem_pad


# Varlen prefill (several requests per launch): the plan of mqa_logits_plan, the requests' row offsets, their count.
_VARLEN_ARGS = (("tile_plan", PTR), ("cu_rows", PTR), ("batch", I32))
_VARLEN_TILE_ROWS = 4   # dsa::kVarlenTileRows: rows per tile of a varlen launch (both prefill kernels)

PREFILL_KERNEL = launch.Kernel(
    _SRC, "mqa_logits_kernel",
    params=("KeyFp8", "QFp8", "Rows", "Warps", "MT", "Paged", "Prefetch", "L2Hint", "Mma8", "MinBlocks"),
    host={"keys_per_cta": 4096, "smem_pad": 0},   # CTAs per row tile = ceil(keys / keys_per_cta)
    args=_ROW_TILE_ARGS + _VARLEN_ARGS, threads=_row_tile_threads, smem=_row_tile_smem_padded,
    smem_check="dsa::logits::kRowTileSmemBytes<{Rows}>")
DECODE_KERNEL = launch.Kernel(
    _SRC, "mqa_logits_decode_kernel",
    params=("KeyFp8", "QFp8", "Rows", "Warps", "MT", "Prefetch", "L2Hint", "Mma8", "MinBlocks"),
    host={"smem_pad": 0},
    args=_ROW_TILE_ARGS + _PLAN_ARGS, threads=_row_tile_threads, smem=_row_tile_smem_padded,
    smem_check="dsa::logits::kRowTileSmemBytes<{Rows}>")


# The mma.sync kernels on the 100 KB archs, measured on the H200 held to sm_120's CTAs per SM (`cupy-dsa bench
# variants --emulate sm_120`, 2026-12-02, bf16 keys, fp8 q, CUDA-graph replays; us at sm_120's residency):
# 64 x 32K next_n 2: 4 warps x 2 CTAs 256.6, 8 warps 230.5 (MT 2: 223.6, register double-buffer 251.5);
# next_n 3: 4 x 2 329.5, 8 warps 306.6 (MT 2: 305.7); next_n 4: 4 warps x 1 CTA 550.5, 8 warps 385.2 (MT 2: 386.4);
# next_n 1: 4 x 2 146.5 (1.01x its H200 residency). Prefill 4K x 64K causal, 4096 keys per CTA: 4 warps 16364,
# 8 warps 12322 (MT 4: 12092; double-buffer 12609); 8 warps with 8192 / 16384 keys per CTA 11879 / 11764 (one
# resident CTA per SM drains before the next stages its q: fewer, longer CTAs); varlen extend 4 x 2K rows after
# 8K-64K: 19270 / 13761 / 12287 (16384 keys per CTA).
_SMALL_SMEM_DECODE = {2: (8, 2), 3: (8, 1), 4: (8, 1)}   # next_n -> (warps, MT) on the 100 KB archs
_SMALL_SMEM_KEYS_PER_CTA = 16384


def _mma_shape(rows: int, min_blocks_4: int, arch: str, warps: int | None = None) -> tuple[int, int]:
    """(warps per CTA, MinBlocks) of the mma.sync kernels. Warps (unless given): 4 where 4-warp CTAs keep
    MIN_WARPS_PER_SM resident (by shared memory and by the CTAs per SM that ``min_blocks_4`` guarantees
    registers for), else 8 on one CTA, which then takes the whole register file (MinBlocks 1, <= 255 per
    thread)."""
    if warps is None:
        ctas = min(arch_limits.ctas_by_smem(arch, _STATIC_SMEM + _row_tile_bytes(rows)), min_blocks_4)
        warps = 4 if rows <= 4 and 4 * ctas >= arch_limits.MIN_WARPS_PER_SM else 8
    return warps, 1 if warps == 8 else min_blocks_4


def _sm90_smem(cfg) -> int:
    """dsa::sm90::Smem<NextN, Stages, KeyGroups>::kBytes: 1 KiB alignment slack, q tiles, each key group's
    stages, weights."""
    return (1024 + cfg.NextN * N_HEADS * HEAD_DIM * 2 + cfg.KeyGroups * cfg.Stages * BF16_PAGE_BYTES
            + cfg.NextN * N_HEADS * 4)


SM90_DECODE_KERNEL = launch.Kernel(
    _SRC, "mqa_logits_sm90_decode_kernel", params=("QFp8", "NextN", "Stages", "MinBlocks", "Split", "KeyGroups", "Turns"),
    host={"ctas_per_sm": 0},       # CTAs per SM of the one-wave grid (0: as many as fit)
    args=(("q", PTR), ("weights", PTR), ("kv", PTR), ("kv_pages", I64), ("block_table", PTR), ("bt_stride", I64),
          ("bt_width", I32), ("lens", PTR), ("lens_2d", I32), ("width", I32), ("out", PTR), ("out_stride", I64),
          ("clean", I32)) + _PLAN_ARGS,
    threads=lambda cfg: 128 * cfg.KeyGroups, smem=_sm90_smem,
    smem_check="dsa::sm90::Smem<{NextN}, {Stages}, {KeyGroups}>::kBytes")
PLAN_KERNEL = launch.Kernel(
    _SRC, "paged_mqa_logits_plan_kernel",
    args=(("lens", PTR), ("lens_2d", I32), ("batch", I32), ("next_n", I32), ("plan", PTR)), threads=lambda cfg: 1024)
VARLEN_PLAN_KERNEL = launch.Kernel(
    _SRC, "mqa_logits_plan_kernel",
    args=(("cu_rows", PTR), ("batch", I32), ("row_start", I32), ("row_end", I32), ("plan", PTR)),
    threads=lambda cfg: 1024)

# Archs whose product configs every arch also declares, so that the H200 can run them under that arch's
# residency (`cupy-dsa bench variants --emulate`): the RTX PRO 6000 class this project serves.
EMULATED_ARCHS = ("sm_120",)
_ARCHS_WITH_FP8_MMA = ("sm_89", "sm_90", "sm_100", "sm_103", "sm_110", "sm_120", "sm_121")  # m16n8k32 e4m3 compiles
_LAYOUT_KEY_FP8 = {"bf16": 0, "fp8": 1, "contiguous": 0}

# sm_90 decode with bf16 keys: the wgmma kernel. next_n -> (pipeline stages, CTAs per SM, wgmma chunks), chosen
# on the H200 under the balanced schedule (2026-12-01, fp8 q, CUDA-graph replays; 64 x 32K / long-tail B=64 /
# 1 x 256K + 63 x 2K / 1 x 8K, us):
# next_n 1: (3, 3, 1) 141 / 111 / 34.9 / 5.1; (4, 2, 1) 152 / 123 / 35.4 / 5.1; (2, 4, 1) 140 / 109 / 34.2 / 5.6;
#           mma.sync 140 / 109 / 35.5 / 6.7.
# next_n 2: (2, 3, 1) 170 / 131 / 41.7 / 7.0; (3, 2, 1) 187 / 154 / 46.1 / 6.7; mma.sync 199 / 152 / 50.9 / 9.5.
# next_n 3: (2, 2, 3) 263 / 214 / 62.6 / 8.4; (3, 2, 3) 268 / 218 / 64.4 / 8.4; mma.sync 275 / 212 / 66.4 / 11.1.
# next_n 4: (2, 2, 2) 279 / 237 / 69.5 / 9.6; (2, 2, 4) 323 / 263 / 78.2 / 9.9; mma.sync 377 / 285 / 91.4 / 14.1.
# Verify (next_n 2-4): two key groups per CTA share the staged q (KeyGroups 2) and take a segment's pages
# alternately, free-running (Turns 0) or taking turns at the tensor cores (Turns 1). next_n -> (stages per group,
# CTAs per SM, chunks, key groups, turns). H200, 2026-12-02, lengths 2-D as C4 verify rows, rotating buffers, us
# at 64 x 32K / 128 x 8K / 48 long-tail (median 64K) / 256 x 2K, two runs (a second figure is the second run's):
# next_n 2: one group (2, 3, 1, 1, 0) 170 / 92 / 354 / 53; (2, 2, 1, 2, 1) 165 / 85 / 342-344 / 48-49;
#           (2, 2, 1, 2, 0) 163 / 87 / 339 / 49; 3-4 stages, 1 CTA: 180-192 / 97-103 / 376-400 / 57-61.
# next_n 3: one group (2, 2, 3, 1, 0) 258 / 141 / 530 / 78; (2, 1, 1, 2, 1) 224-228 / 117-121 / 446-464 / 69;
#           (2, 1, 1, 2, 0) 215 / 116 / 462 / 69; 3-4 stages 229-237 / 117-126 / 466-486 / 71-74; chunks 3: 258.
# next_n 4: one group (2, 2, 2, 1, 0) 290 / 156 / 585 / 87; (2, 1, 1, 2, 1) 274-288 / 139-141 / 562-570 / 82-85;
#           (2, 1, 1, 2, 0) 273 / 150 / 599 / 88; (3, 1, 1, 2, 1) 273 / 143 / 564 / 83; chunks 2 / 4: 288 / 320.
_SM90_CONFIG = {1: (3, 3, 1, 1, 0), 2: (2, 2, 1, 2, 0), 3: (2, 1, 1, 2, 0), 4: (2, 1, 1, 2, 1)}
_SM90_SMEM_PER_SM = 227 * 1024   # sm_90's shared memory per SM for CTAs (1 KiB of it is reserved per CTA)


def _sm90_decode(q_fp8: int, next_n: int, ctas_per_sm: int | None = None, config=None):
    stages, ctas, split, key_groups, turns = config or _SM90_CONFIG[next_n]
    return SM90_DECODE_KERNEL.config(QFp8=q_fp8, NextN=next_n, Stages=stages, MinBlocks=ctas, Split=split,
                                     KeyGroups=key_groups, Turns=turns,
                                     ctas_per_sm=ctas if ctas_per_sm is None else ctas_per_sm)


def _sm90_verify_variants(next_n: int):
    """The sm_90 decode configs tried for next_n >= 2: one key group (the previous product, several CTAs per
    SM, wgmma chunks) and two key groups with 2-4 stages each, taking turns or free-running, as many CTAs as
    shared memory holds (<= 2). Chunks (Split > 1) with two key groups lost 5-20% everywhere (H200,
    2026-12-02) and are not declared."""
    yield {2: (2, 3, 1, 1, 0), 3: (2, 2, 3, 1, 0), 4: (2, 2, 2, 1, 0)}[next_n]
    q_bytes = 1024 + next_n * N_HEADS * (HEAD_DIM * 2 + 4)
    for stages in (2, 3, 4):
        ctas = min(2, _SM90_SMEM_PER_SM // (q_bytes + 2 * stages * BF16_PAGE_BYTES + 1024))
        for turns in (1, 0):
            yield stages, ctas, 1, 2, turns


# (key_fp8, rows) of the mma.sync decode that need more than 168 registers (MinBlocks 2), by arch family
# (ptxas, CUDA 13: sm_100 / sm_120 spill ~100 B at 168 registers for one bf16 row).
_DECODE_WIDE_TILES = {"sm_10": ((0, 1), (1, 2), (1, 4)), "sm_12": ((0, 1), (1, 2), (1, 4))}


def _decode_min_blocks(key_fp8: int, rows: int, prefetch: int, arch: str) -> int:
    """Resident 4-warp CTAs per SM asked of ptxas (register cap 65536 / (128 * MinBlocks)): the most that
    compile without a spill (tests/test_compile.py checks every product config). fp8 keys keep raw bytes and
    expanded words live together and the register double-buffer holds two tiles; sm_90 fits one- and two-row
    bf16 tiles in 128 registers, the other targets in 168 except the wide tiles above."""
    if prefetch:
        return 2
    if (key_fp8, rows) in _DECODE_WIDE_TILES.get(arch[:5], ()):
        return 2
    if rows <= 2 and not key_fp8 and arch == "sm_90":
        return 4
    return 3


def _mma_decode(key_fp8: int, q_fp8: int, rows: int, arch: str, *, prefetch: int = 0, l2_hint: int | None = None,
                mma8: int = 0, warps: int | None = None, mt: int = 1):
    # L2 prefetch size of the key loads: 128 B for next_n 1 with fp8 q (H200, 64 x 32K bf16: 128 B 142.9 us,
    # 256 B 145.5 us, none 151.3 us), 256 B elsewhere
    if l2_hint is None:
        l2_hint = 1 if (q_fp8 and rows == 1) else 2
    warps, min_blocks = _mma_shape(rows, _decode_min_blocks(key_fp8, rows, prefetch, arch), arch, warps)
    return DECODE_KERNEL.config(KeyFp8=key_fp8, QFp8=q_fp8, Rows=rows, Warps=warps, MT=mt, Prefetch=prefetch,
                                L2Hint=l2_hint, Mma8=mma8, MinBlocks=min_blocks)


def _select_decode(problem, arch):
    layout, q_fp8, next_n = problem
    if layout == "bf16" and arch == "sm_90":
        return _sm90_decode(q_fp8, next_n)
    if arch_limits.small_smem(arch) and next_n in _SMALL_SMEM_DECODE:
        warps, mt = _SMALL_SMEM_DECODE[next_n]
        return _mma_decode(_LAYOUT_KEY_FP8[layout], q_fp8, next_n, arch, warps=warps, mt=mt)
    return _mma_decode(_LAYOUT_KEY_FP8[layout], q_fp8, next_n, arch)


def _decode_serves(cfg, problem) -> bool:
    layout, q_fp8, next_n = problem
    if cfg.kernel is SM90_DECODE_KERNEL:
        return layout == "bf16" and cfg.QFp8 == q_fp8 and cfg.NextN == next_n
    return cfg.KeyFp8 == _LAYOUT_KEY_FP8[layout] and cfg.QFp8 == q_fp8 and cfg.Rows == next_n


def _decode_experimental(arch):
    for layout, q_fp8, next_n in DECODE.problems:
        kf = _LAYOUT_KEY_FP8[layout]
        yield _mma_decode(kf, q_fp8, next_n, arch)          # sm_90 bf16 keys: the mma.sync kernel
        if not kf:
            yield _mma_decode(kf, q_fp8, next_n, arch, prefetch=1)   # register double-buffer of the next tile
        if q_fp8 and next_n == 1:
            for hint in (0, 1, 2):                           # L2 prefetch size: none, 128 B, 256 B
                yield _mma_decode(kf, q_fp8, next_n, arch, l2_hint=hint)
        if kf and q_fp8 and arch in _ARCHS_WITH_FP8_MMA:     # e4m3 mma.sync (native on sm_89 / sm_120+)
            yield _mma_decode(kf, q_fp8, next_n, arch, mma8=1)
        if layout == "bf16" and arch == "sm_90":
            yield _sm90_decode(q_fp8, next_n, ctas_per_sm=1)  # a smaller wave: other segment cuts
            if next_n >= 2 and q_fp8:
                for config in _sm90_verify_variants(next_n):
                    yield _sm90_decode(q_fp8, next_n, config=config)
        if next_n >= 2 and q_fp8:                            # one 8-warp CTA: 4 or 8 live accumulator chains,
            for mt in (1, 2):                                # and the register double-buffer of the next tile
                yield _mma_decode(kf, q_fp8, next_n, arch, warps=8, mt=mt)
            yield _mma_decode(kf, q_fp8, next_n, arch, warps=8, prefetch=1)
        for target in EMULATED_ARCHS:                        # another arch's product config, forced here by
            yield _select_decode((layout, q_fp8, next_n), target)   # `bench variants --emulate` and the tests


DECODE = launch.register(launch.Family(
    "paged_mqa_logits", problems=[(layout, q_fp8, next_n) for layout in ("bf16", "fp8") for q_fp8 in (1, 0)
                                  for next_n in (1, 2, 3, 4)],
    select=_select_decode, serves=_decode_serves, experimental=_decode_experimental))

PLAN = launch.register(launch.Family(
    "paged_mqa_logits_plan", problems=[()], select=lambda problem, arch: PLAN_KERNEL.config(),
    serves=lambda cfg, problem: True))
VARLEN_PLAN = launch.register(launch.Family(
    "mqa_logits_plan", problems=[()], select=lambda problem, arch: VARLEN_PLAN_KERNEL.config(),
    serves=lambda cfg, problem: True))


# sm_90 prefill with bf16 keys (contiguous or paged): the wgmma kernel of kernels/mqa_logits_sm90.cuh, 4 query
# rows per CTA. (Stages, Split, WGs, Sched) = key stages per key group, wgmma chunks per warpgroup, warpgroups
# (two key groups of WGs / 2), schedule (2: the key groups take turns issuing, 0: free-running). Chosen on the
# H200 (2026-12-01, fp8 q, causal, CUDA-graph replays; % of the bf16 matmul measured in the same run at
# 4K x 64K contiguous / paged, 1K x 16K, 8K x 128K): (4, 1, 2, 2) 69.8 / 69.2 / 65.1 / 69.2;
# (4, 1, 4, 2) 68.5 / 63.5 / 65.5 / 65.1; (4, 1, 4, 0) 66.0 / 65.6 / 62.9 / 65.6; (4, 2, 2, 2) 66.5 / 60.6 /
# 62.3 / 66.2; (3, 1, 4, 2) and (5, 1, 4, 2) within 1% of (4, 1, 4, 2); the mma.sync kernel 54.1 / 52.6 / 50.9 /
# 53.7. It is also the faster one for short prompts (8 x 64K: 23.6 vs 128.7 us; 64 x 64K: 182 vs 188 us).
_SM90_PREFILL_ROWS = 4
_SM90_PREFILL_CONFIG = (4, 1, 2, 2)


def _sm90_prefill_smem(cfg) -> int:
    """dsa::sm90::PrefillSmem<Stages>::kBytes: alignment slack, q tile, two key groups' stages, weights."""
    return (1024 + _SM90_PREFILL_ROWS * N_HEADS * HEAD_DIM * 2 + 2 * cfg.Stages * BF16_PAGE_BYTES
            + _SM90_PREFILL_ROWS * N_HEADS * 4)


SM90_PREFILL_KERNEL = launch.Kernel(
    _SRC, "mqa_logits_sm90_prefill_kernel", params=("QFp8", "Paged", "Stages", "Split", "WGs", "Sched"),
    host={"parts": 0},             # CTAs per 4-row tile (0: enough to fill a few waves)
    args=(("q", PTR), ("weights", PTR), ("kv", PTR), ("kv_pages", I64), ("block_table", PTR), ("bt_stride", I64),
          ("bt_width", I32), ("ks", PTR), ("ke", PTR), ("row_start", I32), ("row_end", I32), ("num_keys", I32),
          ("out", PTR), ("out_stride", I64), ("width", I32), ("compressed", I32), ("clean", I32)) + _VARLEN_ARGS,
    threads=lambda cfg: 128 * cfg.WGs, smem=_sm90_prefill_smem, smem_check="dsa::sm90::PrefillSmem<{Stages}>::kBytes")


def _sm90_prefill(layout: str, q_fp8: int, config=_SM90_PREFILL_CONFIG, parts: int = 0):
    stages, split, wgs, sched = config
    return SM90_PREFILL_KERNEL.config(QFp8=q_fp8, Paged=int(layout != "contiguous"), Stages=stages, Split=split,
                                      WGs=wgs, Sched=sched, parts=parts)


def _prefill(layout: str, q_fp8: int, arch: str, *, rows: int = 4, prefetch: int = 0, mma8: int = 0,
             keys_per_cta: int = 4096, warps: int | None = None, mt: int | None = None):
    # 4 rows per CTA (H200: 422 TFLOP/s at 4K x 64K with 4 warps, 3 CTAs per SM) over 8 (8 warps, ~129 KiB of
    # shared memory, which sm_86 / sm_89 / sm_120 do not have; 376 TFLOP/s there); 4096 keys per CTA.
    warps, min_blocks = _mma_shape(rows, 2 if prefetch else 3, arch, warps)
    if mt is None:
        mt = 2 if rows > 4 else 1
    return PREFILL_KERNEL.config(KeyFp8=_LAYOUT_KEY_FP8[layout], QFp8=q_fp8, Rows=rows, Warps=warps, MT=mt,
                                 Paged=int(layout != "contiguous"), Prefetch=prefetch, L2Hint=2, Mma8=mma8,
                                 MinBlocks=min_blocks, keys_per_cta=keys_per_cta)


# Prefill with q held in registers (mqa_logits_qreg_kernel): one warp per query row, 8 rows per CTA sharing a
# Stages-deep cp.async ring of 64-key chunks read with ldmatrix, persistent CTAs (one wave) walking work items of
# keys_per_item keys. (Stages, NT): ring depth; n-tiles per pass over the k-steps (NT 4: the 64 accumulators of
# a 32-key tile live; NT 2: two 16-key passes, each reading its B fragments once for all 4 head m-tiles). bf16
# keys, one request (varlen keeps the 4-row tiles). H200 at sm_120's residency (1 x 8 warps), 4K x 64K causal,
# fp8 q, two runs on 2026-12-04 (TFLOP/s; % of the bf16 mma.sync ceiling measured in the same run, 626 at 8
# warps/SM both times): (4, 2) 386 / 395 (62 / 63%); (4, 4) 388 / 397; (3, 2) 402 / 394; (6, 2) 392; (4, 2) with
# 8192 keys per item 389 / 400; the 4-row-tile config it replaced 364 / 360 (58%); the H200's own wgmma product
# 561 / 572. Slower (second run): both halves of a chunk in one branch-free block 368, an mbarrier ring letting
# the warps drift 376-379, both 345 (see the kernel).
QREG_PREFILL_ROWS = 8
_QREG_CONFIG = {"contiguous": (4, 2), "bf16": (4, 2)}   # layout -> (Stages, NT)
_QREG_EXPERIMENTAL = ((3, 2), (4, 4), (6, 2))
_QREG_CHUNK_BYTES = 64 * HEAD_DIM * 2                  # dsa::logits::kChunkBytes: one ring stage


def _qreg_smem(cfg) -> int:
    """dsa::logits::kQregSmemBytes<Stages> plus the bench's smem_pad."""
    return cfg.Stages * _QREG_CHUNK_BYTES + cfg.smem_pad


QREG_PREFILL_KERNEL = launch.Kernel(
    _SRC, "mqa_logits_qreg_kernel", params=("QFp8", "Paged", "Stages", "NT"),
    host={"keys_per_item": 4096, "smem_pad": 0},   # keys of one work item (a multiple of 64)
    args=_ROW_TILE_ARGS + (("tiles", I32), ("chunks_per_item", I32)),
    threads=lambda cfg: 32 * QREG_PREFILL_ROWS, smem=_qreg_smem, smem_check="dsa::logits::kQregSmemBytes<{Stages}>")


def _qreg_prefill(layout: str, q_fp8: int, config=None):
    stages, nt = config or _QREG_CONFIG[layout]
    return QREG_PREFILL_KERNEL.config(QFp8=q_fp8, Paged=int(layout != "contiguous"), Stages=stages, NT=nt)


def _select_prefill(problem, arch):
    layout, q_fp8, varlen = problem
    if layout != "fp8" and arch == "sm_90":
        return _sm90_prefill(layout, q_fp8)
    if arch_limits.small_smem(arch):
        if layout != "fp8" and not varlen:
            return _qreg_prefill(layout, q_fp8)
        return _prefill(layout, q_fp8, arch, keys_per_cta=_SMALL_SMEM_KEYS_PER_CTA)
    return _prefill(layout, q_fp8, arch)


def previous_small_smem_prefill(problem, arch):
    """The 100 KB archs' prefill config before the q-in-registers kernel (8 warps sharing a 4-row tile's staged
    q, 16384 keys per CTA): `bench variants --emulate` times it beside the product."""
    layout, q_fp8, _ = problem
    return _prefill(layout, q_fp8, arch, keys_per_cta=_SMALL_SMEM_KEYS_PER_CTA)


def _prefill_serves(cfg, problem) -> bool:
    layout, q_fp8, varlen = problem
    if cfg.kernel is QREG_PREFILL_KERNEL:
        return layout != "fp8" and not varlen and cfg.QFp8 == q_fp8 and cfg.Paged == int(layout != "contiguous")
    if cfg.kernel is SM90_PREFILL_KERNEL:
        return layout != "fp8" and cfg.QFp8 == q_fp8 and cfg.Paged == int(layout != "contiguous")
    return (cfg.KeyFp8 == _LAYOUT_KEY_FP8[layout] and cfg.QFp8 == q_fp8
            and cfg.Paged == int(layout != "contiguous") and (not varlen or cfg.Rows == _VARLEN_TILE_ROWS))


_SM90_PREFILL_EXPERIMENTAL = ((4, 1, 4, 2), (4, 1, 4, 0), (4, 2, 2, 2), (3, 1, 2, 2))


def _prefill_experimental(arch):
    for layout, q_fp8, varlen in PREFILL.problems:
        if varlen:
            continue  # the same configs as the single-request problem (4-row tiles)
        if layout != "fp8" and arch == "sm_90":
            for config in _SM90_PREFILL_EXPERIMENTAL:
                yield _sm90_prefill(layout, q_fp8, config)
            yield _sm90_prefill(layout, q_fp8, parts=1)  # one CTA per tile: other cuts of the key blocks
        for rows in (4, 8):
            for keys_per_cta in (2048, 4096, 8192):
                yield _prefill(layout, q_fp8, arch, rows=rows, keys_per_cta=keys_per_cta)
                if layout == "contiguous" and rows == 8:      # register double-buffer of the next key tile
                    yield _prefill(layout, q_fp8, arch, rows=rows, prefetch=1, keys_per_cta=keys_per_cta)
            if layout == "fp8" and q_fp8 and arch in _ARCHS_WITH_FP8_MMA:
                yield _prefill(layout, q_fp8, arch, rows=rows, mma8=1)
        if q_fp8:
            for warps, mt in ((4, 1), (8, 1), (8, 2), (8, 4)):   # 4-row tiles: warps sharing q x live m-tiles
                yield _prefill(layout, q_fp8, arch, warps=warps, mt=mt)
            yield _prefill(layout, q_fp8, arch, warps=8, prefetch=1)  # 8 warps, register double-buffer
        if layout != "fp8" and q_fp8:                        # q in registers: see _QREG_EXPERIMENTAL
            for config in _QREG_EXPERIMENTAL:
                yield _qreg_prefill(layout, q_fp8, config)
        for target in EMULATED_ARCHS:
            yield _select_prefill((layout, q_fp8, varlen), target)
            if layout != "contiguous":                      # varlen keeps the 4-row tiles there
                yield _select_prefill((layout, q_fp8, 1), target)


# Problems: (key layout, q fp8, varlen); varlen = several requests' rows in one launch (paged caches only).
PREFILL = launch.register(launch.Family(
    "mqa_logits", problems=[(layout, q_fp8, varlen) for layout in ("contiguous", "bf16", "fp8") for q_fp8 in (1, 0)
                            for varlen in (0, 1) if not (varlen and layout == "contiguous")],
    select=_select_prefill, serves=_prefill_serves, experimental=_prefill_experimental))


def product_instantiations(arch: str, *, q_fp8=(1,), next_ns=(1,), layouts=("bf16",)) -> list[str]:
    """The name expressions (of ``mqa_logits.cu``) that decode and paged prefill launch on ``arch`` for these q
    dtypes (1 = fp8, 0 = bf16), next_n values and cache layouts: what a server warms up (the rest compiles on
    first use)."""
    ex = [PLAN.select((), arch).expr, VARLEN_PLAN.select((), arch).expr]
    for layout in layouts:
        for qf in q_fp8:
            ex += [DECODE.select((layout, qf, nn), arch).expr for nn in next_ns]
            ex += [PREFILL.select((layout, qf, varlen), arch).expr
                   for varlen in ((0,) if layout == "contiguous" else (0, 1))]
    return list(dict.fromkeys(ex))


