"""`twice chat`: a conversation that keeps the KV cache between turns.

Each turn renders the whole conversation with the model's chat template and hands it to
`Engine.generate`, which prefills only the tokens after the longest prefix it already
holds (the previous prompt and reply), so a turn costs its new tokens, not the history.

Input: on a terminal, prompt-toolkit (line editing, history in a file); otherwise lines
from standard input, so that `twice chat < script.txt` works. stdout carries only the
replies; prompts' help, notes, errors and the per-turn summary go to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from twice.core.paths import user_path
from twice.core.prefix import common_prefix

from . import options as o
from .app import app
from .chat_input import BLOCK, TerminalReader, make_reader
from .console import COLOR, err_console
from .format import counted, os_message
from .conversation_file import SAVE_VERSION, read_conversation, refuse_overwrite, write_atomic
from .readout import Readout


HELP = f"""\
Type a message and press Enter to send it.
  multi-line   end a line with \\ to continue it, or press Esc-Enter / Alt-Enter for a newline;
               {BLOCK} on its own opens a block that the next {BLOCK} closes
  //text       sends "/text" (a message that starts with a slash)
  Ctrl-C       stops a reply (the part written so far is kept); at the prompt, clears the line
  Ctrl-D       leaves (as does /exit)
Commands:
  /help          this text
  /reset         forget the conversation and the KV cache (the system message stays)
  /system TEXT   set the system message (/system alone shows it, /system - removes it)
  /drop N        drop the N oldest turns (user message and reply), keeping the system message
  /stats         the timing report of the last reply
  /retry         drop the last reply and generate it again (with a seed: the same reply,
                 unless /set changed something)
  /set           show the sampling settings; /set NAME VALUE changes one (checked as the
                 command-line flags are): temperature, top_k, top_p, min_p,
                 repetition_penalty, seed (none: a new draw each time), max_new_tokens
  /save FILE     write the conversation as JSON to a new file (and its KV cache to FILE.kv)
  /save! FILE    the same, replacing an earlier chat file of that name
  /load FILE     replace the conversation with one written by /save (checked whole first);
                 FILE.kv, if it is there and fits this model, spares the next turn's prefill
  /exit          leave"""

# Commands that take no words after them: a word there is a mistake to say, not to ignore.
NO_ARGUMENT = frozenset({"/help", "/reset", "/stats", "/retry", "/exit", "/quit"})

TimingEach = Annotated[bool, typer.Option(
    "--timing", help="Print a timing and memory report after each reply (stderr).")]
History = Annotated[Optional[str], typer.Option(
    "--history", help="File that keeps the input history ('' keeps none beyond the session). Default: "
                      "chat_history in the twice cache folder.", show_default=False)]


@app.command()
def chat(
    model: o.Model = None,
    revision: o.Revision = None,
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    dequantize: o.Dequantize = False,
    quantize: o.Quantize = None,
    max_new_tokens: o.MaxNew = 512,
    temperature: o.Temperature = None,
    top_k: o.TopK = None,
    top_p: o.TopP = None,
    min_p: o.MinP = None,
    repetition_penalty: o.RepPenalty = None,
    seed: o.Seed = None,
    stop: o.Stop = None,
    system: o.System = None,
    prefill_chunk: o.PrefillChunk = None,
    timing: TimingEach = False,
    stats: o.Stats = False,
    threads: o.Threads = None,
    compile: o.Compile = False,
    kv_dtype: o.KvDtype = "auto",
    history: History = None,
    draft: o.DraftModel = None,
    draft_tokens: o.DraftTokens = None,
    lookup: o.Lookup = False,
    context_shift: o.ContextShift = False,
    keep: o.Keep = None,
    no_color: o.NoColor = False,
):
    """Chat with a model; the KV cache is kept between turns so each turn prefills only what it adds."""
    from twice.core.engine import Engine, GenerationSettings
    from twice.core.errors import TokenizerError
    from twice.weights.load import load

    if no_color:
        COLOR["on"] = False
    from .prompt_input import check_text_arguments

    check_text_arguments(system=system, stop=stop)
    weights = o.weights_choice(dequantize, quantize)
    o.check_speculation(draft, draft_tokens, lookup)
    o.check_kv_dtype(kv_dtype)
    _check_shift_options(context_shift, keep)
    history_file = _history_file(history)
    o.apply_threads(threads)
    with Readout(show_text=False) as readout:
        drafted = o.load_draft(draft, None, device, dtype, progress=lambda msg: readout.set_phase("loading", msg))
        loaded = load(model, revision, device, dtype, progress=lambda msg: readout.set_phase("loading", msg),
                      weights=weights)
    tokenizer = loaded.tokenizer
    if tokenizer.chat_template is None:
        raise TokenizerError(f"{loaded.name}: the model has no chat template, so it cannot chat "
                             f"(twice generate --raw continues plain text)")
    # Render once now: a broken or hostile template (the sandbox refuses it) fails here with
    # one line, before the user has typed anything.
    tokenizer.render_chat(_with_system(system, [{"role": "user", "content": "Hello"}]))
    sampling = o.sampling_params(loaded.generation.sampling, temperature, top_k, top_p, min_p,
                                 repetition_penalty, seed)
    settings = GenerationSettings(max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop or ()),
                                  prefill_chunk=prefill_chunk, lookup=lookup, draft_tokens=draft_tokens)
    if context_shift:
        from twice.core.errors import UsageError
        from twice.core.prompt_cache import shift_refusal

        if (why := shift_refusal(loaded.model)) is not None:
            raise UsageError(why)
    larger = o.check_draft(loaded, drafted)
    engine = Engine(loaded.model, tokenizer, loaded.eos_token_ids, compile=compile,
                    draft=drafted.model if drafted is not None else None, kv_dtype=kv_dtype)
    o.settle_loaded()
    if keep is not None and keep >= engine.context_length:
        from twice.core.errors import UsageError

        raise UsageError(f"--keep {keep:,} protects the whole context ({engine.context_length:,} tokens), so "
                         "--context-shift could never drop a token; keep fewer")
    session = ChatSession(loaded, engine, settings, system, timing)
    session.stats = stats
    session.context_shift, session.keep = context_shift, keep or 0
    reader = make_reader(history_file)
    session.say(f"twice chat · {loaded.name} · context {engine.context_length} tokens · {o.dtype_words(loaded)} · "
                "/help for commands", "dim")
    if (compiled := o.compile_note(engine, compile)) is not None:
        session.say(f"note: {compiled}", "yellow")
    if larger is not None:
        session.say(f"note: {larger}", "yellow")
    session.run(reader)


# -- the conversation --------------------------------------------------------------------
class ChatSession:
    def __init__(self, loaded, engine, settings, system: str | None, timing: bool):
        self.loaded, self.engine, self.settings, self.timing = loaded, engine, settings, timing
        self.system = system or None
        self.messages: list[dict] = []  # user/assistant messages; the system message is kept apart
        self.last_result = None
        # Prompt tokens the last kept reply found in the cache: /retry forgets the rest so that
        # the reply is generated again from the same state (None: let the engine decide).
        self.last_reused: int | None = None
        self.err = err_console()
        self.interactive = False  # input has a history the user can recall (prompt-toolkit)
        self.context_shift, self.keep = False, 0  # --context-shift, --keep N

    # -- output --------------------------------------------------------------------------
    def say(self, text: str, style: str = "") -> None:
        # soft_wrap: rich would otherwise break long lines at 80 columns when stderr is not
        # a terminal, and every message here is meant to be one line.
        from .errors import printable  # a template's error text, a file's name: never raw escapes

        self.err.print(Text(printable(text), style=style), soft_wrap=True)

    def error(self, text: str) -> None:
        self.say(f"error: {text}", "red")

    # -- loop ----------------------------------------------------------------------------
    def run(self, reader) -> None:
        self.interactive = isinstance(reader, TerminalReader)
        while True:
            try:
                text = reader.read()
            except EOFError:
                return
            if text is None or not text.strip():
                continue
            try:
                if text.startswith("/") and not text.startswith("//"):
                    if self.command(text) == "exit":
                        return
                else:
                    self.turn(text[1:] if text.startswith("//") else text)
            except KeyboardInterrupt:
                # A second Ctrl-C while a reply or command winds down: the conversation
                # (only ever replaced whole) is intact, so keep the session.
                self.say("[interrupted]", "yellow")
            except Exception as e:  # noqa: BLE001 - no failure of one turn or command ends the chat
                self._failed(e)

    def _failed(self, e: Exception) -> None:
        """A turn or command failed with an error nothing closer handled (a tokenizer or
        template failure, an engine error, a bug): one line, the conversation as it was
        before that turn (it is only ever replaced whole, at the end of a turn), the KV
        cache forgotten (it may be half written), and the chat goes on. What makes going on
        impossible still ends it: the device failing (every later call would fail too; the
        conversation is rescued to a file first) and standard output gone."""
        from .errors import DEBUG

        if _output_gone(e):
            raise e
        self.engine.reset()
        if _device_failed(e):
            self._end_on_device_failure(e)
        if DEBUG["on"]:
            import traceback

            self.err.print(Text("".join(traceback.format_exception(e))), soft_wrap=True, markup=False)
        from twice.core.errors import TwiceError

        what = str(e) if isinstance(e, TwiceError) else f"{type(e).__name__}: {e}"
        what = (what.strip().splitlines() or [type(e).__name__])[0]
        self.error(f"{what} (the turn was not kept; the conversation is as it was before it; "
                   f"--debug shows the traceback)")

    def _end_on_device_failure(self, e: Exception) -> None:
        """The device failed (a CUDA error poisons the process): save what the user had,
        then end with exit 3 and one line that says where it is."""
        from twice.core.errors import DeviceError

        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = self._rescue()
        kept = f"; the conversation is saved in {where}" if where else ""
        raise DeviceError(f"the device failed during the chat ({first}); the chat cannot go on{kept}") from e

    def _rescue(self) -> Path | None:
        """Write the conversation to a new file in the twice cache folder (None if there is
        nothing to keep or it cannot be written)."""
        if not self.messages:
            return None
        import os
        import time

        from twice.core.paths import cache_dir
        from twice.weights.safe_write import ensure_folder

        try:
            folder = ensure_folder(cache_dir(), what="cache folder")
            path = folder / f"chat-rescued-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
            write_atomic(path, self._file_text())
            return path
        except Exception:  # noqa: BLE001 - already ending on a worse error
            return None

    # -- one turn --------------------------------------------------------------------------
    def turn(self, text: str) -> None:
        self._reply(self.messages + [{"role": "user", "content": text}])

    def _reply(self, conversation: list[dict], retry: bool = False) -> None:
        """Generate the reply to `conversation` (which ends with the user's message) and
        make it the conversation, with the reply, when the turn ends or is cut after some
        text. Anything else (an error, an exception, a cut before any text) leaves
        self.messages as it was before the turn: it is only ever replaced whole, here."""
        from twice.core.engine import Done, Notice, PrefillStart, Request, TokenEvent
        from twice.core.errors import PromptError, TokenizerError, TwiceError

        not_kept = "nothing regenerated" if retry else "message not sent"
        if self.context_shift:
            conversation = self._make_room(conversation)
        events = self.engine.generate(Request(messages=self._request_messages(conversation)), self.settings)
        readout = Readout()
        pieces: list[str] = []
        result = None
        started = cut = False
        try:
            with readout:
                for event in events:
                    if isinstance(event, Notice):
                        hint = " (/drop N or /reset makes room)" if event.context else ""
                        self.say(f"note: {event.message}{hint}", "yellow")
                    elif isinstance(event, Done):
                        result = event.result
                    else:
                        if isinstance(event, PrefillStart):
                            started = True
                        elif isinstance(event, TokenEvent):
                            pieces.append(event.text)
                        readout.on_event(event)
        except KeyboardInterrupt:
            events.close()
            cut = result is None
            if not started:
                # Interrupted while the engine was resizing or trimming its cache: do not
                # trust a half-updated cache; the next turn prefills from scratch.
                self.engine.reset()
        except PromptError as e:
            events.close()
            self._refuse(str(e), conversation, not_kept)
            return
        except TwiceError as e:  # the chat template fails on this conversation, ...
            events.close()
            if started or not isinstance(e, TokenizerError):
                self.engine.reset()  # it failed while the cache was being written
            self._end_line(pieces)
            self.error(f"{e} ({not_kept})")
            return
        except MemoryError:
            events.close()
            self.engine.reset()
            self._end_line(pieces)
            self.error("out of memory during the reply; the turn was not kept (/drop N or /reset frees room)")
            return
        except BaseException:
            events.close()
            self._end_line(pieces)
            raise  # run() says it in one line and goes on (or ends, for a signal)
        out = sys.stdout
        out.write("\n")
        out.flush()
        if cut:
            reply = "".join(pieces)
            self.last_result = None
            new = readout.prompt_tokens - readout.reused
            counts = f"reused {readout.reused} · prefilled {new} · {len(pieces)} tokens"
            if not reply.strip():
                # Nothing to keep: an empty assistant message would be saved and sent to the
                # template on the next turn (and a user message without a reply makes two
                # user messages in a row, which many templates refuse), so the turn goes.
                if retry:
                    self.say(f"[reply cut] before any text; the earlier reply is kept ({counts})", "yellow")
                else:
                    recall = "; ↑ recalls your message" if self.interactive else ""
                    self.say(f"[reply cut] before any text; the message was not kept{recall} ({counts})", "yellow")
                return
            self.messages = conversation + [{"role": "assistant", "content": reply, "cut": True}]
            self.last_reused = readout.reused
            self.say(f"[reply cut] {counts}", "yellow")
            return
        self.messages = conversation + [{"role": "assistant", "content": result.text}]
        self.last_result = result
        self.last_reused = result.reused_tokens
        self.say(_summary(result), "dim")
        if getattr(self, "stats", False):
            from .report import print_stats

            print_stats(result, None, self.err)
        if self.timing:
            from .report import timing_table

            self.err.print(timing_table(result, self.loaded))

    def _end_line(self, pieces: list[str]) -> None:
        """End the reply's line on stdout if some of it was written."""
        if any(pieces):
            sys.stdout.write("\n")
            sys.stdout.flush()

    def _refuse(self, message: str, conversation: list[dict], not_kept: str = "message not sent") -> None:
        """The prompt cannot be served. When the conversation outgrew the context, say what
        would make it fit; nothing is dropped without the user asking."""
        size = self._size(conversation)
        context = self.engine.context_length
        if size is None or size < context:
            self.error(f"{message} ({not_kept})")
            return
        n = self._turns_to_drop(conversation[-1])
        if n is None:
            system = self._size([]) if self.system else None
            if system is not None and system + 1 >= context:
                hint = f"the system message alone is {system} tokens; /system TEXT shortens it, /system - removes it"
            else:
                hint = "your message alone does not fit; shorten it"
        else:
            hint = (f"/drop {n} (drop the {n} oldest turn{'' if n == 1 else 's'}) makes room, "
                    f"/reset starts over")
        kept = "; ↑ recalls your message" if self.interactive else ""
        self.error(f"the conversation no longer fits the context ({size} tokens, context {context}); "
                   f"message not sent: {hint}{kept}")

    def _size(self, conversation: list[dict]) -> int | None:
        from twice.core.errors import TwiceError

        try:
            return len(self.loaded.tokenizer.encode_chat(self._request_messages(conversation),
                                                         limit=self.engine.context_length))  # sizes before tokens
        except TwiceError:
            return None

    def _turns_to_drop(self, user: dict) -> int | None:
        """Fewest oldest turns to drop so that the conversation plus `user` fits (leaving
        room for one new token); binary search, since the size shrinks as turns go."""
        turns = _turns(self.messages)
        context = self.engine.context_length

        def fits(n: int) -> bool:
            size = self._size([m for t in turns[n:] for m in t] + [user])
            return size is not None and size < context

        if not fits(len(turns)):
            return None
        lo, hi = 1, len(turns)
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _request_messages(self, messages: list[dict]) -> list[dict]:
        # Only role and content reach the template; markers such as "cut" stay ours.
        return _with_system(self.system, [{"role": m["role"], "content": m["content"]} for m in messages])

    # -- context shift (--context-shift) ------------------------------------------------------
    def _make_room(self, conversation: list[dict]) -> list[dict]:
        """The conversation to send: as it is if it fits with room for a reply (max new
        tokens, at most half the context); else without its fewest oldest turns that make
        it fit (the system message and the turns --keep protects stay), the KV cache shifted
        to match. If dropping every turn it may drop is not enough, it is sent as it is (and
        refused, or its reply shortened, as without --context-shift)."""
        context = self.engine.context_length
        budget = context - min(self.settings.max_new_tokens, context // 2)
        size = self._size(conversation)
        if size is None or size <= budget:
            return conversation
        turns, user = _turns(conversation[:-1]), conversation[-1]
        first = self._protected(turns)

        def without(n: int) -> list[dict]:
            return [m for t in turns[:first] + turns[first + n:] for m in t] + [user]

        def fits(n: int) -> bool:
            size = self._size(without(n))
            return size is not None and size <= budget

        if len(turns) == first or not fits(len(turns) - first):
            return conversation
        lo, hi = 1, len(turns) - first
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        shifted = without(lo)
        dropped, moved = self._shift_cache(shifted)
        turns_said = f"context shift: dropped the {lo} oldest turn{'' if lo == 1 else 's'}"
        if dropped:
            self.say(f"{turns_said} ({dropped} tokens of the KV cache; {moved} later tokens' keys re-rotated, "
                     "not prefilled again)", "dim")
        else:  # nothing cached lined up (or could be rotated): the turn prefills what differs
            self.say(f"{turns_said} (the KV cache could not be shifted: what follows the common start is "
                     "prefilled again)", "dim")
        return shifted

    def _protected(self, turns: list[list[dict]]) -> int:
        """How many leading turns --keep N protects: those that begin within the first N tokens
        (the first turn begins after the system message, not at 0)."""
        k = 0
        while self.keep and k < len(turns):
            begin = self._size([m for t in turns[:k] for m in t]) if k or self.system else 0
            if begin is None or begin >= self.keep:
                break
            k += 1
        return k

    def _shift_cache(self, conversation: list[dict]) -> tuple[int, int]:
        """Make the KV cache hold `conversation`'s tokens by dropping the span of cached
        tokens it no longer has and moving what follows (core/prompt_cache.shift): (tokens
        dropped, tokens moved). Nothing cached or nothing that lines up: (0, 0), and the next
        turn reuses the common prefix as usual."""
        from twice.core import prompt_cache as pc

        engine = self.engine
        if engine.cache is None or not engine.cached_ids:
            return 0, 0
        new = self.loaded.tokenizer.encode_chat(self._request_messages(conversation))
        old = engine.cached_ids[:engine.cache.length]
        keep, drop, matched = pc.plan_shift(old, new)
        if drop == 0 or matched == 0:
            return 0, 0
        engine.cached_ids = old[:keep]  # true of the cache at every moment of the shift
        if engine.draft is not None:
            engine.draft.reset()  # the draft's own cache prefills again
        try:
            pc.shift(engine.model, engine.cache, keep, drop, end=keep + drop + matched)
        except pc.PromptCacheError as e:  # a cache it cannot rotate: the next turn prefills after the kept prefix
            engine.cache.truncate(keep)
            self.say(f"note: {e}; the turn prefills what follows the first {keep} tokens", "yellow")
            return 0, 0
        engine.cached_ids = old[:keep] + old[keep + drop:keep + drop + matched]
        return drop, matched

    # -- slash commands ----------------------------------------------------------------------
    def command(self, text: str) -> str | None:
        parts = text.split(None, 1)
        name, arg = parts[0], (parts[1].strip() if len(parts) > 1 else "")
        handler = {
            "/help": self.cmd_help, "/reset": self.cmd_reset, "/system": self.cmd_system,
            "/drop": self.cmd_drop, "/stats": self.cmd_stats, "/save": self.cmd_save, "/load": self.cmd_load,
            "/save!": lambda arg: self.cmd_save(arg, force=True), "/set": self.cmd_set, "/retry": self.cmd_retry,
        }.get(name)
        if handler is None and name not in ("/exit", "/quit"):
            self.error(f"unknown command {name}; /help lists the commands "
                       f"(//text sends a message that starts with /)")
            return None
        if arg and name in NO_ARGUMENT:  # "/reset the system" must not clear the conversation
            self.error(f"{name} takes nothing after it, got {arg!r}; nothing was done")
            return None
        if name in ("/exit", "/quit"):
            return "exit"
        handler(arg)
        return None

    def cmd_help(self, arg: str) -> None:
        self.err.print(Text(HELP), soft_wrap=True)

    def cmd_reset(self, arg: str) -> None:
        self.messages = []
        self.last_result = self.last_reused = None
        self.engine.reset()
        self.say("conversation cleared" + (" (the system message stays)" if self.system else ""), "dim")

    def cmd_system(self, arg: str) -> None:
        if not arg:
            self.say(f"system message: {self.system!r}" if self.system else "no system message", "dim")
            return
        if arg == "-" and self.system is None:
            self.say("no system message to remove", "dim")
            return
        self.system = None if arg == "-" else arg
        self.last_reused = None
        # The rendered prompt changes from the start, so the next turn reuses only the
        # common prefix (the engine works that out); nothing else to do here.
        self.say("system message removed" if self.system is None else "system message set", "dim")

    def cmd_drop(self, arg: str) -> None:
        turns = _turns(self.messages)
        try:
            n = int(arg)
        except ValueError:
            n = 0
        if n < 1:
            self.error("usage: /drop N (N ≥ 1: how many of the oldest turns to drop)")
            return
        if n > len(turns):
            self.error(f"there {'is' if len(turns) == 1 else 'are'} only {len(turns)} "
                       f"turn{'' if len(turns) == 1 else 's'} to drop")
            return
        self.messages = [m for t in turns[n:] for m in t]
        self.last_reused = None
        left = len(turns) - n
        self.say(f"dropped {n} turn{'' if n == 1 else 's'}; {left} left", "dim")

    def cmd_stats(self, arg: str) -> None:
        if self.last_result is None:
            self.say("no timing yet: the last reply was cut or there was none", "dim")
            return
        from .report import timing_table

        self.err.print(timing_table(self.last_result, self.loaded))

    def _path(self, arg: str) -> Path | None:
        """/save's and /load's FILE (quotes off, ~ expanded), or None after saying why not."""
        from twice.core.errors import TwiceError

        text = _unquote(arg)
        if text.endswith("/"):  # pathlib drops the slash: x.json/ would be x.json, where a shell says "Not a directory"
            self.error(f"{text}: names a folder (it ends in /); give a file name (the current conversation is unchanged)")
            return None
        try:
            return user_path(text)
        except TwiceError as e:
            self.error(f"{e} (the current conversation is unchanged)")
            return None

    def cmd_save(self, arg: str, force: bool = False) -> None:
        if not arg:
            self.error(f"usage: /save{'!' if force else ''} FILE")
            return
        if (path := self._path(arg)) is None:
            return
        try:
            replaced = path.is_file() and not path.is_symlink()
            refuse_overwrite(path, force=force)
            write_atomic(path, self._file_text())
        except (OSError, ValueError) as e:
            self.error(f"cannot save to {path}: {os_message(e)}")
            return
        self.say(f"saved {counted(len(self.messages), 'message')} to {path}{' (replaced)' if replaced else ''}", "dim")
        self._save_cache(path, force)

    def _save_cache(self, path: Path, force: bool = False) -> None:
        """/save's KV sidecar (FILE.kv, a prompt-cache file), said on a line of its own. Like
        the conversation, it replaces a file there only for /save!; and /save! with nothing
        cached removes the old conversation's sidecar, which /load would otherwise take."""
        import os

        from twice.weights import prompt_cache_file as pcf

        from . import prompt_cache as pc

        engine, side = self.engine, pc.sidecar(path)
        there = os.path.lexists(side)
        # Only the cached tokens that are this conversation's own: after /drop, /system or a
        # /retry the cache still holds what was said before, which must not travel with the
        # saved file (a dropped turn was written to FILE.kv).
        keep = self._cached_prefix(self.messages) if engine.cache is not None else 0
        if keep < 1:
            if force and there and side.is_file() and not side.is_symlink() and pcf.looks_like_one(side):
                try:
                    side.unlink()
                    self.say(f"removed the earlier KV cache {side} (nothing is cached now)", "dim")
                except OSError as e:
                    self.say(f"note: the earlier KV cache {side} was not removed: {os_message(e)}", "yellow")
            return
        if there and not force and side.is_file() and not side.is_symlink() and pcf.looks_like_one(side):
            self.say(f"note: the KV cache was not saved to {side}: the file exists (/save! replaces it)", "yellow")
            return
        use = pc.PromptCacheUse(file=str(side))
        pc.save(engine, use, keep)
        if use.not_saved is not None:
            self.say(f"note: the KV cache was not saved to {side}: {use.not_saved}", "yellow")
            return
        self.say(f"saved its KV cache ({counted(use.saved_tokens, 'token')}) to {side}", "dim")

    def _cached_prefix(self, messages: list[dict]) -> int:
        """How many of the KV cache's tokens begin `messages` as the model reads them (the
        chat template's rendering, as the next turn would send it)."""
        engine = self.engine
        ids = self.loaded.tokenizer.encode_chat(self._request_messages(messages)) if messages else []
        return common_prefix(engine.cached_ids[:engine.cache.length], ids)

    def _file_text(self) -> str:
        data = {"version": SAVE_VERSION, "model": self.loaded.name, "system": self.system,
                "messages": self.messages}
        return json.dumps(data, ensure_ascii=False, indent=1) + "\n"

    def cmd_load(self, arg: str) -> None:
        if not arg:
            self.error("usage: /load FILE")
            return
        if (path := self._path(arg)) is None:
            return
        try:
            system, messages, model = read_conversation(path)
            self._check_template(system, messages)
        except (OSError, ValueError) as e:
            self.error(f"cannot load {path}: {os_message(e)} (the current conversation is unchanged)")
            return
        self.system, self.messages, self.last_result, self.last_reused = system, messages, None, None
        note = ""
        if model and model != self.loaded.name:
            note = f" (saved with {model}; continuing with {self.loaded.name})"
        self.say(f"loaded {counted(len(messages), 'message')} from {path}{note}", "dim")
        self._load_cache(path)

    def _load_cache(self, path: Path) -> None:
        """/load's KV sidecar, if there is one, said on a line of its own."""
        from . import prompt_cache as pc

        side = pc.sidecar(path)
        use = pc.load(self.engine, str(side))
        if use.refused is not None:
            self.say(f"note: the KV cache {side} not used ({use.refused}); the next turn prefills the conversation",
                     "yellow")
        if use.loaded_tokens:
            self.say(f"loaded its KV cache ({counted(use.loaded_tokens, 'token')}) from {side}", "dim")


    def _check_template(self, system: str | None, messages: list[dict]) -> None:
        """A loaded conversation must be one the model's chat template can go on with (some
        refuse two user messages in a row, or an assistant message first): render it as the
        next turn would (a reply to its last message, or a new message after its last
        reply) now, so that /load refuses it instead of every later turn failing."""
        from twice.core.errors import TwiceError

        probe = [{"role": m["role"], "content": m["content"]} for m in messages]
        if not probe or probe[-1]["role"] == "assistant":
            probe.append({"role": "user", "content": "Hello"})
        try:
            self.loaded.tokenizer.render_chat(_with_system(system, probe))
        except TwiceError as e:
            raise ValueError(f"the model's chat template cannot go on with it ({e})") from None

    def cmd_retry(self, arg: str) -> None:
        conversation = list(self.messages)
        if conversation and conversation[-1]["role"] == "assistant":
            conversation.pop()
        if not conversation or conversation[-1]["role"] != "user":
            self.error("nothing to retry: there is no reply yet")
            return
        if self.last_reused is not None:
            # Forget the cached tokens after what the replaced reply's turn found there, so
            # that the prompt is prefilled as it was then and, with a seed, the same settings
            # give the same reply. (Shrinking cached_ids only ever forgets.)
            self.engine.cached_ids = self.engine.cached_ids[:self.last_reused]
        self._reply(conversation, retry=True)

    def cmd_set(self, arg: str) -> None:
        import dataclasses

        from twice.core.errors import PromptError

        s = self.settings
        if not arg:
            self.say(_settings_line(s), "dim")
            return
        parts = arg.split()
        key = parts[0].lower().lstrip("-").replace("-", "_") if parts else ""
        if len(parts) != 2 or key not in SETTABLE:
            self.error(f"usage: /set NAME VALUE, NAME one of {', '.join(SETTABLE)} (/set alone shows them)")
            return
        text = parts[1]
        kind = SETTABLE[key]
        try:
            if key == "seed" and text.lower() in ("none", "off", "-"):
                value = None
            elif "_" in text:  # Python's int() and float() read 1_0 as 10: a typo, never a number here
                raise ValueError(text)
            else:
                value = kind(text)
        except ValueError:
            self.error(f"/set {key}: {'a whole number' if kind is int else 'a number'} is needed, got {text!r}")
            return
        try:
            o.check_flags(**{key: value})  # exactly the command-line flags' checks
            if key == "max_new_tokens":
                settings = dataclasses.replace(s, max_new_tokens=value)
            else:
                settings = dataclasses.replace(s, sampling=dataclasses.replace(s.sampling, **{key: value}))
        except PromptError as e:
            self.error(f"/set {key}: {e}")
            return
        before = _setting(s, key)
        self.settings = settings
        self.say(f"{key} {_setting(settings, key)} (was {before})", "dim")
        if key in ("top_k", "top_p", "min_p", "seed") and settings.sampling.temperature == 0:
            self.say(f"note: {key} has no effect with greedy decoding (temperature 0)", "yellow")


# -- settings and failures ----------------------------------------------------------------
def _history_file(history: str | None) -> Path | None | bool:
    """--history: None, the default file; '' (as bash's HISTFILE=), False: none kept beyond
    the session; a folder is refused before the model loads."""
    if history is None:
        return None
    if history == "":
        return False
    from twice.core.errors import UsageError

    path = user_path(history)
    if path.is_dir():
        raise UsageError(f"--history {history}: is a folder; name a file (or --history '' to keep none)")
    return path


def _check_shift_options(context_shift: bool, keep: int | None) -> None:
    from twice.core.errors import UsageError

    if keep is not None and not context_shift:
        raise UsageError("--keep needs --context-shift")
    if keep is not None and keep < 0:
        raise UsageError(f"--keep must be at least 0, got {keep}")


SETTABLE = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "repetition_penalty": float,
            "seed": int, "max_new_tokens": int}


def _setting(settings, key: str):
    value = settings.max_new_tokens if key == "max_new_tokens" else getattr(settings.sampling, key)
    return "none" if value is None else value


def _settings_line(settings) -> str:
    line = " · ".join(f"{key} {_setting(settings, key)}" for key in SETTABLE)
    return line + (" (greedy)" if settings.sampling.temperature == 0 else "")


def _output_gone(e: Exception) -> bool:
    """Standard output (or the terminal) can no longer take the replies: the chat ends."""
    import errno

    gone = (errno.EPIPE, errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.ENXIO)
    return isinstance(e, BrokenPipeError) or (isinstance(e, OSError) and e.filename is None and e.errno in gone)


_DEVICE_FAILURES = ("CUDA error", "device-side assert", "CUBLAS_STATUS", "CUDNN_STATUS", "illegal memory access",
                    "unspecified launch failure", "NCCL error", "HIP error")


def _device_failed(e: Exception) -> bool:
    """An error after which the device cannot be used again in this process (a CUDA
    error is sticky: every later call fails too). Out of memory is not one of them."""
    if type(e).__name__ == "AcceleratorError":  # torch >= 2.8 raises this for CUDA errors
        return True
    return isinstance(e, RuntimeError) and any(word in str(e) for word in _DEVICE_FAILURES)


# -- conversation helpers -----------------------------------------------------------------
def _with_system(system: str | None, messages: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + messages


def _turns(messages: list[dict]) -> list[list[dict]]:
    """Group messages into turns: a user message and what follows it up to the next one."""
    turns: list[list[dict]] = []
    for m in messages:
        if m["role"] == "user" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return turns


def _summary(result) -> str:
    new = result.prompt_tokens - result.reused_tokens
    parts = [f"reused {result.reused_tokens}", f"prefilled {new}", f"{result.generated_tokens} tokens"]
    if result.decode_tokens_per_second:
        parts.append(f"{result.decode_tokens_per_second:,.1f} tok/s")
    if result.finish_reason == "length":
        parts.append("stopped at --max-new-tokens")
    elif result.finish_reason == "context":
        parts.append("stopped: the context is full")
    return " · ".join(parts)


def _unquote(arg: str) -> str:
    if len(arg) >= 2 and arg[0] == arg[-1] and arg[0] in "'\"":
        return arg[1:-1]
    return arg
