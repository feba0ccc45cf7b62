"""Scenario "rescore", part: a HiCache round trip of fp8-rescore's index pages through SGLang's own host pools.

:func:`hicache_round_trip` backs a few pages of an fp8-rescore C4 indexer pool up to host memory and loads them back
into other device pages the way SGLang 0.5.23's retraction backup and restore do (``UnifiedRadixCache.backup_kv_cache``
/ ``restore_kv_cache``), with SGLang's real pieces: the regions of ``_dsv4_indexer_regions`` (with the plugin's hook:
the lo pages as the second C4 indexer region), one ``DeepSeekV4PagedHostPool`` per region built as
``build_deepseek_v4_hicache_stack`` builds them under a ``LogicalHostPool`` KV anchor, SGLang's ``HostPoolGroup``,
the sidecars ``_DeepSeekV4Strategy.build`` declares for that group, the transfers
``UnifiedRadixCache._build_sidecar_transfers`` makes of them, a real ``HybridCacheController`` (its host allocation,
index moves, transfer lists and device-index resolution) and its ``L2TransferEngine``. HiCache settings:
``--hicache-io-backend direct --hicache-mem-layout layer_first``.

Stood in on this CPU machine, and why:

* ``sglang.srt.mem_cache.memory_pool_host.transfer_kv_direct``: SGLang binds it (with the other
  ``sgl_kernel.kvcacheio`` ops) only under ``if _is_cuda or _is_hip`` (or, on XPU, from the out-of-tree
  sgl-kernel-xpu wheel through ``pool_host/_kvcacheio.py``, which binds the same compiled ops and has no torch
  implementation), so on CPU the name is undefined and every host-pool transfer raises ``NameError``.
  :func:`torch_transfer_kv_direct` is the op's contract in torch (per layer, per page of ``page_size`` rows:
  ``dst[dst_index:+page_size] = src[src_index:+page_size]``, the indices read on the host); it is set on the module
  for the round trip only and the module is left as it was (the name absent on CPU) afterwards. With the direct
  backend and the layer-first layout this is the only op the paged host pools call for whole pages.
* ``DeepSeekV4PagedHostPool(pin_memory=False)``: the builder keeps the default ``pin_memory=True``, which registers
  the host buffers with ``cudaHostRegister`` (no CUDA here); the buffers are otherwise the same.
* the controller's device allocator (``get_kvcache()``: device ``cpu``, the layer count, a no-op layer-transfer
  counter registration), the ``kvcache`` object the strategy and the regions read (the indexer pool, the layer
  mapping) and the radix cache object ``_build_sidecar_transfers`` reads (its sidecar specs): namespaces holding
  only what those read. ``build_deepseek_v4_hicache_stack`` itself is not run (its C4 main-KV and state pools need a
  whole DeepSeekV4TokenToKVPool); the strategy gets this group from it (stood in for the call).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import types

import torch

PAGE = 256       # FULL tokens per tree page: one C4 indexer page row (64 compressed slots)
HOST_PAGES = 8
_MISSING = object()


def torch_transfer_kv_direct(calls):
    """sgl_kernel's ``transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size)`` in torch;
    ``calls`` gets (src_layers, dst_layers, src rows, dst rows) of each call."""

    def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
        assert len(src_layers) == len(dst_layers) and src_indices.numel() == dst_indices.numel()
        src, dst = src_indices.cpu().tolist(), dst_indices.cpu().tolist()
        calls.append((list(src_layers), list(dst_layers), src, dst))
        for s, d in zip(src_layers, dst_layers):
            for i in range(0, len(src), page_size):
                d.narrow(0, dst[i], page_size).copy_(s.narrow(0, src[i], page_size))

    return transfer_kv_direct


@contextlib.contextmanager
def transfer_kv_direct_on_cpu(calls):
    """:func:`torch_transfer_kv_direct` as ``memory_pool_host.transfer_kv_direct`` for the block; the module is
    restored afterwards (the name removed again where SGLang did not bind it)."""
    from sglang.srt.mem_cache import memory_pool_host as mph

    saved = mph.__dict__.get("transfer_kv_direct", _MISSING)
    mph.transfer_kv_direct = torch_transfer_kv_direct(calls)
    try:
        yield
    finally:
        if saved is _MISSING:
            del mph.transfer_kv_direct
        else:
            mph.transfer_kv_direct = saved


def _tokens(pages):
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int64) for p in pages])


def _pages(tokens):
    return (tokens.reshape(-1, PAGE)[:, 0] // PAGE).tolist()


def hicache_stack(pool):
    """SGLang's host side for ``pool``'s C4 indexer regions: (group, controller, sidecar specs, regions)."""
    from sglang.srt.mem_cache import memory_pool_host as mph
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    layers = len(pool.index_k_with_scale_buffer)
    kvcache = types.SimpleNamespace(
        c4_indexer_kv_pool=pool, start_layer=0, end_layer=layers, swa_kv_pool=None,
        layer_mapping=[types.SimpleNamespace(compress_ratio=4, compress_layer_id=l) for l in range(layers)])
    c4_mapping = hpa._resolve_deepseek_v4_layer_mappings(kvcache).c4
    # as build_deepseek_v4_hicache_stack: the logical KV anchor, then one host pool per indexer region
    entries = [hpa.build_pool_entry(name=PoolName.KV, host_pool=mph.LogicalHostPool(HOST_PAGES * PAGE, PAGE),
                                    device_pool=kvcache, layer_mapping={l: l for l in range(layers)},
                                    transfer_layer_id_max=layers, is_anchor=True)]
    regions = hpa._dsv4_indexer_regions(kvcache, PAGE)
    for region in regions:
        host_pool = mph.DeepSeekV4PagedHostPool(
            pool_name=str(region.name), device_buffers=region.device_buffers, item_bytes=region.item_bytes,
            num_host_pages=HOST_PAGES, slot_page_size=region.slot_page_size, layout="layer_first",
            pin_memory=False, allocator_type="default", page_aligned_only=region.page_aligned_only)
        entries.append(hpa.build_pool_entry(name=region.name, host_pool=host_pool, device_pool=pool,
                                            layer_mapping=c4_mapping, transfer_layer_id_max=layers))
    group = HostPoolGroup(entries)
    device = types.SimpleNamespace(device="cpu", layer_num=layers, register_layer_transfer_counter=lambda c: None)
    controller = HybridCacheController(types.SimpleNamespace(get_kvcache=lambda: device), group, PAGE, None,
                                       threading.Event(), io_backend="direct", transfer_layer_id_max=layers)
    real = hpa.build_deepseek_v4_hicache_stack
    hpa.build_deepseek_v4_hicache_stack = lambda **kw: (group, controller)
    try:
        built = hpa._DeepSeekV4Strategy().build(
            cache=types.SimpleNamespace(components={ComponentType.FULL, ComponentType.SWA}),
            kvcache=kvcache, params=None, server_args=None, load_cache_event=None)
    finally:
        hpa.build_deepseek_v4_hicache_stack = real
    assert built.host_pool_group is group and built.cache_controller is controller
    return group, controller, built.sidecars, regions


def hicache_round_trip(pool, src_pages, dst_pages, calls, on_layer_done=None):
    """Back ``src_pages`` (page rows of every C4 layer) of ``pool`` up to host memory and load them into
    ``dst_pages``, as SGLang's retraction backup and restore do; returns (group, host page of each source page,
    regions). Runs with :func:`transfer_kv_direct_on_cpu`."""
    from sglang.srt.managers.cache_controller import CacheOperation
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer
    from sglang.srt.mem_cache.unified_cache.components.base import CacheTransferPhase
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    group, controller, sidecars, regions = hicache_stack(pool)
    assert group.alloc(PAGE) is not None  # host page 0 taken: the round trip lands elsewhere
    with transfer_kv_direct_on_cpu(calls):
        # backup (UnifiedRadixCache.backup_kv_cache)
        device_indices = _tokens(src_pages)
        extra = UnifiedRadixCache._build_sidecar_transfers(
            types.SimpleNamespace(sidecar_pool_specs=sidecars), CacheTransferPhase.BACKUP_HOST,
            PoolTransfer(name=group.anchor_entry.name, device_indices=device_indices), {})
        host_indices, resolved = controller.allocate_host_transfers(device_indices, extra)
        op = CacheOperation(host_indices, device_indices, node_id=-1, pool_transfers=resolved)
        controller.l2_transfer_engine.submit_device_to_host(
            controller._l2_transfers(*controller._move_write_operation(op))).finish_event.synchronize()
        saved = [dataclasses.replace(t, device_indices=None) for t in resolved or []]
        # load into other pages (UnifiedRadixCache.restore_kv_cache)
        new_device_indices = _tokens(dst_pages)
        pool_transfers = controller._resolve_device_transfers(saved or None, kv_device_indices=new_device_indices,
                                                              kv_host_indices=host_indices)
        op = CacheOperation(host_indices, new_device_indices, node_id=-1, pool_transfers=pool_transfers)
        controller.l2_transfer_engine.submit_host_to_device(
            controller._l2_load_transfers(*controller._move_op_indices(op)),
            transfer_layer_id_max=controller.transfer_layer_id_max,
            on_layer_done=on_layer_done).finish_event.synchronize()
    return group, dict(zip(src_pages, _pages(host_indices))), regions
