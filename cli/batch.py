"""`twice batch INPUT`: many prompts through the model in batches, one JSON line each.

The input is parsed whole before the model loads, so bad lines are reported (and, with
--strict, stop the run) before any work. Prompts are sorted by token length and run through the
engine's scheduler with at most --batch-size rows decoding together: as a row finishes,
the next prompt takes its place (core/scheduler.py), so the batch stays full until the
input runs out. Each result is written as one
complete line with a single write() (and fsync'ed to a file) the moment its row finishes:
a killed run loses only the prompts in flight, and `--resume` drops a torn last line,
skips the ids already written and appends the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import typer

from twice.core.errors import PromptError, TwiceError
from twice.core.fields import show
from twice.core.paths import user_path

from . import options as o
from .app import app
from .batch_input import FORMATS, KNOWN_KEYS, LineError, Record, parse_input, read_input
from .batch_output import (NullWriter, OutputState, Writer, check_output, hold_output, precheck_output, read_ours,
                           scan_output, check_model, check_resumed, check_settings, model_key)
from .console import COLOR, err_console
from .distributed import all_ok, find_parts, finish, merge_parts, my_share, part_path, start
from .errors import Terminated
from .format import counted, human_bytes, seconds

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
MEMORY_SHARE = 0.25  # of available memory, for the KV cache of one batch
FALLBACK_BATCH_SIZE = 8  # when available memory cannot be read


# -- planning: settings, tokens, batch size ---------------------------------------------
@dataclass
class Job:
    record: Record
    settings: object  # GenerationSettings
    ids: list[int]
    recorded: dict = field(default_factory=dict)  # settings_record: what its result line says it ran with


def build_request(record: Record, use_chat: bool, system: str | None):
    from twice.core.engine import Request

    if record.messages is not None:  # messages always go through the chat template
        messages = record.messages
        if system and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": system}, *messages]
        return Request(messages=messages)
    if use_chat:
        return Request(messages=([{"role": "system", "content": system}] if system else [])
                       + [{"role": "user", "content": record.prompt}])
    return Request(text=record.prompt)


def line_settings(record: Record, base):
    """The run's settings with this line's own values in their place."""
    opts = record.options
    sampling = {k: opts[k] for k in ("temperature", "top_p", "top_k", "seed") if k in opts}
    changes = {}
    if sampling:
        changes["sampling"] = dataclasses.replace(base.sampling, **sampling)  # validates
    if "max_new_tokens" in opts:
        changes["max_new_tokens"] = opts["max_new_tokens"]
    if "stop" in opts:
        changes["stop"] = opts["stop"]
    if "response_format" in opts:  # structured output for this line ({"type": "text"}: none)
        from twice.core.constraints import constraint_from_response_format

        changes["constraint"] = constraint_from_response_format(opts["response_format"])
    return dataclasses.replace(base, **changes) if changes else base


def settings_record(record: Record, settings, use_chat: bool, system: str | None, numerics: dict) -> dict:
    """The settings that choose a line's tokens (`settings`: its line_settings; `numerics`:
    the run's core.engine.numerics), as its result line records them: --resume compares
    them, so that one file never holds answers drawn two ways."""
    p = settings.sampling
    chat = record.messages is not None or use_chat
    out = {"max_new_tokens": settings.max_new_tokens, "temperature": p.temperature, "top_k": p.top_k,
           "top_p": p.top_p, "min_p": p.min_p, "repetition_penalty": p.repetition_penalty, "seed": p.seed,
           "stop": list(settings.stop), "chat": chat, **numerics}
    own_system = record.messages is not None and record.messages[0].get("role") == "system"
    if system is not None and chat and not own_system:  # where --system reaches the prompt
        out["system"] = system
    if "response_format" in record.options:
        out["response_format"] = record.options["response_format"]
    return out


def plan_jobs(records: list[Record], engine, base, use_chat: bool, system: str | None, numerics: dict):
    """Settings and token ids for each record; a line that cannot be tokenized (its chat
    template fails, say) becomes a LineError like a malformed line."""
    jobs: list[Job] = []
    errors: list[LineError] = []
    for record in records:
        try:
            settings = line_settings(record, base)
            ids = engine.tokenize(build_request(record, use_chat, system))
        except TwiceError as e:
            errors.append(LineError(record.line, str(e)))
            continue
        jobs.append(Job(record, settings, ids, settings_record(record, settings, use_chat, system, numerics)))
    return jobs, errors


def make_batches(jobs: list[Job], size: int) -> list[list[Job]]:
    """Sort by prompt length (input order breaks ties) so a batch's rows need little padding."""
    ordered = sorted(jobs, key=lambda j: (len(j.ids), j.record.line))
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def auto_batch_size(tokens_per_row: int, bytes_per_token: int, available: int | None) -> int:
    """The largest of 1, 2, 4, ..., 64 whose KV cache (rows × tokens × bytes per token) fits
    in MEMORY_SHARE of the available memory."""
    if available is None:
        return FALLBACK_BATCH_SIZE
    budget = available * MEMORY_SHARE
    fitting = [b for b in BATCH_SIZES if b * tokens_per_row * bytes_per_token <= budget]
    return fitting[-1] if fitting else 1


