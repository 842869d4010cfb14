"""Reading the small JSON files of a model folder, with errors that name the file."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from twice.core.config import ModelConfig, config_from_dict
from twice.core.errors import ConfigError, TwiceError


def read_json(path: Path, error: type[TwiceError] = ConfigError) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except UnicodeDecodeError:
        raise error(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    if not text.strip():
        raise error(f"{path}: file is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    return config_from_dict(read_json(path), source=str(path))


@dataclass(frozen=True)
class GenerationDefaults:
    """What generation_config.json says (eos ids and default sampling), or config.json's eos."""

    eos_token_ids: tuple[int, ...] = ()
    sampling: dict = field(default_factory=dict)  # temperature, top_k, top_p, min_p, repetition_penalty, do_sample


def read_generation_config(folder: Path, config: ModelConfig) -> GenerationDefaults:
    path = folder / "generation_config.json"
    if not path.is_file():
        return GenerationDefaults(eos_token_ids=config.eos_token_id)
    data = read_json(path)
    eos = data.get("eos_token_id", None)
    ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    keys = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")
    sampling = {k: data[k] for k in keys if data.get(k) is not None}
    return GenerationDefaults(eos_token_ids=tuple(ids) or config.eos_token_id, sampling=sampling)
