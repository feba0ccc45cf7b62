"""``python -m cupy_dsa.sglang check``: the operator's self-check, run in the server's environment."""
import sys

import click

from . import check as self_check


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """cupy_dsa's SGLang plugin."""


@main.command()
def check():
    """Whether a SGLang server started here gets bf16 index keys: plugin loading, the mode, the SGLang
    fingerprint, the GPUs, and on each GPU a kernel compile and a small store + logits self-test.
    Exit code 0 when everything holds."""
    sys.exit(self_check.main())


if __name__ == "__main__":
    main()
