"""The `twice` command: a Typer app with one module per subcommand."""

from __future__ import annotations

import functools as _functools
import gc as _gc
import os as _os
import signal as _signal


# Ctrl-C while the CLI itself is still importing (typer, rich: a few hundred ms) ends the
# process quietly with 130, like Ctrl-C at any later point, instead of a traceback from
# the middle of an import. main() installs the real handlers; this one is put back at the
# end of this module, so importing the CLI inside another program leaves it unchanged.
def _interrupted_while_starting(signum, frame):  # pragma: no cover - timing dependent
    _os.write(2, b"\ntwice: interrupted\n")
    _os._exit(128 + signum)


_previous_sigint = None
try:
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:  # not if ignored (a background job)
        _previous_sigint = _signal.signal(_signal.SIGINT, _interrupted_while_starting)
except ValueError:  # not the main thread: leave signals alone
    pass

import typer  # noqa: E402

from .errors import DEBUG, fail, run_guarded, signals_installed  # noqa: E402

app = typer.Typer(
    name="twice",
    help="Generate text with transformer language models, and see where the time and memory go.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # Typer's own --install-completion / --show-completion
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    """--version: `twice X.Y.Z`, from the installed package's metadata (no torch import)."""
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("twice")
        except PackageNotFoundError:  # running from a checkout that is not installed
            number = "unknown (not installed)"
        typer.echo(f"twice {number}")
        raise typer.Exit()


@app.callback()
def _global(debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors."),
            version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                         help="Print twice's version and exit.")):
    from .console import COLOR

    COLOR["on"] = True  # --no-color lasts one command (an in-process caller may run several)
    if debug:
        DEBUG["on"] = True


def _register() -> None:
    from . import batch, bench, chat, convert, generate, info, perplexity, quantize, serve  # noqa: F401  (each module adds its command to `app`)


def _guarded(fn):
    """The command run inside run_guarded. Typer (in standalone mode) would otherwise turn
    Ctrl-C into a silent exit and a closed pipe into exit 1 before main() saw them; a
    SystemExit passes through it unchanged."""

    @_functools.wraps(fn)  # typer reads the wrapped function's signature and annotations
    def command(*args, **kwargs):
        run_guarded(lambda: fn(*args, **kwargs))

    command._twice_guarded = True
    return command


def _guard_commands() -> None:
    for info in app.registered_commands:
        if info.callback is not None and not getattr(info.callback, "_twice_guarded", False):
            info.callback = _guarded(info.callback)


try:
    _register()
    _guard_commands()
finally:
    if _previous_sigint is not None:
        _signal.signal(_signal.SIGINT, _previous_sigint)


def _usage_error(e) -> str:
    """A command line Click cannot parse (an unknown option or command, a value of the wrong
    type, a missing argument) as the one line every other bad input gets, with where the
    options are listed."""
    message = " ".join(e.format_message().split()).rstrip(".")
    if message[1:2].islower():  # as our own messages: "no such option: ...", not "No such option"
        message = message[0].lower() + message[1:]
    ctx = getattr(e, "ctx", None)
    return f"{message} (see '{ctx.command_path} -h')" if ctx is not None else message


def _run_app() -> None:
    import importlib

    # Click's exceptions, from the Click typer uses (newer typers carry their own copy).
    click = importlib.import_module(typer.BadParameter.__module__)
    no_args_help = getattr(click, "NoArgsIsHelpError", ())
    try:
        # Not standalone: Click's usage errors come here instead of being drawn as a panel.
        code = app(prog_name="twice", standalone_mode=False)  # the name completion scripts and usage lines use
    except no_args_help as e:
        raise SystemExit(e.exit_code) from None  # the help is already printed (`twice` alone)
    except click.ClickException as e:
        fail(_usage_error(e), e.exit_code)
    except typer.Abort:  # end of input at one of Click's own prompts
        fail("aborted", 1)
    if code == 130:  # typer's Ctrl-C while it parsed the arguments (returned, not raised)
        raise KeyboardInterrupt
    if isinstance(code, int) and code:  # `typer.Exit(code)` comes back as a return value here
        raise SystemExit(code)


def main() -> None:
    """The console entry point: see errors.py for the exit codes and signals."""
    try:
        with signals_installed():
            run_guarded(_run_app)
    finally:
        # The interpreter's final garbage collections walk every object torch created
        # (~0.3 s after each run, and after a Ctrl-C); freezing them skips those walks.
        # Everything is still released: modules and their objects go by reference count,
        # atexit handlers run, and our files are closed by then.
        _gc.freeze()
