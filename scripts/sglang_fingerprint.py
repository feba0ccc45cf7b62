"""Print the installed SGLang's fingerprint in ``cupy_dsa.sglang.guard.FINGERPRINT``'s form, to review and paste
into the guard after reviewing each hook against a new SGLang:

    python scripts/sglang_fingerprint.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _sglang_env  # noqa: E402

_sglang_env.install()

from cupy_dsa.sglang import guard  # noqa: E402


def fingerprint():
    """Print the installed SGLang's fingerprint (to review and paste into guard.FINGERPRINT)."""
    for path, value in guard.fingerprint_table().items():
        print(f"    {path!r}: {value!r},")


if __name__ == "__main__":
    fingerprint()
