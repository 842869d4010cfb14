"""Reading what the user types in `twice chat`: prompt-toolkit on a terminal (line editing,
history, Esc-Enter for a newline), plain lines from standard input otherwise, with the
same multi-line rules (a trailing backslash continues; \"\"\" opens and closes a block)."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.text import Text

from twice.core.paths import user_path

from .console import err_console
from .format import os_message

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK = '"""'


def block_open(text: str) -> bool:
    """True while a \"\"\" block has been opened and not yet closed."""
    s = text.lstrip()
    if not s.startswith(BLOCK):
        return False
    return not s[len(BLOCK):].rstrip().endswith(BLOCK)


def finish_input(text: str) -> str:
    """The message an input stands for: the inside of a \"\"\" block, else the text as typed."""
    s = text.strip()
    if s.startswith(BLOCK) and len(s) >= 2 * len(BLOCK) and s.endswith(BLOCK):
        body = s[len(BLOCK):-len(BLOCK)]
        body = body[1:] if body.startswith("\n") else body
        body = body[:-1] if body.endswith("\n") else body
        # A block is always a message: escape a leading slash the way a user would (//).
        return "/" + body if body.startswith("/") else body
    return text


class TerminalReader:
    """prompt-toolkit: line editing, history, Enter sends, Esc-Enter inserts a newline."""

    def __init__(self, history_path: Path | None):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.key_binding import KeyBindings

        self.history = history = open_history(history_path)

        kb = KeyBindings()

        @kb.add("enter")
        def _enter(event):
            buf = event.current_buffer
            if block_open(buf.text):
                buf.insert_text("\n")
            elif buf.text.endswith("\\"):
                buf.cursor_position = len(buf.text)
                buf.delete_before_cursor(1)
                buf.insert_text("\n")
            else:
                buf.validate_and_handle()

        @kb.add("escape", "enter")
        def _newline(event):
            event.current_buffer.insert_text("\n")

        output = None
        if not sys.stdout.isatty():  # `twice chat > replies.txt`: keep the prompt off the replies
            from prompt_toolkit.output import create_output

            output = create_output(stdout=sys.stderr)
        self.session = PromptSession(history=history, key_bindings=kb, multiline=True, output=output,
                                     prompt_continuation=lambda width, line, wrap: CONTINUATION.rjust(width))

    def read(self) -> str | None:
        saved = _terminal_state()
        try:
            text = self.session.prompt(PROMPT)
        except KeyboardInterrupt:  # Ctrl-C at the prompt clears the line
            return None
        except BaseException:
            # SIGTERM/SIGHUP unwind from wherever prompt-toolkit is, possibly past its own
            # raw-mode cleanup: put the terminal back as it was before the prompt.
            _restore_terminal(saved)
            raise
        finally:
            _history_notice(self.history)
        bad = not_utf8(text)
        if bad is not None:
            err_console().print(Text(f"error: {bad}; not sent", style="red"), soft_wrap=True)
            return None
        return finish_input(text)


