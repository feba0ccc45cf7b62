"""``python -m cupy_dsa.sglang check``: the operator's self-check, run in the server's environment."""
import sys

import click

from . import check as self_check
from .modes import CLI_FLAG, ENV_NAME, MODES, QUERY_CHOICES, QUERY_ENV, QUERY_FLAG


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """cupy_dsa's SGLang plugin."""


@main.command()
@click.option("--mode", type=click.Choice(MODES, case_sensitive=False), default=None,
              help=f"the mode the server is started with by {CLI_FLAG} or the --config YAML key "
                   f"cupy-dsa-index-k-dtype (without it: {ENV_NAME}).")
@click.option("--query", type=click.Choice(QUERY_CHOICES, case_sensitive=False), default=None,
              help=f"the query the server is started with by {QUERY_FLAG} or the --config YAML key "
                   f"cupy-dsa-index-q (without it: {QUERY_ENV}).")
def check(mode, query):
    """Whether a SGLang server started here gets cupy_dsa's index keys: plugin loading, the mode and the query
    that runs, the SGLang fingerprint, the GPUs, and on each GPU a kernel compile and a small store + logits
    self-test. Exit code 0 when everything holds."""
    sys.exit(self_check.main(mode=mode, query=query.lower() if query else None))


if __name__ == "__main__":
    main()
