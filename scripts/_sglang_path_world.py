"""The set-up of ``scripts/gpu_sglang_path.py`` (imported by it, after it has made SGLang importable): SGLang loaded
with the plugin's hooks, the host-side batch (page tables, token positions, SGLang's plan rows) and one
:class:`World` per device (SGLang's index pool, its compressor store call site, its hooked ``forward_c4_indexer``
with the torch top-k).
"""
from __future__ import annotations

import os
import types

import numpy as np
import torch

TOPK = 512
N_PAGES = 96          # C4 index pages of the pool (64 compressed tokens each)
PAGES_PER_REQ = 24    # page-table width (max compressed length 1536)
PROMPTS = (701, 2103, 4101)   # tokens per request: compressed 175 (<= top-k), 525, 1025
EXTEND = (701, 100, 60)       # the last tokens of each prompt as one extend batch (request 0: no prefix)
MAX_POS = 8192
PLAN_INVALID = 0xFFFFFFFF

NOTES: list[str] = []


def log(msg):
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------------
# SGLang
# --------------------------------------------------------------------------------------------------

def load_sglang(stubbed):
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from cupy_dsa.sglang import guard, hooks

    if guard.T_INDEXER not in hooks.installed_targets():
        # cupy_dsa is not pip-installed here (no entry point): register it as load_plugins() would
        hooks.register()
        NOTES.append("plugin registered directly (no cupy_dsa entry point installed)")
    missing = [t for t in hooks.ALWAYS_TARGETS + hooks.SWITCHED_TARGETS if t not in hooks.installed_targets()]
    if missing:
        raise RuntimeError(f"hooks not applied: {missing}")
    import sglang
    from sglang.kernels.ops.attention.dsv4 import compress
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend
    from sglang.srt.layers.attention.dsv4 import compressor_v2
    from sglang.srt.layers.attention.dsv4 import indexer as ix
    from sglang.srt.layers.attention.dsv4.metadata import PagedIndexerMetadata
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4IndexerPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    log(f"sglang {guard.sglang_version()} from {os.path.dirname(sglang.__file__)}; "
        f"{len(hooks.installed_targets())} hooks applied; stubbed imports: {stubbed or 'none'}")
    return types.SimpleNamespace(compress=compress, compressor_v2=compressor_v2, ix=ix,
                                 DSATopKBackend=DSATopKBackend, PagedIndexerMetadata=PagedIndexerMetadata,
                                 DeepSeekV4IndexerPool=DeepSeekV4IndexerPool, ForwardMode=ForwardMode)


# --------------------------------------------------------------------------------------------------
# Inputs (host side, shared by both devices)
# --------------------------------------------------------------------------------------------------

def decode_plan_rows(seq_lens):
    """DecodePlan rows (uint8 [B, 16]): u32 seq_len, i32 write_loc, i32 read_page_0, i32 read_page_1."""
    a = np.zeros((len(seq_lens), 4), dtype="<i4")
    a[:, 0] = np.asarray(seq_lens, dtype=np.uint32).view(np.int32)
    return torch.from_numpy(a.view(np.uint8).reshape(len(seq_lens), 16).copy())


def compress_plan_rows(seq_lens, ragged_ids):
    """CompressPlan rows (uint8 [N, 16]): u32 seq_len (0xFFFFFFFF = no compressed token), u16 ragged_id,
    u16 buffer_len, 2 x i32."""
    n = len(seq_lens)
    a = np.zeros(n, dtype=[("seq", "<u4"), ("rid", "<u2"), ("blen", "<u2"), ("p0", "<i4"), ("p1", "<i4")])
    a["seq"], a["rid"], a["blen"] = seq_lens, ragged_ids, 4
    return torch.from_numpy(a.view(np.uint8).reshape(n, 16).copy())


