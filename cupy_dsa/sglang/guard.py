"""The SGLang the hooks were written for: its version, and a fingerprint (signature and source hash) of every
function the hooks wrap, replace, copy the logic of or call, checked before any hook is applied.

Imports SGLang only inside functions.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect

from .modes import CLI_FLAG, ENV_NAME

# The functions the hooks are applied to (hooks.py installs them; the fingerprint below covers each).
T_BYTES = "sglang.srt.mem_cache.deepseek_v4_memory_pool.get_dsv4_indexer_bytes_per_token"
T_STORE = "sglang.kernels.ops.attention.dsv4.compress.compress_norm_rope_store"
T_INDEXER = "sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin.forward_c4_indexer"
T_PD_LAYOUT = "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.pd_kv_layout"
T_CLI_ADD = "sglang.srt.server_args.ServerArgs.add_cli_args"
T_CLI_FROM = "sglang.srt.server_args.ServerArgs.from_cli_args"
T_HICACHE_REGIONS = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler._dsv4_indexer_regions"
T_HICACHE_L3 = "sglang.srt.mem_cache.hicache_storage.HiCacheStorageConfig.__post_init__"
T_WARM_UP = "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs"
# fp8-rescore: the residual (lo) pages, allocated beside SGLang's fp8 index pages and moved by PD with them
T_POOL_BUFFER = "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4IndexerPool._create_buffer"
T_PD_BUFFERS = "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4IndexerPool.contiguous_page_row_buffers"
RESOLUTION_STEP = "handle_model_specific_adjustments"

SUPPORTED_SGLANG = ("0.5.23",)

_IX = "sglang.srt.layers.attention.dsv4.indexer."
_HR = "sglang.srt.plugins.hook_registry."
_BE = "sglang.srt.layers.attention.deepseek_v4_backend."
# SGLang 0.5.23: (signature, sha256[:16] of the source) of every function the plugin replaces, wraps, copies
# the logic of or drives by private API; (signature, None) for functions it only calls. Regenerate with
# ``python scripts/sglang_fingerprint.py`` after reviewing the hooks against a new SGLang (the table
# is at the end of this module).


def sglang_version() -> str:
    """The installed SGLang's version string (the imported package's, not some other dist's metadata)."""
    try:
        from sglang.version import __version__
    except Exception:  # noqa: BLE001 - fall back to the distribution metadata
        import importlib.metadata

        return importlib.metadata.version("sglang")
    return str(__version__)


class TargetImportError(ImportError):
    """A module on a hook target's path raised while being imported: ``module`` is that module, ``cause`` the
    innermost import error (for a missing dependency, the ``ModuleNotFoundError`` naming it)."""

    def __init__(self, module: str, cause: BaseException):
        super().__init__(f"{module} does not import ({type(cause).__name__}: {cause})")
        self.module = module
        self.cause = cause


def _innermost_import_error(e: BaseException) -> BaseException:
    """The deepest ImportError in ``e``'s chain (a module that catches an ImportError and raises its own
    error keeps the original as ``__cause__`` / ``__context__``)."""
    found, seen = e, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ImportError):
            found = e
        e = e.__cause__ or e.__context__
    return found


def _import_target_module(path: str):
    """(module, attribute names) of a dotted target path: its longest prefix that is a module, imported
    explicitly. ``pkgutil.resolve_name`` treats any ImportError as "not a module" and falls back to
    ``getattr``, which turns a missing dependency of SGLang into an AttributeError that names neither."""
    parts = path.split(".")
    module = importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        name = ".".join(parts[: i + 1])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # no module of that name: the rest of the path are attributes
                return module, parts[i:]
            raise TargetImportError(name, _innermost_import_error(e)) from e
        except Exception as e:  # noqa: BLE001 - any error while a module's top level runs
            raise TargetImportError(name, _innermost_import_error(e)) from e
    raise ValueError(f"{path}: expected a function or class attribute path, got a module")