def available_memory(device) -> int | None:
    """Bytes available for the KV cache on the device (a torch.device), or None when unknown."""
    if device.type != "cpu":
        from twice.core.device import free_memory_bytes

        return free_memory_bytes(device)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# -- running ----------------------------------------------------------------------------
@dataclass
class Stats:
    prompts: int = 0  # rows sent to the engine
    done: int = 0
    failed: int = 0
    batches: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    peak_memory: int = 0
    kv_per_token: int = 0
    kv_allocated: list[int] = field(default_factory=list)
    started: float = 0.0
    wall: float = 0.0
    oom_retries: int = 0  # batches cut in half because the device ran out of memory
    joined: int = 0  # prompts that took a finished row's place while the others decoded
    largest_batch: int = 0  # most rows decoded together
    rows: int = 0  # rows decoded, summed over decode steps (a run again after running out of memory counts again)
    steps: int = 0  # decode steps
    decode_path: str = ""  # native | compiled | eager, as the engine reports it
    batch_invariant: bool = True  # every finished row bit for bit its prompt alone (GenerationResult.batch_invariant)


def result_line(record: Record, result, settings: dict | None = None) -> dict:
    echo = {"prompt": record.prompt} if record.messages is None else {"messages": record.messages}
    return {
        "id": record.id,
        **echo,
        "completion": result.text,
        "finish_reason": result.finish_reason,
        **({"error": result.error} if result.error is not None else {}),
        "prompt_tokens": result.prompt_tokens,
        "generated_tokens": result.generated_tokens,
        **({"settings": settings} if settings else {}),
        "timings": {
            "ttft_s": result.ttft_seconds,
            "prefill_s": result.prefill_seconds,
            "decode_s": result.decode_seconds,
            "decode_tokens_per_s": result.decode_tokens_per_second,
        },
    }


def error_line(record: Record, message: str) -> dict:
    return {"id": record.id, "error": message, "finish_reason": "error"}


