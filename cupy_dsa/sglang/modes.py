"""The plugin's switch and its settings, read from the environment once per process: the index-key modes (one
:class:`IndexMode` record each: what the pool holds, the store's numerics, the query, the scoring), the query setting
(:data:`QUERY_ENV`), fp8-rescore's stage 1 and K' (:class:`RescoreSettings`), the refusal of a setting a mode does not
take, and the PD layout tag. No torch, no SGLang; :mod:`.core` re-exports every name here, so
``cupy_dsa.sglang.core.<name>`` keeps working.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import NamedTuple

ENV_NAME = "SGLANG_CUPY_DSA_INDEX_K"
CLI_FLAG = "--cupy-dsa-index-k-dtype"
DEFAULT_MODE = "fp8"

# The indexer query (one setting for every mode that takes it): SGLang's fused fp8 q (one scale per token and head,
# folded into the head weights), or the same rotated q rounded to bf16 once (cupy_dsa.prepare_index_q(numerics=
# "bf16"), the weights without the q scale). It does not change the cache layout: no PD tag, no HiCache namespace.
QUERY_ENV = "SGLANG_CUPY_DSA_INDEX_Q"
QUERY_FLAG = "--cupy-dsa-index-q"
QUERY_CHOICES = ("fp8", "bf16")

# fp8-rescore's settings: which kernel computes stage 1 (SGLang's own fp8 logits call, or cupy_dsa's fp8-key
# kernels) and K' (a multiple of index_topk, "4x", or a count of candidates per row, "2048"); its stage-2 query is
# the query setting above (stage 1 always takes SGLang's fp8 q)
RESCORE_STAGE1_ENV = "SGLANG_CUPY_DSA_RESCORE_STAGE1"
RESCORE_KPRIME_ENV = "SGLANG_CUPY_DSA_RESCORE_KPRIME"
RESCORE_STAGE1_FLAG = "--cupy-dsa-rescore-stage1"
RESCORE_KPRIME_FLAG = "--cupy-dsa-rescore-kprime"
STAGE1_CHOICES = ("sglang", "cupy")
DEFAULT_STAGE1 = "sglang"
DEFAULT_KPRIME = "4x"
RESCORE_ENVS = (RESCORE_STAGE1_ENV, RESCORE_KPRIME_ENV)
# settings that were renamed: set, they are refused with the new name (never silently ignored: the old fp8-rescore
# stage-2 query variable set to fp8 would otherwise run stage 2 with the bf16 query)
RENAMED_ENVS = {"SGLANG_CUPY_DSA_RESCORE_Q": (QUERY_ENV, QUERY_FLAG, "fp8-rescore's stage-2 query is the query "
                                                                     "setting now")}
# index_topk of the DeepSeek-V4 models (their HF config.json): fp8-rescore's K' as a count must reach it
MODEL_INDEX_TOPK = {"DeepSeek-V4-Flash": 512, "DeepSeek-V4-Pro": 1024}

# Settings of every hooked mode. The logits budget: without SGLang's row chunks (it plans them only on its DeepGEMM
# route; SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1, sm_120's default, plans none) an eager prefill's fp32 logits are
# computed in row chunks of at most this many MiB (one 8192-row chunk after 800K tokens would otherwise be 6.1 GiB).
# The non-finite debug switch: after every store, read the count of non-finite keys (a host sync per layer, so it
# is off by default; the count itself is always kept, and check's self-test reads it).
LOGITS_BUDGET_ENV = "SGLANG_CUPY_DSA_LOGITS_BUDGET_MIB"
DEFAULT_LOGITS_BUDGET_MIB = 2048
DEBUG_NONFINITE_ENV = "SGLANG_CUPY_DSA_DEBUG_NONFINITE"
HOOKED_SETTING_ENVS = (LOGITS_BUDGET_ENV, DEBUG_NONFINITE_ENV)


# --------------------------------------------------------------------------------------------------
# The modes: one record each
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IndexMode:
    """One value of the switch: key format x key numerics x query x scoring. Everything that differs between modes
    (hooks, store, forward, warm-up, ``check``, PD tag, HiCache namespace, the bench) reads it from here.

    * ``key_format``: what SGLang's C4 indexer pool holds per entry: ``"fp8"`` (SGLang's 132-byte fp8 + scale),
      ``"bf16"`` (256 bytes), ``"two-level"`` (SGLang's fp8 page, its bytes in its own buffer, plus an int8 residual
      page beside it: 264 bytes);
    * ``key_numerics``: the store's rounding of the key before it is written: ``"exact"`` or ``"fp4sim"``;
    * ``query``: the query when :data:`QUERY_ENV` is unset (``"fp8"``: SGLang's; ``"bf16"``; ``"fp4sim"``:
      DeepSeek-V4's reference query), and ``query_settable``: whether :data:`QUERY_ENV` may choose fp8 or bf16;
    * ``scoring``: ``"sglang"`` (SGLang's own store, logits and top-k: the switch off), ``"one-pass"`` (cupy_dsa's
      logits, SGLang's top-k) or ``"two-level"`` (each row's top-k chosen among its K' best fp8 logits by their
      scores from both pages; the query setting is stage 2's, stage 1 takes SGLang's fp8 q);
    * ``keys``: what the pages hold, for messages."""
    name: str
    key_format: str
    key_numerics: str
    query: str
    query_settable: bool
    scoring: str
    keys: str

    @property
    def hooked(self) -> bool:
        """Whether cupy_dsa's hooks serve it (False: SGLang unchanged)."""
        return self.scoring != "sglang"

    @property
    def cache_layout(self) -> str:
        """The row format of SGLang's index pool: ``"fp8"`` (8448-byte pages; the hi page of two-level keys) or
        ``"bf16"`` (16384-byte pages)."""
        return "bf16" if self.key_format == "bf16" else "fp8"

    @property
    def two_level(self) -> bool:
        return self.key_format == "two-level"

    @property
    def bytes_per_entry(self) -> int:
        """Index-key bytes of one compressed token (what SGLang's KV budget counts): 132, 256 or 264."""
        from cupy_dsa.layouts import BF16_BYTES_PER_TOKEN, FP8_BYTES_PER_TOKEN

        return {"fp8": FP8_BYTES_PER_TOKEN, "bf16": BF16_BYTES_PER_TOKEN,
                "two-level": 2 * FP8_BYTES_PER_TOKEN}[self.key_format]

    @property
    def query_choices(self) -> tuple[str, ...]:
        return QUERY_CHOICES if self.query_settable else (self.query,)


_MODE_LIST = (
    IndexMode("fp8", "fp8", "exact", "fp8", False, "sglang",
              "SGLang's fp8 C4 index keys on SGLang's store and kernels (the switch off)"),
    IndexMode("bf16", "bf16", "exact", "fp8", True, "one-pass", "bf16 C4 index keys"),
    IndexMode("bf16-fp4sim", "bf16", "fp4sim", "fp8", True, "one-pass",
              "bf16 C4 index keys holding FP4-rounded values"),
    # DeepSeek-V4's own indexer numerics (its reference inference code): FP4-simulated keys in bf16 and an
    # FP4-simulated bf16 query, fp32 scores; its query is part of the mode
    IndexMode("bf16-reference", "bf16", "fp4sim", "fp4sim", False, "one-pass",
              "bf16 C4 index keys holding FP4-rounded values, DeepSeek-V4's reference query"),
    # SGLang's fp8 keys (132 B per entry, same pool memory) written by cupy_dsa's store and scored by cupy_dsa's
    # kernels: the format of fp8, the kernels of bf16 (a diagnosis mode: with the query setting, keys x query)
    IndexMode("fp8-cupy", "fp8", "exact", "fp8", True, "one-pass",
              "SGLang's fp8 C4 index keys on cupy_dsa's store and kernels"),
    # bf16 stage-2 query by default: on diverse keys the fp8 q is what limits stage 2 (bench recall's background
    # keys, K' = 4k: 99.6-99.9% of the exact top-k with the fp8 q, 99.98-100% with the bf16 q)
    IndexMode("fp8-rescore", "two-level", "exact", "bf16", True, "two-level",
              "two-level C4 index keys (SGLang's fp8 keys + int8 residual pages) and a rescored top-k"),
)
MODE_RECORDS: dict[str, IndexMode] = {m.name: m for m in _MODE_LIST}
MODES = tuple(MODE_RECORDS)


def _parse_choice(value, choices, default, name: str, meaning: str):
    """A setting's value, case-insensitive and stripped; ``default`` when unset; ValueError naming the variable, the
    accepted values and what they mean."""
    if value is None or str(value).strip() == "":
        return default
    v = str(value).strip().lower()
    if v not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)} ({meaning})")
    return v


