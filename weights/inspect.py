"""Facts about a model folder without loading its weights (for `twice info`)."""

from __future__ import annotations

from twice.core.device import DTYPE_NAMES, DTYPES, cpu_auto_dtype
from twice.core.errors import UsageError

from .checkpoint import checkpoint_files, load_into, validate_header
from .files import read_config, read_generation_config
from .gguf_load import gguf_source, named_as_the_gguf, stored_formats
from .resolve import resolve
from .tokenizer import Tokenizer

_STORED = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def describe(ref: str | None, revision: str | None = None, dtype: str = "auto", dequantize: bool = False) -> dict:
    # The dtype generation would use on this machine's CPU (info never touches a GPU).
    name = DTYPE_NAMES[cpu_auto_dtype()] if dtype == "auto" else dtype
    if name not in DTYPES:  # before resolving: a typo must not start a download
        raise UsageError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    folder = resolve(ref, revision, dequantize=dequantize)
    gguf = gguf_source(folder)
    with named_as_the_gguf(folder, gguf):
        config = read_config(folder)
        generation = read_generation_config(folder, config)
        tokenizer = Tokenizer(folder, shown_as=gguf)
    element = DTYPES[name].itemsize
    params = config.parameter_count()
    if gguf is not None:  # run as stored: the file's types and bytes
        formats = stored_formats(gguf)
        stored = set(formats["types"])
    else:
        stored = set()
        files = checkpoint_files(folder, config)
        for path in files:
            header = validate_header(path)
            stored |= {_STORED.get(v["dtype"], v["dtype"]) for k, v in header.items() if k != "__metadata__"}
        # What generate would refuse, info refuses too: tensors missing, unused or of other
        # shapes than the config implies (headers only, no data read), a tokenizer too big
        # for the vocabulary.
        from twice.core.models import meta_model

        from .load import check_vocabulary

        check_vocabulary(tokenizer, config, folder)
        load_into(meta_model(config), folder, files, check_only=True)
        formats = {"types": {name: params}, "tensors": {}, "weight_bytes": params * element,
                   "bits_per_weight": 8.0 * element}
    # A mixture of experts reads only its chosen experts' weights per token (family.py).
    from twice.core.models import decode_steps, family

    counter = family(config.model_type).active_parameter_count
    active = counter(config) if counter is not None else params
    active_bytes = (active * element if gguf is None
                    else formats["weight_bytes"] * active // max(1, params))  # as stored: in proportion
    eos = list(generation.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return {
        "name": ref or folder.name,
        "folder": str(folder),
        "model_type": config.model_type,
        "parameters": params,
        "active_parameters": active,
        "stored_dtype": ", ".join(sorted(stored)),
        "dtype": name,
        "weight_bytes": formats["weight_bytes"],
        "active_weight_bytes": active_bytes,
        "weight_format": formats,
        "source": str(gguf) if gguf is not None else None,
        "context_length": config.max_position_embeddings,
        "layers": config.num_hidden_layers,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "rope": config.rope_parameters,
        "sliding_window": config.sliding_window,
        "kv_bytes_per_token": config.kv_bytes_per_token(element),
        "kv_bytes_full_context": config.kv_bytes_per_token(element) * config.max_position_embeddings,
        "chat_template": tokenizer.chat_template is not None,
        "eos_token_ids": eos,
        "decode_steps": decode_steps(config),
    }