class Batch:
    """Host description of the requests: page tables and token positions -> plan rows, out_loc, lengths."""

    def __init__(self, g):
        perm = torch.randperm(N_PAGES, generator=g)
        self.page_table = perm[: len(PROMPTS) * PAGES_PER_REQ].view(len(PROMPTS), PAGES_PER_REQ).to(torch.int32)
        self.lens = list(PROMPTS)

    def slot(self, b, pos):
        """C4 slot of the compressed token that ends at token ``pos`` (0-based) of request ``b``."""
        j = (pos + 1) // 4 - 1
        return int(self.page_table[b, j // 64]) * 64 + j % 64

    def store_plan(self, tokens):
        """An extend-style CompressPlan over ``tokens`` [(request, pos)], one row per query token."""
        seq, rid, loc = [], [], []
        for t, (b, pos) in enumerate(tokens):
            boundary = (pos + 1) % 4 == 0
            seq.append(pos + 1 if boundary else PLAN_INVALID)
            rid.append(t)
            loc.append(self.slot(b, pos) if boundary else -1)
        return compress_plan_rows(np.array(seq, dtype=np.uint32), np.array(rid, dtype=np.uint16)), \
            torch.tensor(loc, dtype=torch.int64)

    def decode_plan(self):
        """One decode token per request at position lens[b] (then lens grows by one)."""
        seq = [n + 1 for n in self.lens]
        loc = [self.slot(b, n) if (n + 1) % 4 == 0 else 0 for b, n in enumerate(self.lens)]
        return decode_plan_rows(seq), torch.tensor(loc, dtype=torch.int64)

    def rows_of(self, tokens):
        """Indexer rows of query tokens: compressed length (causal) and the request's page-table row."""
        lens = torch.tensor([(pos + 1) // 4 for _, pos in tokens], dtype=torch.int32)
        pt = self.page_table[[b for b, _ in tokens]]
        return lens, pt


# --------------------------------------------------------------------------------------------------
# One device: SGLang's pool, call sites and metadata
# --------------------------------------------------------------------------------------------------

class World:
    def __init__(self, sg, device, norm_w, freq_cis):
        self.sg, self.device = sg, torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors report cuda:N, never bare cuda
            self.device = torch.device("cuda", torch.cuda.current_device())
        from cupy_dsa import layouts
        from cupy_dsa.sglang import core

        pool = sg.DeepSeekV4IndexerPool(N_PAGES * 64, 64, torch.bfloat16, 128, 1, str(self.device), False,
                                        use_fp4_indexer=False, global_page_size=256)
        self.pool = pool
        self.cache = pool.index_k_with_scale_buffer[0]
        self.lo = (getattr(pool, "index_k_lo_buffer", None) or [None])[0]  # fp8-rescore's residual pages
        if core.is_two_level(core.index_k_mode()) and (self.lo is None or core.lo_cache_of(self.cache) is not self.lo):
            raise RuntimeError("fp8-rescore: SGLang's pool has no residual pages registered beside its fp8 pages")
        row_bytes = layouts.page_bytes(core.cache_layout(core.index_k_mode()))  # the mode's rows, sized by SGLang
        if tuple(self.cache.shape[1:]) != (row_bytes,) or self.cache.dtype != torch.uint8 or self.cache.device != self.device:
            raise RuntimeError(f"pool page rows {tuple(self.cache.shape)} {self.cache.dtype} on {self.cache.device}, "
                               f"expected [P, {row_bytes}] uint8 on {self.device}")
        self.norm_w = norm_w.to(self.device)
        self.freq_cis = freq_cis.to(self.device)
        self.kv_score_buffer = torch.zeros(8, 512, device=self.device)
        self.kv_score_input = torch.zeros(1, 512, device=self.device)
        self.ape = torch.zeros(4, 128, device=self.device)
        self.logits: list[torch.Tensor] = []

    def to(self, t):
        return t.to(self.device)

    # the compressor's store call site (SGLang's), compress_forward standing in for the JIT compressor
    def store(self, plan_cls, rows, kv, out_loc):
        cv2 = self.sg.compressor_v2
        plan = plan_cls(rows)

        class Backend(cv2.CompressorBackendMixin):
            forward_metadata = types.SimpleNamespace(c4_compress_metadata=plan)

        orig = cv2.compress_forward
        cv2.compress_forward = lambda **kw: kv
        try:
            Backend()._forward_compress_all_in_one(
                kv_score_buffer=self.kv_score_buffer, kv_score_input=self.kv_score_input, ape=self.ape,
                head_dim=128, norm=types.SimpleNamespace(weight=self.norm_w, variance_epsilon=1e-6),
                freqs_cis_cache=self.freq_cis, kv_cache=self.cache, is_indexer=True, rotate=True, compress_ratio=4,
                page_size=64, out_loc=out_loc)
        finally:
            cv2.compress_forward = orig

    def decode_plan(self, rows):
        return self.sg.compress.CompressorDecodePlan(4, rows)

    def prefill_plan(self, rows):
        return self.sg.compress.CompressorPrefillPlan(4, rows, torch.zeros(rows.shape[0], 8, dtype=torch.uint8,
                                                                          device=rows.device))

    # forward_c4_indexer (hooked), SGLang's torch top-k
    def indexer_backend(self, q, w, lens, page_table, mode, batch_size, extend_lens=None, draft=None):
        sg, world = self.sg, self
        rows = q.shape[0]

        class Pool:
            layer_mapping = {0: types.SimpleNamespace(compress_layer_id=0), 1: types.SimpleNamespace(compress_layer_id=1)}

            def get_index_k_with_scale_buffer(self, layer_id):
                return world.pool.get_index_k_with_scale_buffer(0)  # every layer reads the one buffer

        class Backend(sg.ix.C4IndexerBackendMixin):
            def __init__(self):
                super().__init__()
                self.dsa_topk_backend = sg.DSATopKBackend.TORCH
                self.token_to_kv_pool = Pool()
                self.hisparse_coordinator = None
                im = sg.PagedIndexerMetadata(page_size=256, compressed_page_size=64, page_table=page_table,
                                             compressed_seq_lens=lens, use_topk_v2=False)
                cm = types.SimpleNamespace(
                    positions=torch.arange(rows, device=world.device),
                    c4_sparse_raw_indices=torch.full((rows, TOPK), -1, dtype=torch.int32, device=world.device),
                    c4_sparse_page_indices=torch.full((rows, TOPK), -1, dtype=torch.int32, device=world.device))
                self.forward_metadata = types.SimpleNamespace(indexer_metadata=im, core_metadata=cm)
                self.forward_batch = types.SimpleNamespace(forward_mode=mode, batch_size=batch_size,
                                                           _original_forward_mode=None, tbo_parent_token_range=None)
                if extend_lens is not None:  # an extend: the requests' rows, consecutive (SGLang's layout)
                    self.forward_batch.extend_seq_lens = torch.tensor(extend_lens, dtype=torch.int32,
                                                                      device=world.device)
                    self.forward_batch.extend_seq_lens_cpu = list(extend_lens)
                self.speculative_num_draft_tokens = draft  # target verify: draft rows per request

            def _forward_prepare_normal(self, **kw):
                return q, w[:, :, None]

            def forward_indexer_compressor(self, **kw):  # bf16-reference's prepare: the keys are stored already
                pass

        return Backend()

    def reference_layer(self, q_raw, w_raw):
        """The indexer layer's projections bf16-reference builds its query from: wq_b's bf16 output, weights_proj's
        bf16 output, the RoPE table and SGLang's weight scale."""
        q_raw, w_raw = self.to(q_raw), self.to(w_raw)
        return dict(n_local_heads=64, head_dim=128, freqs_cis=self.freq_cis, weight_scale=128 ** -0.5 * 64 ** -0.5,
                    compressor=None, compute_weights=lambda x, skip_scale=False: w_raw,
                    wq_b=lambda a: (q_raw.reshape(q_raw.shape[0], -1), None))

    def run_indexer(self, b, layers=(0,), layer_fields=None):
        x = torch.zeros(b.forward_metadata.core_metadata.positions.shape[0], 16, device=self.device)
        for layer in layers:
            ci = types.SimpleNamespace(layer_id=layer, use_fp4_indexer=False, index_topk=TOPK, **(layer_fields or {}))
            b.forward_c4_indexer(x, x, ci, b.forward_batch)
        return b.forward_metadata.core_metadata