def resolve_target(path: str):
    """(owner, attr, raw attribute, plain function) of a dotted target path."""
    module, attrs = _import_target_module(path)
    owner = module
    for name in attrs[:-1]:
        owner = getattr(owner, name)
    attr = attrs[-1]
    raw = owner.__dict__[attr] if isinstance(owner, type) and attr in owner.__dict__ else getattr(owner, attr)
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    return owner, attr, raw, inspect.unwrap(fn)


def fingerprint_of(path: str, with_source: bool = True) -> tuple[str, str | None]:
    fn = resolve_target(path)[3]
    digest = hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16] if with_source else None
    return str(inspect.signature(fn)), digest


def _import_problem(cause: BaseException, modules: dict[str, list[str]]) -> str:
    """One problem line per distinct import error: the error, the SGLang modules it stops and, for a missing
    module, what to install."""
    count = sum(len(paths) for paths in modules.values())
    text = (f"{type(cause).__name__}: {cause}, raised while importing {', '.join(modules)} (where {count} of the "
            f"functions the hooks wrap or call live)")
    missing = getattr(cause, "name", None)
    if isinstance(cause, ModuleNotFoundError) and missing:
        top = missing.split(".")[0]
        text += (f". SGLang imports {top!r}, which is not installed here: pip install {top} (or the package that "
                 f"provides the module {top!r}); `pip check` lists every missing requirement of SGLang")
    return text


def compatibility_problems() -> list[str]:
    """Why the installed SGLang is not one the hooks were written for (empty if it is). A version outside
    ``SUPPORTED_SGLANG`` is reported alone (nothing of it is imported); a supported version is checked
    against :data:`FINGERPRINT`. A module that does not import (a missing dependency of SGLang, typically) is
    reported once, with the import that failed, for all the targets it holds."""
    version = sglang_version()
    if version not in SUPPORTED_SGLANG:
        return [f"found SGLang {version}"]
    differs, not_importable = [], {}
    for path, (sig, digest) in FINGERPRINT.items():
        try:
            got_sig, got_digest = fingerprint_of(path, digest is not None)
        except TargetImportError as e:
            key = (type(e.cause).__name__, str(e.cause))
            cause, modules = not_importable.setdefault(key, (e.cause, {}))
            modules.setdefault(e.module, []).append(path)
            continue
        except Exception as e:  # noqa: BLE001 - a missing attribute is a mismatch too
            differs.append(f"{path}: not found ({type(e).__name__}: {e})")
            continue
        if got_sig != sig:
            differs.append(f"{path}: signature {got_sig}, the hooks expect {sig}")
        elif digest is not None and got_digest != digest:
            differs.append(f"{path}: source differs from SGLang {SUPPORTED_SGLANG[0]}'s (sha256 {got_digest}, "
                           f"expected {digest})")
    problems = [_import_problem(cause, modules) for cause, modules in not_importable.values()]
    problems += differs
    if differs and not_importable:
        problems.insert(0, f"found SGLang {version}, but some of its modules do not import here and its code "
                           "differs from the release the hooks were written for")
    elif not_importable:
        problems.insert(0, f"found SGLang {version}, but some of its modules do not import in this environment")
    elif differs:
        problems.insert(0, f"found SGLang {version}, but its code differs from the release the hooks were "
                           "written for")
    return problems


def off_hint() -> str:
    return (f"To run SGLang unchanged (fp8 index keys), turn the switch off: unset {ENV_NAME} (or set it to fp8) "
            f"and drop {CLI_FLAG} / the {CLI_FLAG[2:]} --config key.")


def remedy(problems: list[str]) -> str:
    """What to do about :func:`compatibility_problems`."""
    if "do not import" in problems[0] and "differs" not in problems[0]:
        return "Make SGLang importable (the errors above) before turning the switch on."
    return f"Install a supported SGLang: pip install sglang=={SUPPORTED_SGLANG[-1]}."


def refusal_message(mode: str, problems: list[str], patched_so_far: str) -> str:
    """The start-up refusal for :func:`compatibility_problems`; ``patched_so_far`` says what of cupy_dsa is
    already in SGLang in this process."""
    supported = ", ".join(SUPPORTED_SGLANG)
    return (f"cupy_dsa ({ENV_NAME}={mode}): refusing to start. cupy_dsa's index-key hooks were written for "
            f"SGLang {supported}; " + problems[0] + "." + "".join(f"\n  - {p}" for p in problems[1:])
            + f"\n{patched_so_far} " + remedy(problems) + " " + off_hint())