def mode_table() -> str:
    """The modes as a markdown table, rendered from their records (what the README's mode table states)."""
    lines = [f"| `{ENV_NAME}` | index keys | bytes per entry | key numerics | query (`{QUERY_ENV}`) | scoring |",
             "|---|---|---|---|---|---|"]
    for m in _MODE_LIST:
        query = (f"`{m.query}` by default, or `{'` / `'.join(c for c in QUERY_CHOICES if c != m.query)}`"
                 if m.query_settable else f"`{m.query}` (fixed)")
        lines.append(f"| `{m.name}` | {m.keys} | {m.bytes_per_entry} | {m.key_numerics} | {query} | {m.scoring} |")
    return "\n".join(lines)


def parse_mode(value) -> str:
    """Normalise a switch value (case-insensitive); raise ValueError naming the accepted values."""
    return _parse_choice(value, MODES, DEFAULT_MODE, ENV_NAME, "; ".join(f"{m.name}: {m.keys}" for m in _MODE_LIST))


def record(mode: str) -> IndexMode:
    return MODE_RECORDS[mode]


class StartupRefused(SystemExit):
    """Stops SGLang's start-up with a message (no traceback at the top level).

    A ``SystemExit`` on purpose: SGLang's ``load_plugins()`` logs and swallows every ``Exception`` a plugin's
    ``register()`` raises, which would leave SGLang running with fp8 keys although bf16 was asked for."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


_MODE: str | None = None
_QUERY: str | None = None


def index_k_mode() -> str:
    """The switch ('fp8' = SGLang unchanged), read from the environment once per process and cached; a
    scheduler inherits the launcher's environment, so every process resolves the same value."""
    global _MODE
    if _MODE is None:
        _MODE = parse_mode(os.environ.get(ENV_NAME))
    return _MODE