def run_batches(engine, batches: list[list[Job]], writer: Writer, stats: Stats, progress, say) -> int:
    """Run the prompts through the engine's scheduler (core/scheduler.py) with at most the
    batch size decoding together: as a row finishes, the next prompt takes its place, so
    the batch stays full until the input runs out. Each result is written as its row
    finishes. When the device runs out of memory, the rows that finished are kept and the
    others are run again with half the rows (and the rest of the run at that size); only a
    single prompt that does not fit by itself stops the run. Returns the batch size in
    use at the end."""
    from twice.core.engine import Done, Notice
    from twice.core.errors import DeviceError
    from twice.core.scheduler import Scheduler, Token

    stats.started = time.perf_counter()
    pending = [job for batch in batches for job in batch]  # by prompt length: rows that run together end alike
    size = max((len(batch) for batch in batches), default=1)
    stats.kv_per_token = engine.cache_stats().bytes_per_token
    while pending:
        # No prefix copies: every row stays bit for bit its prompt alone (rows vs alone).
        scheduler = Scheduler(engine, max_batch=size, prefix_reuse=False)
        jobs: dict[int, Job] = {}
        for job in pending:
            try:
                jobs[scheduler.submit(job.ids, job.settings)] = job  # token ids: each prompt was tokenized once already
            except TwiceError as e:
                writer.write(error_line(job.record, str(e)))
                stats.failed += 1
                progress.advance(stats)
        stats.batches += 1
        stats.prompts += len(jobs)
        finished: set[int] = set()
        tokens = dict.fromkeys(jobs, 0)
        allocated = 0
        try:
            for event in scheduler.run():
                if isinstance(event, Token):
                    stats.generated_tokens += 1
                    tokens[event.row] += 1
                    allocated = max(allocated, event.cache.bytes_allocated)
                    progress.tick(stats)
                elif isinstance(event, Done):
                    _record_done(jobs[event.row], event.result, writer, stats)
                    finished.add(event.row)
                    progress.advance(stats)
                elif isinstance(event, Notice):
                    where = f"id {show(jobs[event.row].record.id)}: " if event.row is not None else ""
                    say(f"note: {where}{event.message}")
            pending = []
        except DeviceError as e:
            if "out of memory" not in str(e):
                raise
            left = [i for i in jobs if i not in finished]
            # The batch that failed: the prompts it had taken in (finished or not), at most its size.
            started = [i for i in left if i in scheduler.seqs and scheduler.seqs[i].state != "waiting"]
            held = min(size, len(started) + len(finished))
            if held <= 1:
                first = started[0] if started else left[0]
                raise DeviceError(f"{e} (even one prompt at a time: id {show(jobs[first].record.id)})") from None
            size = max(1, held // 2)
            stats.oom_retries += 1
            stats.prompts -= len(left)
            stats.generated_tokens -= sum(tokens[i] for i in left)
            say(f"note: out of memory with {held} prompts in a batch; running the "
                f"{counted(len(started), 'unfinished prompt')} again, {size} at a time")
            pending = [jobs[i] for i in left]
        finally:
            stats.largest_batch = max(stats.largest_batch, scheduler.counters.most_running)
            stats.rows += scheduler.counters.decode_tokens
            stats.steps += scheduler.counters.steps
            stats.joined += scheduler.counters.joined_running
            if allocated:
                stats.kv_allocated.append(allocated)
    stats.wall = time.perf_counter() - stats.started
    return size


def _record_done(job: Job, result, writer: Writer, stats: Stats) -> None:
    writer.write(result_line(job.record, result, job.recorded))
    stats.done += 1
    stats.prompt_tokens += result.prompt_tokens
    stats.ttfts.append(result.ttft_seconds)
    stats.peak_memory = max(stats.peak_memory, result.peak_memory_bytes)
    stats.batch_invariant = stats.batch_invariant and getattr(result, "batch_invariant", False)


class ProgressBar:
    """A transient rich progress bar on stderr (prompts done, aggregate tokens/s, ETA), or nothing."""

    REFRESH_SECONDS = 0.25

    def __init__(self, total: int, enabled: bool):
        self.bar = self.task = None
        self._last = 0.0
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("prompts"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                            TextColumn("ETA"), TimeRemainingColumn(), console=err_console(), transient=True,
                            redirect_stdout=False, redirect_stderr=False)
        self.task = self.bar.add_task("batch", total=total, rate="")

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def tick(self, stats: Stats) -> None:
        now = time.perf_counter()
        if self.bar is not None and now - self._last >= self.REFRESH_SECONDS:
            self._last = now
            self.bar.update(self.task, rate=_rate_text(stats, now))

    def advance(self, stats: Stats) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, rate=_rate_text(stats, time.perf_counter()))


def _rate_text(stats: Stats, now: float) -> str:
    elapsed = now - stats.started
    return f"{stats.generated_tokens / elapsed:,.1f} tok/s" if elapsed > 0 else ""


