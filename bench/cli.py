"""The ``cupy-dsa`` command line, and only that: the ``cupy-dsa`` and ``bench`` groups, which hold the commands
together. One module per group of commands, each with its options, checks and console output (the measurements live
in the modules each command calls):

- :mod:`.cli_sections`: ``cupy-dsa bench`` (= ``bench all``) and ``bench bytes | store | query | logits | recall |
  all``, the sections, with the options they share with ``bench``;
- :mod:`.cli_serve`: ``bench serve``;
- :mod:`.cli_kernels`: ``bench variants | rescore | resources``;
- :mod:`.cli_report`: ``bench report``;
- :mod:`.cli_needle`: ``cupy-dsa needle`` (recall of a running server);
- :mod:`.cli_common`: what they share (option checks, output files, console, device).

The common options (:func:`.cli_sections.common_options`) are taken by ``bench`` and by each section; given to
both, the section's value wins. Given to ``bench`` before ``serve``, ``variants``, ``rescore``, ``resources`` or
``report`` (:data:`OWN_OPTIONS`) they are refused (exit status 2), since those commands would ignore them. Every
bad value is a usage error (exit status 2, no traceback) before any work. Heavy modules (torch, rich, the bench's
sweeps) are imported inside the commands, so ``--help`` stays fast.
"""

from __future__ import annotations

import click

from . import cli_kernels, cli_needle, cli_report, cli_sections, cli_serve
from .cli_sections import SECTIONS_ALL


@click.group(name="cupy-dsa", context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cupy-dsa", prog_name="cupy-dsa")
def main():
    """cupy_dsa: bf16 index keys for the DeepSeek sparse-attention indexer."""


@main.group(name="bench", invoke_without_command=True)
@cli_sections.common_options
@click.pass_context
def bench(ctx, **opts):
    """Bytes/token, throughput and recall of the index-key layouts, side by side.

    Without a subcommand, runs `all` (bytes, store, query, logits, recall)."""
    if ctx.invoked_subcommand in OWN_OPTIONS:
        _refuse_group_options(ctx, ctx.invoked_subcommand)
    if ctx.invoked_subcommand is None:
        cli_sections.run(ctx, SECTIONS_ALL, cli_sections.merged_top(opts))


# subcommands that take none of bench's options
OWN_OPTIONS = ("serve", "variants", "rescore", "resources", "report")


def _refuse_group_options(ctx: click.Context, sub: str) -> None:
    """An option given to ``bench`` before one of :data:`OWN_OPTIONS` would be ignored: refused (rc 2) before any
    work, naming where it belongs."""
    given = [p.opts[0] for p in ctx.command.params if ctx.params.get(p.name) not in (None, False)]
    if given:
        raise click.UsageError(
            f"{', '.join(given)} given to `bench` {'applies' if len(given) == 1 else 'apply'} to its sections "
            f"(bytes, store, query, logits, recall, all), not to `bench {sub}`, which takes its own options after "
            f"its name (cupy-dsa bench {sub} --help)",
            ctx=ctx)


for _command in (*cli_sections.COMMANDS, cli_serve.serve_cmd, cli_kernels.variants_cmd, cli_kernels.rescore_cmd,
                 cli_kernels.resources_cmd, cli_report.report_cmd):
    bench.add_command(_command)
main.add_command(cli_needle.needle_cmd)


if __name__ == "__main__":
    main()
