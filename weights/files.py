"""Reading the small JSON files of a model folder, with errors that name the file."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from twice.core.config import ModelConfig, config_from_dict
from twice.core.errors import ConfigError, TwiceError
from twice.core.fields import Fields, describe_json_error, loads


MAX_JSON_BYTES = 64 << 20  # a model folder's JSON files are kilobytes; tokenizer_config.json can be a few MB


def open_regular(path: Path, error: type[TwiceError] = ConfigError):
    """Open `path` for reading only if it is a regular file (following links, as model
    folders of the Hub cache are links). A FIFO, a device or a socket is refused without
    blocking: the file is opened non-blocking and checked with fstat before any read."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except IsADirectoryError:
        raise error(f"{path}: is a folder, not a file") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{path}: not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_limited(path: Path, limit: int, error: type[TwiceError] = ConfigError) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (its size is checked first)."""
    with open_regular(path, error) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise error(f"{path}: {size:,} bytes, more than the {limit:,} twice reads from such a file")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise error(f"{path}: cannot read ({e.strerror or e})") from None
    if len(data) > limit:
        raise error(f"{path}: more than the {limit:,} bytes twice reads from such a file")
    return data


def parse_json(raw: bytes | str, source: str, error: type[TwiceError] = ConfigError, **kwargs):
    """`fields.loads` with the error naming `source`."""
    if not (raw.strip() if isinstance(raw, str) else raw.strip()):
        raise error(f"{source}: file is empty")
    try:
        return loads(raw, **kwargs)
    except ValueError as e:
        raise error(f"{source}: {describe_json_error(e)}") from None


def read_json(path: Path, error: type[TwiceError] = ConfigError, limit: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from a regular file: size, depth and number sizes bounded (see
    core/fields.py), every failure one line naming the file."""
    data = parse_json(read_limited(path, limit, error), str(path), error)
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.exists():  # a FIFO or device is refused by read_json, never opened blocking
        raise ConfigError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    return config_from_dict(read_json(path), source=str(path))


@dataclass(frozen=True)
class GenerationDefaults:
    """What generation_config.json says (eos ids and default sampling), or config.json's eos."""

    eos_token_ids: tuple[int, ...] = ()
    sampling: dict = field(default_factory=dict)  # temperature, top_k, top_p, min_p, repetition_penalty, do_sample


def read_generation_config(folder: Path, config: ModelConfig) -> GenerationDefaults:
    """eos ids and default sampling from generation_config.json, each value checked for its
    type and range (one line naming the file and the key): a wrong value is an error, never
    guessed at ("do_sample": "no" is not true, "temperature": "hot" is not ignored)."""
    path = folder / "generation_config.json"
    if not path.exists():
        return GenerationDefaults(eos_token_ids=config.eos_token_id)
    f = Fields(read_json(path), str(path))
    ids = f.token_ids("eos_token_id")
    # The same ranges as the --temperature/--top-k/... flags (core/sampling.py)
    checked = {
        "do_sample": f.bool("do_sample", None),
        "temperature": f.float("temperature", None, lo=0),
        "top_k": f.int("top_k", None, lo=0),
        "top_p": f.float("top_p", None, lo=0, lo_open=True, hi=1),
        "min_p": f.float("min_p", None, lo=0, hi=1),
        "repetition_penalty": f.float("repetition_penalty", None, lo=0, lo_open=True),
    }
    if checked["min_p"] == 1:
        raise ConfigError(f"{path}: min_p must be a number in [0, 1), got 1")
    sampling = {k: v for k, v in checked.items() if v is not None}
    return GenerationDefaults(eos_token_ids=ids or config.eos_token_id, sampling=sampling)
