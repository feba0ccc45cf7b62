"""The module SGLang's plugin loader imports: entry point ``cupy_dsa = cupy_dsa.sglang.plugin:register`` in group
``sglang.srt.plugins``, and ``ray_worker_setup`` for Ray's ``worker_process_setup_hook``.

Where the code is: :mod:`cupy_dsa.sglang.hooks` (the switch at start-up, hook installation and the hook
functions), :mod:`cupy_dsa.sglang.guard` (the SGLang version and fingerprint check), :mod:`cupy_dsa.sglang.forward`
(the bf16 ``forward_c4_indexer``), :mod:`cupy_dsa.sglang.modes` (the switch and its settings),
:mod:`cupy_dsa.sglang.core` (the SGLang-free glue). Importing this module does not import SGLang.
"""

from .hooks import ray_worker_setup, register

__all__ = ["ray_worker_setup", "register"]
