"""The `twice` command: a Typer app with one module per subcommand."""

from __future__ import annotations

import typer

from .errors import DEBUG, run_guarded

app = typer.Typer(
    name="twice",
    help="Generate text with transformer language models, and see where the time and memory go.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _global(debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors.")):
    if debug:
        DEBUG["on"] = True


def _register() -> None:
    from . import batch, bench, chat, convert, generate, info  # noqa: F401  (each module adds its command to `app`)


_register()


def main() -> None:
    run_guarded(lambda: app())
