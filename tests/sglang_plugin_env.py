"""What the SGLang plugin's test files share: the checkout root, the switch's name and a child process's
environment (the plugin's variables cleared, this checkout first on PYTHONPATH)."""
import os
from pathlib import Path

from cupy_dsa.sglang import core

ROOT = Path(__file__).resolve().parents[1]
ENV = core.ENV_NAME

_CLEARED = (ENV, "SGLANG_PLUGINS", "SGLANG_PLATFORM", "SGLANG_OPT_DSV4_NONPAGED_INDEXER",
            "SGLANG_OPT_DSV4_NONPAGED_INDEXER_MIN_QUERY_TOKENS", "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH",
            "SGLANG_OPT_USE_TOPK_V2", core.QUERY_ENV) + core.RESCORE_ENVS


def child_env(extra, seed):
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update(extra)
    env["CUPY_DSA_SEED"] = str(seed)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env