def summary_table(stats: Stats, batch_size: int, why: str, loaded, used: int | None = None):
    """--timing: totals over the run, each with the definition it was measured by.
    `batch_size` is the limit chosen before the run (`why` says how), `used` the limit at
    the end (smaller after running out of memory); the rows each batch really held are
    their own line, since fewer prompts than the limit make smaller batches."""
    from rich.table import Table

    t = Table(title="twice batch timing report", header_style="bold", title_justify="left")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_column("definition", style="dim")
    rate = stats.generated_tokens / stats.wall if stats.wall > 0 else 0.0
    mean_ttft = sum(stats.ttfts) / len(stats.ttfts) if stats.ttfts else 0.0
    rows = [
        ("load", seconds(loaded.load_seconds), "read config, weights and tokenizer"),
        ("prompts", f"{stats.done} done, {stats.failed} failed", "rows sent to the engine in this run"),
        ("batches", str(stats.batches), "scheduler runs: one, plus one per out-of-memory retry (prompts sorted by "
                                        "token length; a finished row's place goes to the next prompt)"),
        ("refills", f"{stats.joined:,}", "prompts that joined the batch while other rows were decoding"),
        ("batch size limit", str(batch_size) + (f" → {used}" if used is not None and used != batch_size else ""),
         f"most rows a batch may hold: {why}"
         + ("; → the limit it was cut to after running out of memory" if used is not None and used != batch_size
            else "")),
        ("rows per batch", f"{stats.largest_batch} most, {stats.rows / max(1, stats.steps):,.1f} mean",
         "rows decoded together: the most, and the mean over decode steps (a finished row's place goes to the "
         "next prompt, so the batch stays at the limit until the input runs out)"),
        ("rows vs alone", "identical" if stats.batch_invariant else "may differ",
         "identical: each row's tokens are bit for bit its prompt's alone, at any batch size (the native CPU "
         "step); may differ: PyTorch's kernels reduce a row differently beside others, so rows can part from "
         "-b 1 at near-tied tokens (bf16 above all)"),
        ("prompt tokens", f"{stats.prompt_tokens:,}", "sum over finished prompts"),
        ("generated tokens", f"{stats.generated_tokens:,}", "sum over all rows"),
        ("wall time", seconds(stats.wall), "first batch start → last batch end (prefill + decode, all batches)"),
        ("aggregate tokens/s", f"{rate:,.1f}", "generated tokens ÷ wall time"),
        ("mean TTFT", seconds(mean_ttft), "mean over prompts of: the run's start → its first token's text (waiting for a row included)"),
        ("peak memory", human_bytes(stats.peak_memory), "peak process RSS on cpu, torch.cuda.max_memory_allocated on cuda"),
        ("KV per token", human_bytes(stats.kv_per_token), "2 · layers · kv heads · head dim · bytes, one row"),
        ("KV per batch", human_bytes(max(stats.kv_allocated, default=0)),
         "largest batch cache allocated: rows × (the columns in use + the most new tokens a row may still add) "
         "× per token"),
    ]
    for row in rows:
        t.add_row(*row)
    return t


@dataclass
class Plan:
    """What the command decided before the model loaded."""

    name: str  # the input, as messages name it
    todo: list[Record]
    errors: list[LineError]
    state: OutputState
    out_path: Path | None
    already: int  # prompts skipped because --resume found them in the output
    strict: bool
    batch_size: int | None
    timing: bool
    system: str | None
    use_chat: bool = False
    compile: bool = False  # --compile: the torch.compile'd decode step (and CUDA graphs on a GPU)
    kv_dtype: str = "auto"  # --kv-dtype: the KV cache's element type (core/cache.py)
    numerics: dict = field(default_factory=dict)  # core.engine.numerics of the loaded model
    stats: bool = False  # -v/--stats: a few lines at the end
    quiet: bool = False  # a tensor-parallel rank other than 0: compute, write nothing
    model: str | None = None  # the loaded model's name, on every result line (and checked by --resume)


# -- the command ------------------------------------------------------------------------
BATCH_SIZE_HELP = (
    "Prompts per batch. Default: the largest of 1, 2, 4, ..., 64 whose KV cache for "
    "(longest prompt + max new tokens) tokens per row fits in 25% of the available memory "
    "(MemAvailable on cpu, after the weights are loaded); 8 when that cannot be read."
)


BATCH_HELP = "\n\n".join(" ".join(p.split()) for p in """
Generate for every prompt in INPUT, in batches, writing one JSON line per prompt.

A .jsonl line is an object with "id" (a string or an integer) and "prompt" (a string) or
"messages" (a list of role/content objects, always rendered with the chat template);
optional per-line "max_new_tokens", "temperature", "top_p", "top_k", "seed" and "stop"
replace the command-line values for that line; other keys are ignored. In a .txt file
each non-blank line is a prompt whose id is its line number.

Each output line holds id, prompt (or messages), completion, finish_reason,
prompt_tokens, generated_tokens, settings (what chose its tokens: --resume compares
them), timings and model; a prompt the engine cannot serve gets a line with id, error
and finish_reason "error" (as does one whose structured output's grammar fails part
way: its completion kept, incomplete). Lines are written (and synced to disk) as
prompts finish, so they come out in completion order: match them by id.

Bad input lines (invalid JSON, missing or mistyped fields, a repeated id; ids compare
as text, so 7 and "7" are the same) are reported as INPUT:LINE on stderr and skipped.
Exit status 0 when at least one prompt ran, 2 when none could.
""".strip().split("\n\n"))