# --------------------------------------------------------------------------------------------------
# Fingerprint table (SGLang 0.5.23)
# --------------------------------------------------------------------------------------------------

# Wrapped, replaced or logic copied: signature and source hash.
_FINGERPRINT_SOURCE = (
    T_BYTES, T_STORE, T_INDEXER, T_PD_LAYOUT, T_HICACHE_REGIONS, T_HICACHE_L3, T_WARM_UP, T_POOL_BUFFER, T_PD_BUFFERS,
    # fp8-rescore's lo buffers: their memory region and pool as the fp8 buffers', every buffer PD registers
    "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.get_contiguous_buf_infos",
    # the row layouts logits_route relies on: uniform verify (one repeated page-table row per request, n rows)
    # and extend (each request's rows consecutive, in extend_seq_lens order)
    _BE + "DeepseekV4AttnBackend.make_forward_metadata_from_raw_verify",
    _BE + "DeepseekV4AttnBackend.expand_extend_with_same_length",
    _BE + "DeepseekV4AttnBackend.init_forward_metadata_prefill",
    _BE + "DeepseekV4AttnBackend._resolve_verify_layout",
    "sglang.srt.speculative.ragged_verify.resolve_ragged_verify_layout",
    _HR + "HookRegistry._apply_target", _HR + "_propagate_patch",  # private registry API used by _install
    "sglang.srt.plugins.load_plugins",                            # swallows Exception, not SystemExit
    # bf16-reference rebuilds the query from these (same projections, table, positions and weight scale)
    _IX + "C4IndexerBackendMixin._forward_prepare_normal", _IX + "C4Indexer.compute_q",
    _IX + "C4Indexer.compute_weights",
)
# Only called (or hooked AFTER without reading the body): signature.
_FINGERPRINT_SIGNATURE = (
    T_CLI_ADD, T_CLI_FROM, "sglang.srt.arg_groups.resolution_hooks.register_resolution_hook",
    _IX + "C4IndexerBackendMixin._forward_prepare_multi_stream",
    _IX + "topk_transform_pytorch_vectorized", _IX + "topk_transform_paged", _IX + "topk_transform_paged_v2",
    _IX + "plan_topk_v2", "sglang.srt.speculative.ragged_verify.read_ragged_verify_mode",
    "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.get_index_k_with_scale_buffer",
    # fp8-rescore's stage 1 with SGLang's call (the function its forward picks, called as it calls it)
    _IX + "fp8_paged_mqa_logits_torch", _IX + "fp8_paged_mqa_logits_torch_sm120",
)