def not_utf8(text: str) -> str | None:
    """Why typed text is not text, or None. prompt-toolkit decodes the terminal's bytes with
    surrogateescape, so an invalid UTF-8 byte (a paste in another encoding) arrives as a lone
    surrogate, which the tokenizer cannot take and /save cannot write."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"
        return f"the message is not valid UTF-8 ({what} at character {e.start})"


def open_history(path: Path | None):
    """The input history: a file of this user's (appended through safe_write, never through
    a link, only to a regular file of ours), or, where that cannot be, none kept beyond the
    session, after one notice."""
    from prompt_toolkit.history import InMemoryHistory

    if path is not None:
        from twice.core.errors import TwiceError
        from twice.weights.safe_write import ensure_folder, open_append

        try:
            ensure_folder(path.parent, what="folder for the input history")
            with open_append(path):  # fail now, with one notice, rather than at the first message
                pass
            return _safe_file_history(path)
        except (OSError, TwiceError) as e:
            _say_history_not_kept(path, os_message(e) if isinstance(e, OSError) else str(e))
    return InMemoryHistory()


def _say_history_not_kept(path: Path, why: str) -> None:
    prefix = f"{path}: "
    why = why[len(prefix):] if why.startswith(prefix) else why  # the path is said once
    err_console().print(Text(f"note: input history not kept: {path}: {why}", style="yellow"), soft_wrap=True)


def _history_notice(history) -> None:
    """Say once, after the prompt, why the history file stopped being written (a link put in
    its place while the chat ran, a full disk): the chat goes on without it."""
    failed = getattr(history, "failed", None)
    if failed and not getattr(history, "said", False):
        history.said = True
        _say_history_not_kept(Path(history.filename), failed)


def _safe_file_history(path: Path):
    """prompt-toolkit's FileHistory (same file format), with every append through
    safe_write.open_append and the file read only if it is still a regular file, not a link."""
    import os

    from prompt_toolkit.history import FileHistory

    from twice.core.errors import TwiceError
    from twice.weights.safe_write import open_append

    class SafeFileHistory(FileHistory):
        failed: str | None = None
        said = False

        def load_history_strings(self):
            try:
                fd = os.open(self.filename, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
            except OSError:
                return []
            import stat

            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    return []
                lines = [raw.decode("utf-8", errors="replace") for raw in f]  # split at b"\n" only
            strings, entry = [], []
            for line in lines + ["#"]:
                if line.startswith("+"):
                    entry.append(line[1:])
                elif entry:
                    strings.append("".join(entry)[:-1])  # joined, less the last newline
                    entry = []
            return reversed(strings)

        def store_string(self, string: str) -> None:
            import datetime

            if self.failed:
                return
            text = f"\n# {datetime.datetime.now()}\n" + "".join(f"+{line}\n" for line in string.split("\n"))
            try:
                with open_append(Path(self.filename)) as f:
                    f.write(text.encode("utf-8", errors="replace"))
            except (OSError, TwiceError) as e:
                self.failed = os_message(e) if isinstance(e, OSError) else str(e)

    return SafeFileHistory(str(path))


def _terminal_state():
    try:
        import termios

        return termios.tcgetattr(sys.stdin.fileno())
    except Exception:  # termios.error is not an OSError; no terminal: nothing to do
        return None


def _restore_terminal(saved) -> None:
    if saved is None:
        return
    try:
        import termios

        termios.tcsetattr(sys.stdin.fileno(), termios.TCSANOW, saved)
    except Exception:  # termios.error is not an OSError; no terminal: nothing to do
        pass


class PlainReader:
    """Standard input that is not a terminal: one message per line, with the same
    continuation rules (trailing backslash, \"\"\" blocks), and no prompt."""

    def __init__(self, stream=None, prompt: bool = False):
        self.stream = stream or sys.stdin
        self.prompt = prompt  # a terminal without prompt-toolkit still needs to see where to type
        self.line_number = 0

    def _line(self, prompt: str = PROMPT) -> str:
        if self.prompt:
            sys.stderr.write(prompt)
            sys.stderr.flush()
        buffer = getattr(self.stream, "buffer", None)
        raw = buffer.readline() if buffer is not None else self.stream.readline()
        if not raw:
            raise EOFError
        self.line_number += 1
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"line {self.line_number} of standard input is not valid UTF-8 "
                                 f"(byte {e.start})") from None
        # A line ends at "\n" or "\r\n" (a script saved on Windows): the "\r" is not the user's text.
        return raw.removesuffix("\n").removesuffix("\r") if raw.endswith("\n") else raw

    def read(self) -> str | None:
        try:
            text = self._line()
            while True:
                if block_open(text):
                    try:
                        text += "\n" + self._line(CONTINUATION)
                    except EOFError:
                        err_console().print(Text(f"error: standard input ended inside a {BLOCK} block; "
                                                 "that block was not sent", style="red"), soft_wrap=True)
                        raise
                elif text.endswith("\\"):
                    try:
                        text = text[:-1] + "\n" + self._line(CONTINUATION)
                    except EOFError:
                        return text[:-1]
                else:
                    return finish_input(text)
        except ValueError as e:
            err_console().print(Text(f"error: {e}; skipped", style="red"), soft_wrap=True)
            return None
        except KeyboardInterrupt:
            if not self.prompt:  # piped input cannot be retyped: Ctrl-C means stop
                raise
            sys.stderr.write("\n")  # on a terminal, Ctrl-C drops the line being typed
            return None


def make_reader(history: Path | None | bool):
    """history: a file, None for the default one, False for none beyond the session."""
    if sys.stdin is None or not sys.stdin.isatty():
        return PlainReader()
    try:
        import prompt_toolkit  # noqa: F401
    except ImportError:
        err_console().print(Text("note: prompt-toolkit is not installed: no line editing or history "
                                 "(pip install prompt-toolkit)", style="yellow"), soft_wrap=True)
        return PlainReader(prompt=True)
    if history is None:
        from twice.core.paths import cache_dir

        history = cache_dir() / "chat_history"
    return TerminalReader(None if history is False else user_path(history))