@app.command(help=BATCH_HELP)
def batch(
    input: str = typer.Argument(..., help="A .txt file (one prompt per line), a .jsonl file, or '-' for standard input."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Write the JSON lines to FILE.jsonl (default: standard output). An existing file is never overwritten."),
    resume: bool = typer.Option(False, "--resume", help="Continue an earlier --output file: drop a torn last line, skip the ids already in it, append the rest (the same input, model and settings; others are refused)."),
    strict: bool = typer.Option(False, "--strict", help="Any bad input line stops the run before any work (all bad lines listed)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b", help=BATCH_SIZE_HELP),
    input_format: Optional[str] = typer.Option(None, "--format", help="txt or jsonl. Default: from the extension; otherwise (and for '-') jsonl when the first non-blank line starts with '{'."),
    model: o.Model = None,
    revision: o.Revision = None,
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    dequantize: o.Dequantize = False,
    quantize: o.Quantize = None,
    max_new_tokens: o.MaxNew = 256,
    temperature: o.Temperature = None,
    top_k: o.TopK = None,
    top_p: o.TopP = None,
    min_p: o.MinP = None,
    repetition_penalty: o.RepPenalty = None,
    seed: o.Seed = None,
    stop: o.Stop = None,
    system: o.System = None,
    chat: o.Chat = None,
    prefill_chunk: o.PrefillChunk = None,
    tp: o.TensorParallel = 1,
    timing: o.Timing = False,
    stats: o.Stats = False,
    threads: o.Threads = None,
    compile: o.Compile = False,
    kv_dtype: o.KvDtype = "auto",
    draft: o.DraftModel = None,
    draft_tokens: o.DraftTokens = None,
    lookup: o.Lookup = False,
    json_schema: o.JsonSchema = None,
    json_object: o.JsonObject = False,
    regex: o.Regex = None,
    grammar: o.Grammar = None,
    no_color: o.NoColor = False,
):
    if no_color:
        COLOR["on"] = False
    o.check_speculation(draft, draft_tokens, lookup, tp)
    constraint = o.constraint_spec(json_schema, json_object, regex, grammar)  # every line's, unless it names its own
    o.check_kv_dtype(kv_dtype)
    from .prompt_input import check_text_arguments

    check_text_arguments(system=system, stop=stop)
    weights = o.weights_choice(dequantize, quantize)
    o.apply_threads(threads)
    if batch_size is not None and batch_size < 1:
        raise PromptError(f"--batch-size must be at least 1, got {batch_size}")
    if input_format is not None and input_format not in FORMATS:
        raise PromptError(f"--format must be txt or jsonl, got {input_format!r}")
    launch, shard = start(device, tp)
    data_parallel = launch.world > 1 and not shard.active
    locks = contextlib.ExitStack()  # the output's (and parts') locks, held to the end of the run
    try:
        failure, merge = None, None
        try:
            merge = _batch_on_this_rank(launch, shard, data_parallel, input, output, resume, strict, batch_size,
                                        input_format, model, revision, device, dtype, chat, system, timing, compile,
                                        (max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed,
                                         stop, prefill_chunk, constraint), stats=stats, locks=locks, weights=weights,
                                        draft=draft, lookup=lookup, kv_dtype=kv_dtype)
        except _RefusedEverywhere:
            raise  # every rank knows already, and none has started
        except TwiceError as e:
            if not data_parallel:
                raise
            failure = e  # told to every rank below, so that none waits for it forever
        if data_parallel:
            failures = all_ok(launch, failure)
            if failures:
                raise TwiceError("; ".join(failures) + " (the parts written so far stay beside the output: "
                                 "the same command with --resume continues)")
            if launch.rank == 0 and merge is not None:
                final_path, records = merge
                lines = merge_parts(final_path, records)
                _say(f"merged the parts of {launch.world} ranks into {final_path} ({counted(lines, 'line')})")
    finally:
        locks.close()
        finish(launch)


class _RefusedEverywhere(TwiceError):
    """A run under torchrun that could not take its locks: every rank raises it together."""


def _claim(launch, data_parallel: bool, output: str | None, locks: contextlib.ExitStack) -> None:
    """The locks, taken before anything is read: rank 0 (one process, or the writer of a
    tensor-parallel run) locks the output; in a data-parallel run every rank also locks its
    own part. Under torchrun every rank learns whether all got theirs before any starts."""
    failure = None
    try:
        if output not in (None, "-"):
            path = precheck_output(output)
            if launch.rank == 0:
                hold_output(path, locks)
            if data_parallel:
                part = part_path(path, launch.rank, launch.world)
                precheck_output(str(part))
                hold_output(part, locks)
    except TwiceError as e:
        if launch.world == 1:
            raise
        failure = e
    if launch.world > 1:
        failures = all_ok(launch, failure)
        if failures:
            raise _RefusedEverywhere("; ".join(failures))


def _earlier_parts(out_path: Path | None, resume: bool, locks: contextlib.ExitStack, launch,
                   data_parallel: bool) -> list[Path]:
    """The part files an interrupted data-parallel run left beside the output (of any
    number of ranks). They need --resume. One process locks them all (it merges them into
    the output before it starts); a data-parallel rank gets those of a run of another size
    (read as done, merged by rank 0 at the end), its own run's being its ranks' business."""
    if out_path is None:
        return []
    parts = find_parts(out_path)
    if parts and not resume:
        raise PromptError(f"{parts[0][0]} already exists; pass --resume to continue the data-parallel run that "
                          "left it (or choose another --output file)")
    if data_parallel:
        return [path for path, _, world in parts if world != launch.world]
    if parts and launch.world > 1:  # tensor parallel: every rank would merge; refused alike on every rank
        raise PromptError(f"{parts[0][0]} is a part of an interrupted data-parallel run; continue that run "
                          "(torchrun without --tp) or run twice batch ... --resume in one process first")
    for path, _, _ in parts:
        precheck_output(str(path))
        hold_output(path, locks)
    return [path for path, _, _ in parts]


def _done_in(parts: list[Path]) -> set[str]:
    done: set[str] = set()
    for path in parts:
        data, _ = read_ours(path)
        done |= scan_output(data, str(path)).done
    return done


def _batch_on_this_rank(launch, shard, data_parallel, input, output, resume, strict, batch_size, input_format,
                        model, revision, device, dtype, chat, system, timing, compile, settings,
                        locks=None, stats=False, weights=None, draft=None, lookup=False, kv_dtype="auto"):
    """Everything one process does; in data-parallel mode, its share into its part file.
    Returns (output path, all records) for the merge when there is one."""
    from twice.core.engine import numerics
    from twice.weights.load import load

    if data_parallel and output in (None, "-"):
        raise PromptError("twice batch under torchrun without --tp splits the prompts across ranks and "
                          "needs --output FILE.jsonl (each rank writes a part, rank 0 merges them)")
    if output not in (None, "-") and input != "-" and user_path(output).resolve() == user_path(input).resolve():
        raise PromptError(f"{output}: is the input file; results go to another file (--output OUT.jsonl)")
    locks = locks if locks is not None else contextlib.ExitStack()
    _claim(launch, data_parallel, output, locks)  # before reading what is done
    out_path, state = check_output(output, resume)
    parts = _earlier_parts(out_path, resume, locks, launch, data_parallel)
    if state.existing and launch.rank == 0:  # before the input is read: standard input may wait
        _say(f"note: {output}: continuing ({counted(len(state.done), 'result')} of an earlier run kept)")
    name, text, fmt = read_input(input, input_format)
    records, errors = parse_input(text, fmt)
    if launch.rank == 0:
        _report_lines(name, errors, records)
    check_resumed(state, records, name, output)
    if strict and errors:
        raise PromptError(f"{counted(len(errors), 'bad line')} in {name}; nothing was run (--strict)")
    if not records and not errors:
        raise PromptError(f"{name} holds no prompts")
    if not records:
        raise PromptError(f"no prompt could run: all {counted(len(errors), 'line')} of {name} are bad")
    if parts and not data_parallel:  # an interrupted data-parallel run's results join the output first
        lines = merge_parts(out_path, records, parts)
        _say(f"note: merged {counted(len(parts), 'part file')} of an interrupted data-parallel run into {output} "
             f"({counted(lines, 'line')})")
        out_path, state = check_output(output, resume)
    mine, done, merge = records, state.done, None
    resumed = [(state, output)]  # outputs whose results must come from the model this run loads
    if data_parallel:  # this rank's share goes to its own part file
        merge = (out_path, records)
        mine = my_share(records, launch.rank, launch.world)
        final_done = state.done | _done_in(parts)  # parts of a run of another size: merged at the end
        out_path, state = check_output(str(part_path(out_path, launch.rank, launch.world)), resume)
        done = final_done | state.done
        resumed.append((state, str(out_path)))
    todo = [r for r in mine if r.key not in done]
    if not todo and data_parallel:
        return merge
    plan = Plan(name, todo, errors, state, out_path, already=len(mine) - len(todo), strict=strict,
                batch_size=batch_size, timing=timing, system=system, compile=compile, stats=stats, kv_dtype=kv_dtype)
    if shard.active and launch.rank != 0:
        plan.out_path, plan.quiet = None, True  # tensor parallel: rank 0 writes for all
    # Speculative decoding serves one sequence at a time (Engine.generate); a batch decodes
    # its rows together without it. The draft still loads first (a draft that fails, fails
    # before the model) and is checked against the model's vocabulary.
    drafted = o.load_draft(draft, None, device if launch.world == 1 else launch.device, dtype)
    loaded = _load(load, model, revision, device if launch.world == 1 else launch.device, dtype, shard, weights)
    for earlier, shown in resumed:
        check_model(earlier, loaded.name, shown)
    plan.model = model_key(loaded.name) or loaded.name  # a folder as the folder it is, from anywhere
    if draft is not None or lookup:
        o.check_draft(loaded, drafted)
        drafted = None
        if launch.rank == 0:
            _say(f"note: {'--draft' if draft is not None else '--lookup'} has no effect in twice batch: speculative "
                 "decoding serves one sequence at a time (twice generate, twice chat); the batch decodes without it")
    plan.use_chat = loaded.tokenizer.chat_template is not None if chat is None else chat
    if launch.rank == 0 and any(record.messages is None for record in plan.todo):
        if (ignored := o.system_ignored(plan.system, chat, plan.use_chat, " for prompt lines (messages lines keep it)")):
            _say(f"note: {ignored}")
    base = _base_settings(loaded, *settings)
    plan.numerics = numerics(loaded.model, plan.kv_dtype)
    expected = {}  # what this run would record for the ids an earlier run answered
    for record in records:
        if any(record.key in earlier.settings for earlier, _ in resumed):
            try:
                expected[record.key] = settings_record(record, line_settings(record, base), plan.use_chat,
                                                       plan.system, plan.numerics)
            except TwiceError:
                pass  # a line's own bad value: its line is an error line again
    for earlier, shown in resumed:
        check_settings(earlier, expected, shown)
    if not todo:  # said only once the results were found to be this model's and these settings'
        _say(f"nothing to do: all {counted(len(records), 'prompt')} of {name} are already in {output}")
        return merge
    _run(loaded, plan, base)
    return merge


def _run(loaded, plan: Plan, base) -> None:
    from twice.core.engine import Engine

    say = _quiet if plan.quiet else _say
    engine = Engine(loaded.model, loaded.tokenizer, loaded.eos_token_ids, compile=plan.compile, kv_dtype=plan.kv_dtype)
    o.settle_loaded()
    if (compiled := o.compile_note(engine, plan.compile)) is not None:
        say(f"note: {compiled}")
    jobs, token_errors = plan_jobs(plan.todo, engine, base, plan.use_chat, plan.system, plan.numerics)
    if not plan.quiet:
        _report_lines(plan.name, token_errors, [])
    errors = plan.errors + token_errors
    if plan.strict and token_errors:
        raise PromptError(f"{counted(len(token_errors), 'prompt')} of {plan.name} cannot be tokenized; "
                          "nothing was run (--strict)")
    if not jobs:
        raise PromptError(f"no prompt could run: all {counted(len(errors), 'line')} of {plan.name} are bad")
    size, why = (plan.batch_size, "--batch-size") if plan.batch_size else _auto_size(engine, jobs, loaded.device)
    if plan.state.keep_bytes is not None:
        say(f"note: {plan.out_path}: dropped an incomplete last line ({counted(plan.state.dropped_bytes, 'byte')}) "
            "left by an interrupted run")
    stats = Stats()
    writer = NullWriter() if plan.quiet else Writer(plan.out_path, plan.state, plan.model)
    used = size
    try:
        show_bar = not plan.quiet and _isatty(sys.stderr) and (plan.out_path is not None or not _isatty(sys.stdout))
        with ProgressBar(len(jobs), show_bar) as progress:
            used = run_batches(engine, make_batches(jobs, size), writer, stats, progress, say)
    except (KeyboardInterrupt, Terminated, TwiceError):
        # Said whatever was counted: a signal can land between a line's write and its count.
        if plan.out_path is not None:
            say(f"note: the results so far are in {plan.out_path}; the same command with --resume "
                "continues from there")
        raise
    finally:
        writer.close()
    if plan.quiet:
        return
    if plan.timing:
        from .report import report_console

        report_console().print(summary_table(stats, size, why, loaded, used if stats.oom_retries else None))
    if plan.stats:
        _print_stats(stats, size, loaded, engine)

    _finish(stats, len(errors), plan.already)


def _print_stats(stats: Stats, size: int, loaded, engine) -> None:
    """-v/--stats: the run in a few lines (--timing has every number with its definition)."""
    rate = stats.generated_tokens / stats.wall if stats.wall > 0 else 0.0
    mean_ttft = sum(stats.ttfts) / len(stats.ttfts) if stats.ttfts else 0.0
    lines = [
        f"load      {seconds(loaded.load_seconds)} · {o.dtype_words(loaded)}",
        f"prompts   {stats.done:,} done in {stats.batches:,} batch{'' if stats.batches == 1 else 'es'} "
        f"(at most {size} rows, {stats.largest_batch} the most held) · {stats.prompt_tokens:,} prompt tokens · "
        f"mean TTFT {seconds(mean_ttft)}",
        f"decode    {stats.generated_tokens:,} tokens in {seconds(stats.wall)}, {rate:,.1f} tok/s over the batch "
        f"({engine.decode_path} step)",
        f"KV cache  {human_bytes(stats.kv_per_token)}/token per row, {human_bytes(max(stats.kv_allocated, default=0))} "
        "allocated for the largest batch",
    ]
    for line in lines:
        _say(line)


def _quiet(message: str) -> None:
    """What a tensor-parallel rank other than 0 says: nothing (rank 0 says it)."""


def _finish(stats: Stats, bad_lines: int, already: int) -> None:
    parts = [f"{counted(stats.done, 'prompt')} done", f"{bad_lines} skipped (bad lines)"]
    if stats.failed:
        parts.insert(1, f"{stats.failed} failed (error lines in the output)")
    if already:
        parts.append(f"{already} already in the output")
    _say(", ".join(parts))
    if not stats.done:
        raise PromptError("no prompt could be served (see the error lines)")


def _base_settings(loaded, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed, stop,
                   prefill_chunk, constraint=None):
    from twice.core.engine import GenerationSettings

    sampling = o.sampling_params(loaded.generation.sampling, temperature, top_k, top_p, min_p, repetition_penalty, seed)
    return GenerationSettings(max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop or ()),
                              prefill_chunk=prefill_chunk, constraint=constraint)