FINGERPRINT: dict[str, tuple[str, str | None]] = {
    T_BYTES: ("(index_head_dim: 'int', use_fp4_indexer: 'bool') -> 'int'", '0c4a8a343a2fc47c'),
    T_STORE: ("(kv: 'torch.Tensor', plan: 'Union[CompressorDecodePlan, CompressorPrefillPlan]', *, norm_weight: 'torch.Tensor', norm_eps: 'float', freq_cis: 'torch.Tensor', out_loc: 'torch.Tensor', kvcache: 'torch.Tensor', page_size: 'int', use_fp4: 'bool' = False, bf16_store: 'bool' = False, kvcache_scale: 'Optional[torch.Tensor]' = None, rope_cache: 'Optional[tuple[torch.Tensor, torch.Tensor]]' = None, fp4_k_write_metadata=None, layout: 'Union[KVLayout, str]' = <KVLayout.V4: 'v4'>, fp8_2buff: 'bool' = False, kvcache_rope: 'Optional[torch.Tensor]' = None) -> 'None'", 'b93ca8199dc8e6bd'),
    T_INDEXER: ("(self, x: 'torch.Tensor', q_lora: 'torch.Tensor', c4_indexer: 'C4Indexer', forward_batch: 'ForwardBatch', alt_streams: 'Optional[List[torch.cuda.Stream]]' = None, enable_multi_stream: 'bool' = False, q_lora_ready: 'Optional[torch.cuda.Event]' = None, skip_compressor: 'bool' = False, q_lora_quant=None) -> 'None'", '9023b14e079277f2'),
    T_PD_LAYOUT: ("(self) -> 'str'", 'e9326267433f910e'),
    T_HICACHE_REGIONS: ("(kvcache: 'Any', page_size: 'int') -> 'list[_IndexerRegion]'", '9d380448dc5f8f14'),
    T_HICACHE_L3: ('(self)', '3c204a687fedc894'),
    T_WARM_UP: ("(self, capture_decode_cuda_graph: 'bool' = True)", '2aa82ac4d99b47a5'),
    T_POOL_BUFFER: ('(self)', '7b948c342ea3fba1'),
    T_PD_BUFFERS: ("(self) -> 'List[torch.Tensor]'", 'd9895e530c1d4e5e'),
    'sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.get_contiguous_buf_infos': ("(self) -> 'Tuple[List[int], List[int], List[int]]'", '5f30ae1eaa234041'),
    _BE + 'DeepseekV4AttnBackend.make_forward_metadata_from_raw_verify': ("(self, raw_metadata: 'DSV4RawVerifyMetadata', online_c128_state_slot_offset: 'int' = 0, graph_backed: 'bool' = False) -> 'DSV4Metadata'", '019d1f789b7441d9'),
    _BE + 'DeepseekV4AttnBackend.expand_extend_with_same_length': ("(self, *, bs: 'int', qo_len: 'int', seq_lens: 'torch.Tensor', req_pool_indices: 'torch.Tensor')", '4ab4cdffb324c069'),
    _BE + 'DeepseekV4AttnBackend.init_forward_metadata_prefill': ("(self, max_seq_len: 'int', req_pool_indices: 'torch.Tensor', seq_lens: 'torch.Tensor', seq_lens_cpu: 'List[int]', out_cache_loc: 'torch.Tensor', num_tokens: 'int', extend_seq_lens: 'torch.Tensor', extend_seq_lens_cpu: 'List[int]', extend_start_loc: 'Optional[torch.Tensor]' = None, need_compress: 'bool' = True, use_prefill_cuda_graph: 'bool' = False, online_c128_state_slot_offset: 'int' = 0, dspark_block_size: 'Optional[int]' = None, forward_batch: 'Optional[ForwardBatch]' = None, swa_replay_start: 'Optional[torch.Tensor]' = None, cp_metadata: 'Optional[InterleaveContextParallelMetadata]' = None, dspark_swa_buffers: 'Optional[Tuple[torch.Tensor, torch.Tensor]]' = None) -> 'DSV4Metadata'", 'ed953a0de307a40a'),
    _BE + 'DeepseekV4AttnBackend._resolve_verify_layout': ("(self, forward_batch: 'ForwardBatch', bs: 'int') -> 'Optional[RaggedVerifyLayout]'", '9878aac3c0b26708'),
    'sglang.srt.speculative.ragged_verify.resolve_ragged_verify_layout': ("(forward_batch) -> 'Optional[RaggedVerifyLayout]'", '2de71b0625fe553b'),
    _HR + 'HookRegistry._apply_target': ('(cls, target: str, hooks: list)', 'e5b36a334656349f'),
    _HR + '_propagate_patch': ('(original: object, wrapped: object, source_module: object) -> int', '49c03f76266054fb'),
    'sglang.srt.plugins.load_plugins': ('()', 'cd2a423a31293f61'),
    T_CLI_ADD: ("(parser: 'argparse.ArgumentParser')", None),
    T_CLI_FROM: ("(cls, args: 'argparse.Namespace')", None),
    'sglang.srt.arg_groups.resolution_hooks.register_resolution_hook': ("(name: 'str')", None),
    _IX + 'C4IndexerBackendMixin._forward_prepare_normal': ("(self, x: 'torch.Tensor', q_lora: 'torch.Tensor', c4_indexer: 'C4Indexer', positions: 'torch.Tensor', forward_batch: 'ForwardBatch', skip_compressor: 'bool' = False, q_lora_quant=None) -> 'Tuple[IndexerQuery, torch.Tensor]'", '67b316b7da34a619'),
    _IX + 'C4Indexer.compute_q': ("(self, q_lora: 'torch.Tensor', positions: 'torch.Tensor', weight: 'torch.Tensor', q_lora_quant=None) -> 'Tuple[IndexerQuery, torch.Tensor]'", '7eb11f0ad5f7b171'),
    _IX + 'C4Indexer.compute_weights': ("(self, x: 'torch.Tensor', skip_scale=False) -> 'torch.Tensor'", '1d6abe701b0d7095'),
    _IX + 'C4IndexerBackendMixin._forward_prepare_multi_stream': ("(self, x: 'torch.Tensor', q_lora: 'torch.Tensor', c4_indexer: 'C4Indexer', positions: 'torch.Tensor', forward_batch: 'ForwardBatch', alt_streams: 'Optional[List[torch.cuda.Stream]]' = None, q_lora_ready: 'Optional[torch.cuda.Event]' = None) -> 'Tuple[IndexerQuery, torch.Tensor]'", None),
    _IX + 'topk_transform_pytorch_vectorized': ("(scores: 'torch.Tensor', seq_lens: 'torch.Tensor', page_tables: 'torch.Tensor', out_page_indices: 'torch.Tensor', page_size: 'int', out_raw_indices: 'Optional[torch.Tensor]' = None) -> 'None'", None),
    _IX + 'topk_transform_paged': ("(scores: 'torch.Tensor', seq_lens: 'torch.Tensor', page_tables: 'torch.Tensor', out_page_indices: 'torch.Tensor', page_size: 'int', out_raw_indices: 'Optional[torch.Tensor]' = None) -> 'None'", None),
    _IX + 'topk_transform_paged_v2': ("(scores: 'torch.Tensor', seq_lens: 'torch.Tensor', page_tables: 'Optional[torch.Tensor]', out_page_indices: 'torch.Tensor', page_size: 'int', metadata: 'torch.Tensor', out_raw_indices: 'Optional[torch.Tensor]' = None) -> 'None'", None),
    _IX + 'plan_topk_v2': ("(seq_lens: 'torch.Tensor', static_threshold: 'int' = -1, *, out: 'Optional[torch.Tensor]' = None) -> 'torch.Tensor'", None),
    'sglang.srt.speculative.ragged_verify.read_ragged_verify_mode': ("() -> 'RaggedVerifyMode'", None),
    'sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.get_index_k_with_scale_buffer': ("(self, layer_id: 'int') -> 'torch.Tensor'", None),
    _IX + 'fp8_paged_mqa_logits_torch': ("(q_fp8: 'torch.Tensor', kvcache_fp8: 'torch.Tensor', weight: 'torch.Tensor', seq_lens: 'torch.Tensor', page_table: 'torch.Tensor', deep_gemm_metadata: 'Any', max_seq_len: 'int', clean_logits: 'bool' = True) -> 'torch.Tensor'", None),
    _IX + 'fp8_paged_mqa_logits_torch_sm120': ("(q_fp8: 'torch.Tensor', kvcache_fp8: 'torch.Tensor', weight: 'torch.Tensor', seq_lens: 'torch.Tensor', page_table: 'torch.Tensor', deep_gemm_metadata: 'Any', max_seq_len: 'int', clean_logits: 'bool' = True) -> 'torch.Tensor'", None),
}


def fingerprint_table() -> dict[str, tuple[str, str | None]]:
    """The installed SGLang's fingerprint in :data:`FINGERPRINT`'s form (``scripts/sglang_fingerprint.py``
    prints it, to review and paste after checking the hooks against a new SGLang)."""
    return {path: fingerprint_of(path, path in _FINGERPRINT_SOURCE)
            for path in _FINGERPRINT_SOURCE + _FINGERPRINT_SIGNATURE}
