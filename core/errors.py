"""Errors the engine and the loaders raise.

Every failure a user can cause (a bad model folder, an impossible setting, a prompt that
does not fit) is a `TwiceError` whose message is one line that names the thing at fault.
The CLI prints that line and exits with `exit_code`; anything else is a bug and keeps
its traceback.
"""


class TwiceError(Exception):
    """A problem with the user's input or environment, explained in one line."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line


class ConfigError(TwiceError):
    """config.json (or generation_config.json) is missing, malformed or describes an impossible model."""


class UnsupportedModelError(TwiceError):
    """The checkpoint is well formed but describes an architecture or feature twice does not implement."""


class WeightsError(TwiceError):
    """A checkpoint file is missing, truncated, corrupt, or its tensors do not fit the config."""


class TokenizerError(TwiceError):
    """tokenizer.json / tokenizer_config.json / the chat template is missing or cannot be used."""


class ModelNotFoundError(TwiceError):
    """A model reference points at nothing we can read (no folder, not cached, offline)."""


class PromptError(TwiceError):
    """The prompt or the generation settings cannot be served (empty, too long, contradictory)."""


class UsageError(TwiceError):
    """A command-line value is not one of the accepted ones (an unknown dtype or device name)."""


class DeviceError(TwiceError):
    """The requested device or dtype is not available, or the device ran out of memory."""

    exit_code = 3