def mode_record() -> IndexMode:
    """This process's mode (:func:`index_k_mode`) as its record."""
    return MODE_RECORDS[index_k_mode()]


def set_mode(value) -> str:
    """Set the switch for this process and the processes it starts (the CLI flag and YAML key do this)."""
    global _MODE, _QUERY
    mode = parse_mode(value)
    os.environ[ENV_NAME] = mode
    _MODE, _QUERY = mode, None
    return mode


def reset_mode() -> None:
    """Forget the cached switch, query and fp8-rescore's cached settings (tests that change the variables within
    one process)."""
    global _MODE, _QUERY, _RESCORE
    _MODE = _QUERY = _RESCORE = None


@contextlib.contextmanager
def env_vars(values: dict[str, str | None]):
    """Set these variables for a block (None: unset), then put back what was there. The switch, query and
    fp8-rescore settings are read once per process: the cache is reset on entry and exit."""
    def apply(settings):
        for name, value in settings.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reset_mode()

    old = {name: os.environ.get(name) for name in values}
    apply(values)
    try:
        yield
    finally:
        apply(old)


def enabled() -> bool:
    return mode_record().hooked


def cache_layout(mode: str) -> str:
    return MODE_RECORDS[mode].cache_layout


def is_two_level(mode: str) -> bool:
    return MODE_RECORDS[mode].two_level


def index_bytes_per_entry(mode: str) -> int:
    return MODE_RECORDS[mode].bytes_per_entry


def numerics_of(mode: str) -> str:
    return MODE_RECORDS[mode].key_numerics


def describe(mode: str) -> str:
    """What a mode serves, for messages."""
    return MODE_RECORDS[mode].keys


# --------------------------------------------------------------------------------------------------
# The query setting
# --------------------------------------------------------------------------------------------------

QUERY_TEXT = {"fp8": "SGLang's fused fp8 q (one scale per token and head, in the head weights)",
              "bf16": "the rotated q rounded to bf16 once (the head weights without a q scale)",
              "fp4sim": "DeepSeek-V4's reference query (FP4-simulated bf16)"}


def parse_query(value) -> str | None:
    """A query setting (case-insensitive), None when unset; raise ValueError naming the accepted values."""
    return _parse_choice(value, QUERY_CHOICES, None, QUERY_ENV,
                         f"fp8: {QUERY_TEXT['fp8']}; bf16: {QUERY_TEXT['bf16']}")


def query_of(mode: str, value=None, source: str | None = None) -> str:
    """The query a mode runs with the setting ``value`` (unset: the mode's default); ValueError for a value the
    mode does not take, naming where it was set: ``source`` (e.g. the server flag) or :data:`QUERY_ENV`."""
    rec = MODE_RECORDS[mode]
    q = parse_query(value)
    if q is None:
        return rec.query
    if not rec.query_settable:
        why = ("the switch is off: SGLang's own kernels score its fp8 q" if not rec.hooked else
               f"its query ({rec.query}) is part of the mode")
        settable = ", ".join(m.name for m in _MODE_LIST if m.query_settable)
        where, drop = (f"{QUERY_ENV}={value!r}", f"Unset {QUERY_ENV}") if source is None else \
            (source, f"Drop {source.split()[0]}")
        raise ValueError(f"{where} set with {ENV_NAME}={mode}: {why}. {drop}, or set {ENV_NAME} to one of {settable}")
    return q