def _auto_size(engine, jobs: list[Job], device) -> tuple[int, str]:
    """The batch size from memory, and how it was chosen (for --timing)."""
    longest = max(len(j.ids) for j in jobs)
    most_new = max(j.settings.max_new_tokens for j in jobs)
    tokens = min(longest + most_new, engine.context_length)  # the engine clamps to the context
    available = available_memory(device)
    size = auto_batch_size(tokens, engine.cache_stats().bytes_per_token, available)
    if available is None:
        return size, f"available memory on {device.type} unknown: the fallback"
    return size, (f"largest power of 2 ≤ 64 with rows × {tokens} tokens × KV per token ≤ "
                  f"{MEMORY_SHARE:.0%} of {human_bytes(available)} available")


def _load(load, model, revision, device, dtype, shard, weights=None):
    err = err_console()
    if not _isatty(sys.stderr):
        return load(model, revision, device, dtype, shard=shard, weights=weights)
    with err.status("loading the model") as status:
        return load(model, revision, device, dtype, progress=lambda msg: status.update(f"loading: {msg}"), shard=shard,
                    weights=weights)


def _report_lines(name: str, errors: list[LineError], records: list[Record]) -> None:
    for e in errors:
        _say(f"{name}:{e.line}: {e.message}")
    unused: dict[str, int] = {}
    for r in records:
        for key in r.unknown_keys:
            unused.setdefault(key, r.line)
    for key, line in unused.items():  # once per key, not per line: a typo shows up without flooding
        _say(f"note: {name}:{line}: key {show(key)} is not used (known: {', '.join(sorted(KNOWN_KEYS))})")


def _say(message: str) -> None:
    # markup off: messages quote user text, whose brackets are not rich markup.
    from .errors import printable  # messages quote files' contents: never raw escapes

    err_console().print(printable(message), markup=False, highlight=False, soft_wrap=True)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
