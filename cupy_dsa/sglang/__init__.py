"""SGLang 0.5.23 integration (general plugin). Importing this package never imports SGLang: the hooks in
:mod:`cupy_dsa.sglang.hooks` (entry point :mod:`cupy_dsa.sglang.plugin`) load it lazily, the guard in
:mod:`cupy_dsa.sglang.guard` checks it, :mod:`cupy_dsa.sglang.modes` holds the switch and its settings and
:mod:`cupy_dsa.sglang.core` the SGLang-free glue."""