def index_query() -> str:
    """This process's query (``"fp8"``, ``"bf16"`` or ``"fp4sim"``), read from the environment once per process."""
    global _QUERY
    if _QUERY is None:
        _QUERY = query_of(index_k_mode(), os.environ.get(QUERY_ENV))
    return _QUERY


def describe_query(mode: str, query: str) -> str:
    rec = MODE_RECORDS[mode]
    source = (f"{QUERY_ENV}={query}" if (os.environ.get(QUERY_ENV) or "").strip() else
              f"{QUERY_ENV} unset: the mode's default" if rec.query_settable else "fixed by the mode")
    if rec.two_level:
        return f"stage 1 with {QUERY_TEXT['fp8']}, stage 2 with {QUERY_TEXT[query]} ({source})"
    return f"query: {QUERY_TEXT[query]} ({source})"


# --------------------------------------------------------------------------------------------------
# fp8-rescore's settings: stage 1 and K'
# --------------------------------------------------------------------------------------------------

class RescoreSettings(NamedTuple):
    """``stage1``: ``"sglang"`` (SGLang's own fp8 logits call, the function its forward would call) or ``"cupy"``
    (cupy_dsa's fp8-key kernels on the plugin's routes); K' is ``multiple x index_topk`` or ``count``."""
    stage1: str
    multiple: int | None
    count: int | None

    def k_prime(self, index_topk: int) -> int:
        """Candidates per row for a layer of ``index_topk`` (the ops cap it at the row's width)."""
        problem = self.k_prime_problem(index_topk)
        if problem:
            raise ValueError(problem)
        return self.count if self.count is not None else self.multiple * int(index_topk)

    def k_prime_problem(self, index_topk: int) -> str | None:
        if self.count is not None and self.count < int(index_topk):
            return (f"{RESCORE_KPRIME_ENV}={self.count}: K' must be at least index_topk ({index_topk}); use a "
                    f"multiple such as 4x")
        return None

    def describe(self) -> str:
        kp = f"{self.multiple}x index_topk" if self.count is None else f"{self.count}"
        first = ("SGLang's own fp8 logits call" if self.stage1 == "sglang" else "cupy_dsa's fp8-key kernels")
        return f"stage 1 = {first} ({RESCORE_STAGE1_ENV}={self.stage1}), K' = {kp} ({RESCORE_KPRIME_ENV})"


def parse_stage1(value) -> str:
    return _parse_choice(value, STAGE1_CHOICES, DEFAULT_STAGE1, RESCORE_STAGE1_ENV,
                         "sglang: SGLang's own fp8 logits call computes stage 1; cupy: cupy_dsa's fp8-key kernels")


def parse_k_prime(value) -> tuple[int | None, int | None]:
    """(multiple, count) of a K' value: ``"4x"`` (a multiple of index_topk, an int >= 1) or ``"2048"`` (candidates
    per row, an int >= 1; at least the layer's index_topk, checked when it is known)."""
    if value is None or str(value).strip() == "":
        value = DEFAULT_KPRIME
    v = str(value).strip().lower()
    multiple = v.endswith("x")
    digits = v[:-1] if multiple else v
    if not digits.isdigit() or int(digits) < 1 or int(digits) > 2**31 - 1:
        raise ValueError(f"{RESCORE_KPRIME_ENV}={value!r}: expected a multiple of index_topk such as 4x (an int >= 1 "
                         f"followed by x) or a number of candidates per row such as 2048")
    return (int(digits), None) if multiple else (None, int(digits))


def parse_rescore_settings(stage1=None, k_prime=None) -> RescoreSettings:
    return RescoreSettings(parse_stage1(stage1), *parse_k_prime(k_prime))


def rescore_settings_from_env() -> RescoreSettings:
    """fp8-rescore's settings as the environment holds them now (raises ValueError naming a bad variable)."""
    return parse_rescore_settings(*(os.environ.get(n) for n in RESCORE_ENVS))


_RESCORE: RescoreSettings | None = None


def rescore_settings() -> RescoreSettings:
    """fp8-rescore's settings from the environment, read once per process (like the switch)."""
    global _RESCORE
    if _RESCORE is None:
        _RESCORE = rescore_settings_from_env()
    return _RESCORE


