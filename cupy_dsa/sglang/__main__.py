"""``python -m cupy_dsa.sglang check``: the operator's self-check, run in the server's environment."""
import sys

import click

from . import check as self_check
from .core import CLI_FLAG, ENV_NAME, MODES


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """cupy_dsa's SGLang plugin."""


@main.command()
@click.option("--mode", type=click.Choice(MODES, case_sensitive=False), default=None,
              help=f"the mode the server is started with by {CLI_FLAG} or the --config YAML key "
                   f"cupy-dsa-index-k-dtype (without it: {ENV_NAME}).")
def check(mode):
    """Whether a SGLang server started here gets bf16 index keys: plugin loading, the mode, the SGLang
    fingerprint, the GPUs, and on each GPU a kernel compile and a small store + logits self-test.
    Exit code 0 when everything holds."""
    sys.exit(self_check.main(mode=mode))


if __name__ == "__main__":
    main()
