"""The indexer's top-k in SGLang's output form (``cupy_dsa.topk``): the reference against brute force, SGLang's
trivial rows and slot transform, ties, bad input (CPU); the kernel against the reference on mixed lengths, rows in
and out of the shared-memory cache, ties and junk past the lengths, bitwise reruns and CUDA-graph replay (GPU)."""
import pytest
import torch

import cupy_dsa
from cupy_dsa import arch as arch_limits
from cupy_dsa import topk
from cupy_dsa.layouts import PAGE_SLOTS


def _case(R, width, seed, lens=None, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, width, generator=g)
    if ties:
        logits = torch.round(logits * 4) / 4          # many exact ties, straddling every digit
    if lens is None:
        lens = torch.randint(0, width + 200, (R,), generator=g)
    lens = torch.as_tensor(lens, dtype=torch.int32)
    pages = -(-width // PAGE_SLOTS)
    table = torch.randint(0, 1 << 20, (R, pages), generator=g, dtype=torch.int32)
    return logits, lens, table


def _brute(logits, lens, table, k):
    """Per row: SGLang's trivial rows, else the k greatest logits (stable: ties to the lower position), sorted
    by position, through the slot transform."""
    R, width = logits.shape
    pages, raws = [], []
    for r in range(R):
        n = max(0, min(int(lens[r]), width, table.shape[1] * PAGE_SLOTS))
        if n <= k:
            sel = list(range(n))
        else:
            order = sorted(range(n), key=lambda i: (-float(logits[r, i]), i))
            sel = sorted(order[:k])
        raws.append(sel + [-1] * (k - len(sel)))
        pages.append([int(table[r, i // PAGE_SLOTS]) * PAGE_SLOTS + i % PAGE_SLOTS for i in sel] + [-1] * (k - len(sel)))
    return torch.tensor(pages, dtype=torch.int32), torch.tensor(raws, dtype=torch.int32)


@pytest.mark.parametrize("ties", [False, True])
def test_reference_equals_brute_force(ties):
    logits, lens, table = _case(9, 300, seed=3, lens=[0, 1, 16, 17, 100, 299, 300, 301, 5000], ties=ties)
    got = topk.paged_topk_reference(logits, lens, table, 16, raw_indices=True)
    want_pages, want_raw = _brute(logits, lens, table, 16)
    assert torch.equal(got.raw_indices, want_raw)
    assert torch.equal(got.page_indices, want_pages)


def test_trivial_rows_read_no_logits():
    """A row that sees at most index_topk keys selects 0 .. n - 1 whatever its logits hold (NaN included)."""
    logits = torch.full((2, 128), float("nan"))
    table = torch.tensor([[7, 9], [3, 4]], dtype=torch.int32)
    got = cupy_dsa.paged_topk(logits, torch.tensor([3, 70], dtype=torch.int32), table, 80, raw_indices=True)
    assert got.raw_indices[0].tolist() == [0, 1, 2] + [-1] * 77
    assert got.page_indices[1, :3].tolist() == [3 * 64, 3 * 64 + 1, 3 * 64 + 2]
    assert got.page_indices[1, 64:66].tolist() == [4 * 64, 4 * 64 + 1]
    assert got.page_indices[1, 70:].tolist() == [-1] * 10


def test_ties_go_to_the_lower_position_and_positions_past_the_table_are_never_seen():
    logits = torch.zeros(1, 256)
    logits[0, 200:] = 5.0                       # past the table's one page: never visible
    table = torch.tensor([[2]], dtype=torch.int32)
    got = topk.paged_topk_reference(logits, torch.tensor([256], dtype=torch.int32), table, 8, raw_indices=True)
    assert got.raw_indices[0].tolist() == list(range(8))
    assert got.page_indices[0].tolist() == [128 + i for i in range(8)]


def test_raw_indices_only_when_asked():
    logits, lens, table = _case(2, 100, seed=1)
    assert topk.paged_topk(logits, lens, table, 8).raw_indices is None


@pytest.mark.parametrize("arch", sorted(arch_limits.ARCH_LIMITS))
def test_select_cluster_keeps_its_ctas_resident_and_their_slices_long(arch):
    """A cluster per row only where the arch has clusters, only of a portable size, with every CTA of the launch
    resident at once (by the slice config's shared memory on that arch) and at least CLUSTER_MIN_SLICE keys each."""
    static = topk._SELECT_STATIC_SMEM
    for n_sms in (20, 132, 188):
        for rows in (1, 8, 48, 64, 144, 2048):
            for width in (2048, 6144, 24576, 65536, 262144):
                c = topk.select_cluster(width, rows, n_sms, arch)
                if c == 1:
                    continue
                assert arch_limits.has_clusters(arch) and c in topk.CLUSTER_SIZES
                assert width >= c * topk.CLUSTER_MIN_SLICE
                cfg = topk.TOPK.select(topk.row_select_problem(width, rows, n_sms, arch), arch)
                per_sm = arch_limits.ctas_by_smem(arch, topk.row_select_smem(cfg) + static)
                assert cfg.Cluster == c and rows * c <= per_sm * n_sms, (arch, n_sms, rows, width, c, per_sm)


def test_select_cluster_takes_the_h100_measured_choices():
    """The picks the H100 timings in cupy_dsa/topk.py support: one CTA for 6K-key rows (a cluster costs more there),
    4 CTAs at 48 x 24K, 8 for one 64K row; on sm_120 (one cluster CTA per SM) half as many at 48 x 24K."""
    pick = lambda width, rows, n_sms=132, arch="sm_90": topk.select_cluster(width, rows, n_sms, arch)
    assert (pick(6144, 48), pick(6144, 144), pick(24576, 48), pick(65536, 1)) == (1, 1, 4, 8)
    assert (topk.cluster_ctas_per_sm("sm_90"), topk.cluster_ctas_per_sm("sm_120")) == (2, 1)
    assert pick(24576, 48, 188, "sm_120") == 2 and pick(65536, 1, arch="sm_80") == 1


@pytest.mark.parametrize("call,match", [
    (lambda l, n, t: topk.paged_topk(l.double(), n, t, 8), r"^logits: expected .*float32"),
    (lambda l, n, t: topk.paged_topk(l[0], n, t, 8), r"^logits: expected shape \[rows, width\]"),
    (lambda l, n, t: topk.paged_topk(l.t(), n[:1].expand(100).contiguous(), t, 8), r"^logits: expected stride"),
    (lambda l, n, t: topk.paged_topk(l, n.long(), t, 8), r"^lens: expected .*int32"),
    (lambda l, n, t: topk.paged_topk(l, n[:1], t, 8), r"^lens: expected shape \(2,\)"),
    (lambda l, n, t: topk.paged_topk(l, n, t.long(), 8), r"^page_table: expected .*int32"),
    (lambda l, n, t: topk.paged_topk(l, n, t[:1], 8), r"^page_table: expected shape \[2, pages\]"),
    (lambda l, n, t: topk.paged_topk(l, n, t, 0), r"^index_topk"),
    (lambda l, n, t: topk.paged_topk(l, n, t, 8, raw_indices=1), r"^raw_indices: expected a bool"),
    (lambda l, n, t: topk.paged_topk([1.0], n, t, 8), r"^logits: expected a torch.Tensor"),
])
def test_bad_input_names_the_argument(call, match):
    logits, lens, table = _case(2, 100, seed=0)
    with pytest.raises((TypeError, ValueError), match=match):
        call(logits, lens, table)


# --------------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------------

def _force_cluster(monkeypatch, ctas):
    """CTAs per row of the select (topk.select_cluster): None keeps the heuristic's (a cluster for these few rows on
    sm_90+); 1 one CTA per row; 2 / 8 a cluster of that many (one CTA where the GPU has no clusters)."""
    if ctas is not None:
        monkeypatch.setattr(topk, "select_cluster", lambda width, rows, n_sms, arch: ctas)


@pytest.mark.gpu
@pytest.mark.parametrize("width,k", [(300, 16), (6144, 512), (16384, 512), (24576, 1024), (65536, 512),
                                     (20000, 2048)])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("ctas", [None, 1, 2, 8])
def test_gpu_equals_the_reference(seed, width, k, ties, ctas, monkeypatch):
    """Mixed lengths (0, below, at and above k, past the width), rows in the shared-memory cache and past it, by
    one CTA and by clusters of CTAs per row (slices of 16 keys to past the slice cache), junk past each row's
    length: every element equals the reference's (ties: the k-th key's bin past what is collected, read from the
    row by every CTA of a cluster)."""
    _force_cluster(monkeypatch, ctas)
    R = 7
    logits, _, table = _case(R, width, seed % 100000, ties=ties)
    lens = torch.tensor([0, k - 1, k, k + 1, width // 3 + 1, width, width + 50], dtype=torch.int32)
    for r in range(R):
        logits[r, max(0, int(lens[r])):] = 1e30                 # never visible: never selected
    want = topk.paged_topk_reference(logits, lens, table, k, raw_indices=True)
    d = [t.cuda() for t in (logits, lens, table)]
    got = topk.paged_topk(*d, k, raw_indices=True)
    assert torch.equal(got.raw_indices.cpu(), want.raw_indices), f"seed {seed}"
    assert torch.equal(got.page_indices.cpu(), want.page_indices), f"seed {seed}"
    again = topk.paged_topk(*d, k, raw_indices=True)
    assert all(torch.equal(x, y) for x, y in zip(got, again)), f"seed {seed}: rerun differs"


@pytest.mark.gpu
def test_gpu_offset_rows_and_unaligned_strides(seed):
    """A logits view whose rows start at every 4-byte offset of a 16-byte line (the kernel's vector loads begin
    after a scalar head), and a page table with extra columns."""
    R, width, k = 5, 9001, 256
    base, lens, table = _case(R, width + 3, seed % 100000)
    lens = torch.full((R,), width, dtype=torch.int32)
    for off in range(4):
        logits = base[:, off:off + width]
        want = topk.paged_topk_reference(logits, lens, table, k, raw_indices=True)
        got = topk.paged_topk(base.cuda()[:, off:off + width], lens.cuda(), table.cuda(), k, raw_indices=True)
        assert torch.equal(got.raw_indices.cpu(), want.raw_indices), f"seed {seed}, offset {off}"
        assert torch.equal(got.page_indices.cpu(), want.page_indices), f"seed {seed}, offset {off}"


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay(seed):
    from cupy_dsa.bench.timing import capture_graph

    R, width, k = 48, 6144, 512
    logits, lens, table = _case(R, width, seed % 100000)
    s_logits, s_lens, s_table = logits.cuda(), lens.cuda(), table.cuda()
    cupy_dsa.warm_up()
    graph, out = capture_graph(lambda: topk.paged_topk(s_logits, s_lens, s_table, k, raw_indices=True))
    for trial in range(3):
        logits2, lens2, table2 = _case(R, width, seed % 100000 + 1 + trial)
        for s, v in ((s_logits, logits2), (s_lens, lens2), (s_table, table2)):
            s.copy_(v)
        out.page_indices.fill_(-7)
        graph.replay()
        want = topk.paged_topk_reference(logits2, lens2, table2, k, raw_indices=True)
        assert torch.equal(out.raw_indices.cpu(), want.raw_indices), f"seed {seed}: replay {trial}"
        assert torch.equal(out.page_indices.cpu(), want.page_indices), f"seed {seed}: replay {trial}"


@pytest.mark.gpu
@pytest.mark.parametrize("k", [64, 512, 2048])
@pytest.mark.parametrize("ctas", [None, 1])
def test_gpu_special_values_as_the_reference(seed, k, ctas, monkeypatch):
    """NaNs of both signs and any payload (above +inf, as torch ranks them), infinities, signed zeros (equal),
    fp32 subnormals, values past fp16's range and values within one fp16 step: the radix select's order keys
    keep the reference's selection, every element."""
    _force_cluster(monkeypatch, ctas)
    R, width = 6, 6144
    g = torch.Generator().manual_seed(seed % 100000)
    kind = torch.randint(0, 8, (R, width), generator=g)
    x = torch.randn(R, width, generator=g)
    bits = torch.randint(0, 2**22, (R, width), generator=g, dtype=torch.int32)
    nan = (bits | 0x7F800001 | (torch.randint(0, 2, (R, width), generator=g, dtype=torch.int32) << 31)).view(
        torch.float32)
    x = torch.where(kind == 0, nan, x)
    x = torch.where(kind == 1, torch.where(x > 0, float("inf"), float("-inf")), x)
    x = torch.where(kind == 2, torch.where(x > 0, 0.0, -0.0), x)
    x = torch.where(kind == 3, (bits & 0x7FFFFF).view(torch.float32) * torch.sign(x), x)      # subnormals
    x = torch.where(kind == 4, x * 1e6, x)                                                   # past fp16's range
    x = torch.where(kind == 5, 1.0 + x * 1e-5, x)                                            # one fp16 step
    lens = torch.tensor([width, width - 1, width // 2, k + 1, 3 * k, width], dtype=torch.int32)
    table = torch.randperm(R * 96, generator=g).to(torch.int32).view(R, 96)
    want = topk.paged_topk_reference(x, lens, table, k, raw_indices=True)
    got = topk.paged_topk(x.cuda(), lens.cuda(), table.cuda(), k, raw_indices=True)
    assert torch.equal(got.raw_indices.cpu(), want.raw_indices), f"seed {seed}"
    assert torch.equal(got.page_indices.cpu(), want.page_indices), f"seed {seed}"