def parse_logits_budget_mib(value) -> int:
    """The plugin's cap on one eager fp32 logits block, MiB (an int >= 1; default :data:`DEFAULT_LOGITS_BUDGET_MIB`)."""
    if value is None or str(value).strip() == "":
        return DEFAULT_LOGITS_BUDGET_MIB
    v = str(value).strip()
    if not v.isdigit() or not 1 <= int(v) <= 1 << 30:
        raise ValueError(f"{LOGITS_BUDGET_ENV}={value!r}: expected a whole number of MiB >= 1 such as "
                         f"{DEFAULT_LOGITS_BUDGET_MIB} (the most one eager prefill logits block may take when SGLang "
                         f"plans no row chunks)")
    return int(v)


def logits_budget_bytes() -> int:
    """:data:`LOGITS_BUDGET_ENV` as the environment holds it now, in bytes."""
    return parse_logits_budget_mib(os.environ.get(LOGITS_BUDGET_ENV)) << 20


def parse_debug_nonfinite(value) -> bool:
    return _parse_choice(value, ("0", "1"), "0", DEBUG_NONFINITE_ENV,
                         "1: after every index-key store, read the count of non-finite keys and log the new ones "
                         "(a host sync per layer); 0: counted only") == "1"


def debug_nonfinite() -> bool:
    return parse_debug_nonfinite(os.environ.get(DEBUG_NONFINITE_ENV))


def settings_problem(mode: str, query_source: str | None = None) -> str | None:
    """Why the query setting or fp8-rescore's settings cannot be used with ``mode`` (an invalid value, or a value set
    for a mode that does not take it: refused, never ignored, the switch off included), else None. K' against the
    model's index_topk is checked at the launcher's resolution step (``hooks.validate_config``). A renamed setting
    is refused in every mode, naming the setting that replaced it."""
    for old, (new, new_flag, why) in RENAMED_ENVS.items():
        value = (os.environ.get(old) or "").strip()
        if value:
            return (f"{old}={value!r} was renamed: {why}. Unset {old} and set {new}={value} (or the server flag "
                    f"{new_flag} {value}); {new} accepts {', '.join(QUERY_CHOICES)}")
    try:
        query_of(mode, os.environ.get(QUERY_ENV), query_source)
        logits_budget_bytes()
        debug_nonfinite()
    except ValueError as e:
        return str(e)
    stray = [n for n in HOOKED_SETTING_ENVS if (os.environ.get(n) or "").strip()]
    if stray and not MODE_RECORDS[mode].hooked:
        return (f"{', '.join(stray)} set with {ENV_NAME}={mode}: SGLang's own indexer runs (the switch is off), which "
                f"{'they do' if len(stray) > 1 else 'it does'} not apply to. Unset {' and '.join(stray)}, or turn "
                f"the switch on")
    if not MODE_RECORDS[mode].two_level:
        stray = [n for n in RESCORE_ENVS if (os.environ.get(n) or "").strip()]
        if stray:
            verb = "they apply" if len(stray) > 1 else "it applies"
            two_level = [m.name for m in _MODE_LIST if m.two_level]
            return (f"{', '.join(stray)} set with {ENV_NAME}={mode}: {verb} to {', '.join(two_level)} only. Unset "
                    f"{' and '.join(stray)}, or set {ENV_NAME}={two_level[0]}")
        return None
    try:
        rescore_settings_from_env()
    except ValueError as e:
        return str(e)
    return None


def pd_layout_tag(mode: str) -> str:
    """Suffix appended to SGLang's PD layout string, so peers with different index keys refuse to pair (the query
    does not change the pages: it is not in the tag)."""
    return f",c4idx:{mode}"


def pd_layout_hint(mode: str) -> str:
    """What a server logs at start-up about its PD layout: the tag (none for fp8) and, since SGLang's refusal of a
    mismatched peer names only --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT, the variable that must agree too."""
    tag = f"appends {pd_layout_tag(mode)!r} to" if MODE_RECORDS[mode].hooked else "adds nothing to"
    return (f"cupy_dsa: PD layout: {ENV_NAME}={mode} {tag} SGLang's KV layout string; prefill and decode servers "
            f"must run the same {ENV_NAME}; otherwise SGLang refuses the pair with 'KV layout mismatch: prefill "
            f"server has kv_layout=..., but decode server has kv_layout=... Both servers must use the same "
            f"--dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT', where a differing c4idx part means {ENV_NAME}. "
            f"{QUERY_ENV} may differ between them (it does not change the pages).")
