"""Per-arch SM limits as data, and the residency of a kernel config under them.

Every product config must keep at least :data:`MIN_WARPS_PER_SM` warps resident per SM on every target arch
(by shared memory, threads, CTA slots and registers), so that the memory latency of its key loads is hidden
by other warps; ``tests/test_compile.py`` checks it with ptxas's register count of each config and names the
limit that binds. The figures are NVIDIA's per-compute-capability limits (the CUDA programming guide's
table of technical specifications, libcu++'s ``arch_traits``): shared memory per SM and the opt-in maximum per
block, the 1 KiB the driver reserves per resident block, threads and CTAs per SM, and a 64K-register file
split over four SM sub-partitions, allocated per warp in units of 256 registers.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1024
MIN_WARPS_PER_SM = 8          # the residency rule of every product config
_REG_ALLOC_UNIT = 256         # registers per warp are allocated in units of 256
_SUB_PARTITIONS = 4           # the register file is split over 4 schedulers; a warp lives in one


@dataclass(frozen=True)
class ArchLimits:
    smem_per_sm: int           # bytes of shared memory per SM (the carve-out maximum)
    smem_per_block: int        # opt-in maximum of one block (static + dynamic)
    max_threads: int           # resident threads per SM
    max_ctas: int              # resident CTAs per SM
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    smem_reserved_per_block: int = KIB   # reserved by the driver for every resident block (sm_80+)


ARCH_LIMITS: dict[str, ArchLimits] = {
    "sm_80": ArchLimits(164 * KIB, 163 * KIB, 2048, 32),    # A100
    "sm_86": ArchLimits(100 * KIB, 99 * KIB, 1536, 16),     # RTX 30xx, A10, A40
    "sm_89": ArchLimits(100 * KIB, 99 * KIB, 1536, 24),     # L4, L40S, RTX 40xx
    "sm_90": ArchLimits(228 * KIB, 227 * KIB, 2048, 32),    # H100, H200
    "sm_100": ArchLimits(228 * KIB, 227 * KIB, 2048, 32),   # B200, GB200
    "sm_103": ArchLimits(228 * KIB, 227 * KIB, 2048, 32),   # B300, GB300
    "sm_120": ArchLimits(100 * KIB, 99 * KIB, 1536, 24),    # RTX PRO 6000 Blackwell, RTX 50xx
    "sm_121": ArchLimits(100 * KIB, 99 * KIB, 1536, 24),    # DGX Spark (GB10)
}


def limits(arch: str) -> ArchLimits:
    try:
        return ARCH_LIMITS[arch]
    except KeyError:
        raise ValueError(f"arch: expected one of {', '.join(ARCH_LIMITS)}, got {arch!r}") from None


def has_clusters(arch: str) -> bool:
    """Thread-block clusters and distributed shared memory (sm_90 and later)."""
    limits(arch)  # a known arch
    return int(arch.split("_")[1]) >= 90


def small_smem(arch: str) -> bool:
    """The 100 KB-per-SM archs (sm_86 / sm_89 / sm_120 / sm_121), where a 66 KB CTA is alone on its SM."""
    return limits(arch).smem_per_sm <= 100 * KIB


@dataclass(frozen=True)
class Residency:
    ctas: int                  # resident CTAs per SM
    warps: int                 # resident warps per SM
    binding: str               # the limit that sets `ctas`
    by_limit: dict             # CTAs per SM each limit alone allows

    def __str__(self):
        return f"{self.ctas} CTA x {self.warps // max(self.ctas, 1)} warps = {self.warps} warps ({self.binding})"


def ctas_by_smem(arch: str, smem_bytes: int) -> int:
    """CTAs per SM that ``smem_bytes`` (static + dynamic) of shared memory each allow; 0 when one is too big."""
    lim = limits(arch)
    if smem_bytes > lim.smem_per_block:
        return 0
    return lim.smem_per_sm // (smem_bytes + lim.smem_reserved_per_block)


def residency(arch: str, *, threads: int, smem_bytes: int, registers: int | None = None) -> Residency:
    """Resident CTAs and warps per SM of a kernel config on ``arch``: ``threads`` per CTA, ``smem_bytes`` of
    shared memory per CTA (static + dynamic), ``registers`` per thread (ptxas's count; None: not limiting)."""
    lim = limits(arch)
    warps_per_cta = -(-threads // 32)
    by = {"shared memory": ctas_by_smem(arch, smem_bytes), "threads": lim.max_threads // threads,
          "CTA slots": lim.max_ctas}
    if registers is not None:
        if registers > lim.max_regs_per_thread:
            by["registers"] = 0
        else:
            per_warp = -(-registers * 32 // _REG_ALLOC_UNIT) * _REG_ALLOC_UNIT
            warps = _SUB_PARTITIONS * ((lim.regs_per_sm // _SUB_PARTITIONS) // per_warp) if per_warp else 1 << 30
            by["registers"] = warps // warps_per_cta
    binding = min(by, key=lambda k: by[k])
    ctas = by[binding]
    return Residency(ctas, ctas * warps_per_cta, binding, by)
