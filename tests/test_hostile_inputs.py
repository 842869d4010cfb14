"""Hostile inputs: broken model folders and GGUF files, tokenizers and chat templates that
misbehave or attack, prompts that cannot be served, bad batch files, and writes that an
attacker tries to redirect with symbolic links.

Each bad input ends in one line on stderr (`twice: error: ...` naming the file and the
problem) and exit code 2, never a traceback; nothing is written where it should not be.
tests/README.md lists every case with its outcome. Most cases run the CLI in-process
(fast); tests/test_faults.py has the ones that need real processes and signals.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from clirun import one_error_line, run_inprocess
from tiny import add_gguf_metadata, set_json
from twice.core.errors import TokenizerError, TwiceError


# -- helpers ---------------------------------------------------------------------------------
def copy_model(model_dirs, tmp_path, family="llama", name="model") -> Path:
    dest = tmp_path / name
    shutil.copytree(model_dirs(family), dest)
    return dest


def read_header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_header(path: Path, header: dict, body: bytes, raw: bytes | None = None) -> None:
    encoded = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)


def generate(capsys, folder, *args, prompt="hi", **kw):
    return run_inprocess(["generate", prompt, "--model", str(folder), "-n", "2", *args], capsys, **kw)


# -- model folders ---------------------------------------------------------------------------
# Each breaker damages a copy of a good folder and returns (file that must be named, words).
def empty_config(folder):
    (folder / "config.json").write_text("")
    return "config.json", "file is empty"


def config_not_an_object(folder):
    (folder / "config.json").write_text("[1, 2]")
    return "config.json", "expected a JSON object"


def empty_tokenizer(folder):
    (folder / "tokenizer.json").write_text("")
    return "tokenizer.json", "cannot load tokenizer"


def empty_tokenizer_config(folder):
    (folder / "tokenizer_config.json").write_text("")
    return "tokenizer_config.json", "file is empty"


def empty_safetensors(folder):
    (folder / "model.safetensors").write_bytes(b"")
    return "model.safetensors", "truncated safetensors file (0 bytes"


def header_not_an_object(folder):
    write_header(folder / "model.safetensors", {}, b"", raw=b"[1, 2, 3]")
    return "model.safetensors", "not a JSON object"


def offsets_past_the_end(folder):
    path = folder / "model.safetensors"
    header, body = read_header(path)
    start, end = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [start + 10**9, end + 10**9]
    write_header(path, header, body)
    return "model.safetensors", "truncated: tensor 'model.norm.weight' ends at byte"


def negative_shape(folder):
    path = folder / "model.safetensors"
    header, body = read_header(path)
    header["model.norm.weight"]["shape"] = [-64]
    write_header(path, header, body)
    return "model.safetensors", "corrupt safetensors entry for tensor 'model.norm.weight'"


def fractional_offsets(folder):
    path = folder / "model.safetensors"
    header, body = read_header(path)
    start, end = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [start + 0.0, end + 0.0]
    write_header(path, header, body)
    return "model.safetensors", "corrupt safetensors entry for tensor 'model.norm.weight'"


def name_twice_in_one_file(folder):
    path = folder / "model.safetensors"
    header, body = read_header(path)
    text = json.dumps(header)
    entry = json.dumps({"model.norm.weight": header["model.norm.weight"]})[1:-1]
    write_header(path, header, body, raw=(text[:-1] + ", " + entry + "}").encode())
    return "model.safetensors", "the name 'model.norm.weight' appears twice"


def integer_tensor(folder):
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return "model.safetensors", "tensor 'model.norm.weight' has dtype I32, expected one of F64, F32, F16, BF16"


def nan_weights(folder):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return "model.safetensors", "contains NaN or infinite values"


def tensor_in_two_shards(folder):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    first = {n: tensors[n] for n in names[: len(names) // 2]} | {"model.norm.weight": tensors["model.norm.weight"]}
    second = {n: tensors[n] for n in names[len(names) // 2:]}
    (folder / "model.safetensors").unlink()
    save_file(first, folder / "model-00001-of-00002.safetensors")
    save_file(second, folder / "model-00002-of-00002.safetensors")
    index = {n: "model-00001-of-00002.safetensors" for n in first} | {n: "model-00002-of-00002.safetensors"
                                                                      for n in second}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return "model-00002-of-00002.safetensors", "tensor 'model.norm.weight' is also in"


def empty_index(folder):
    (folder / "model.safetensors.index.json").write_text("")
    return "model.safetensors.index.json", "not a valid safetensors index"


def index_naming_an_outside_file(folder):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "/etc/passwd"}}))
    return "model.safetensors.index.json", "invalid shard name '/etc/passwd'"


def negative_context(folder):
    set_json(folder / "config.json", max_position_embeddings=-5)
    return "config.json", "max_position_embeddings must be a positive integer, got -5"


def hidden_not_divisible_by_heads(folder):
    set_json(folder / "config.json", num_attention_heads=3, num_key_value_heads=1, head_dim=None)
    return "config.json", "hidden_size (64) is not divisible by num_attention_heads (3)"


def heads_not_a_multiple_of_kv_heads(folder):
    set_json(folder / "config.json", num_key_value_heads=3)
    return "config.json", "must be a multiple of num_key_value_heads (3)"


def nan_in_config(folder):
    path = folder / "config.json"
    path.write_text(path.read_text().replace("1e-06", "NaN"))
    return "config.json", "NaN is not a JSON value"  # refused by the JSON reader itself (core/fields.py)


def no_model_type(folder):
    set_json(folder / "config.json", model_type=None)
    return "config.json", "no model_type is not supported"


def absurd_vocab(folder):
    set_json(folder / "config.json", vocab_size=10**12)
    return "config.json", "describes a model of 128,000,000,061,760 parameters but the checkpoint holds 127,296"


def absurd_layer_count(folder):
    set_json(folder / "config.json", num_hidden_layers=10**9)
    return "config.json", "num_hidden_layers 1000000000 is not a plausible layer count"


def dynamic_rope(folder):
    set_json(folder / "config.json", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    return "config.json", "rope type \"dynamic\" is not supported"


def broken_generation_config(folder):
    (folder / "generation_config.json").write_text("{")
    return "generation_config.json", "invalid JSON"


def chat_template_file_not_utf8(folder):
    (folder / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    return "chat_template.jinja", "cannot read"


def template_syntax_error(folder):
    set_json(folder / "tokenizer_config.json", chat_template="{% for %}")
    return "tokenizer_config.json", "chat template syntax error at line 1"


def template_raises(folder):
    set_json(folder / "tokenizer_config.json", chat_template="{{ raise_exception('this model has no user role') }}")
    return "tokenizer_config.json", "chat template failed to render: this model has no user role"


def template_misuses_a_variable(folder):
    set_json(folder / "tokenizer_config.json", chat_template="{{ messages.nope.deeper }}")
    return "tokenizer_config.json", "chat template failed to render: 'list object' has no attribute 'nope'"


def template_needs_a_missing_bos(folder):
    set_json(folder / "tokenizer_config.json", bos_token=None,
             chat_template="{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    return "tokenizer_config.json", "the chat template uses bos_token, but"


MODEL_BREAKS = [
    empty_config, config_not_an_object, empty_tokenizer, empty_tokenizer_config, empty_safetensors,
    header_not_an_object, offsets_past_the_end, negative_shape, fractional_offsets, name_twice_in_one_file,
    integer_tensor, nan_weights, tensor_in_two_shards, empty_index, index_naming_an_outside_file, negative_context,
    hidden_not_divisible_by_heads, heads_not_a_multiple_of_kv_heads, nan_in_config, no_model_type, absurd_vocab,
    absurd_layer_count, dynamic_rope, broken_generation_config, chat_template_file_not_utf8,
    template_syntax_error, template_raises, template_misuses_a_variable, template_needs_a_missing_bos,
]


@pytest.mark.parametrize("breaker", MODEL_BREAKS, ids=lambda f: f.__name__)
def test_broken_model_folder(model_dirs, tmp_path, capsys, breaker):
    folder = copy_model(model_dirs, tmp_path)
    name, words = breaker(folder)
    started = time.monotonic()
    line = one_error_line(generate(capsys, folder))
    assert time.monotonic() - started < 10  # refused before allocating anything absurd
    assert str(folder / name) in line, line  # names the file ...
    assert words in line, line  # ... and the problem


def test_debug_shows_the_traceback(model_dirs, tmp_path, capsys, monkeypatch):
    from twice.cli.errors import DEBUG

    folder = copy_model(model_dirs, tmp_path)
    empty_safetensors(folder)
    monkeypatch.setitem(DEBUG, "on", False)
    with pytest.raises(TwiceError, match="truncated safetensors file"):
        run_inprocess(["--debug", "generate", "hi", "--model", str(folder)], capsys)
    assert DEBUG["on"]  # --debug let the exception through instead of a one-line error


def test_chat_and_batch_refuse_a_broken_template_up_front(model_dirs, tmp_path, capsys, monkeypatch):
    folder = copy_model(model_dirs, tmp_path)
    template_raises(folder)
    r = run_inprocess(["chat", "--model", str(folder)], capsys, b"hello\n", monkeypatch)
    assert "this model has no user role" in one_error_line(r) and r.out == ""
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\n")
    r = run_inprocess(["batch", str(src), "--model", str(folder)], capsys)
    assert r.code == 2 and r.out == "" and "Traceback" not in r.err
    assert r.err.count("this model has no user role") == 2  # each line says why it cannot run
    assert "twice: error: no prompt could run" in r.err


# -- chat templates: the sandbox -----------------------------------------------------------
def template_tokenizer(model_dirs, tmp_path, template: str, **config):
    from twice.weights.tokenizer import Tokenizer

    folder = tmp_path / "tok"
    folder.mkdir(exist_ok=True)
    shutil.copy(model_dirs("llama") / "tokenizer.json", folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", **config, "chat_template": template}))
    return Tokenizer(folder)


MESSAGES = [{"role": "user", "content": "Hello"}]
ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'].system('id') }}",
    "{{ namespace.__init__.__globals__['__builtins__'] }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}{{ ns.__class__.__mro__ }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os }}",
    "{{ self.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
    "{{ strftime_now.__globals__.datetime }}",
    "{{ ''|attr('__class__')|attr('__mro__') }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ '{0.__globals__}'.format(raise_exception) }}",
    "{{ dict.mro() }}",
    "{{ messages.append({'role': 'system', 'content': 'injected'}) }}{{ messages }}",
    "{{ messages.__setitem__(0, 1) }}",
    "{% include '/etc/passwd' %}",
    "{% import '/etc/passwd' as x %}",
    "{% extends '/etc/passwd' %}",
    "{{ range.__self__ }}{{ range.__call__.__self__.__dict__ }}",
    "{{ (1).__class__.__base__.__subclasses__() }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_sandbox_escape_attempts_get_nothing(model_dirs, tmp_path, template):
    tok = template_tokenizer(model_dirs, tmp_path, template)
    try:
        text = tok.render_chat(MESSAGES)
    except TokenizerError as e:
        assert "\n" not in str(e)
        return
    # What renders is harmless: no Python object, file or command output leaked into it.
    for leak in ("<class", "<function", "<module", "<built-in", "root:", "uid=", "injected", "__"):
        assert leak not in text, (template, text)


COSTLY = [
    ("{% for i in range(10**9) %}x{% endfor %}", "MAX_RANGE"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "loop iterations"),
    ("{% macro m(n) %}{% if n %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(60) }}", "calls"),
    ("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "RecursionError"),
    ("{{ 'x' * 10**10 }}", "would exceed the limit"),
    ("{{ [0] * 10**9 }}", "would exceed the limit"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "would exceed the limit"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "would exceed the limit"),
    ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     "bits"),
    ("{{ 7 ** 100000000 }}", "bits"),  # jinja reads a ** b ** c as (a ** b) ** c
    ("{{ 'x'|center(10**10) }}", "would exceed the limit"),
    ("{{ 'x'.ljust(10**10) }}", "would exceed the limit"),
    ("{{ 'a\tb'.expandtabs(10**9) }}", "would exceed the limit"),
    ("{{ ('a' * 10000).replace('', 'b' * 10000) }}", "would exceed the limit"),
    ("{{ 'x'|indent(10**9) }}", "would exceed the limit"),
    ("{{ '%100000000s'|format('x') }}", "field width"),
    ("{{ '%100000000s' % 'x' }}", "field width"),
    ("{{ '{:>100000000}'.format('x') }}", "field width"),
    ("{{ '{:{}}'.format('x', 10**9) }}", "field width"),
    ("{{ lipsum(10**9) }}", "lipsum"),
    ("{{ range(10)|batch(10**9, 'x')|list }}", "batch size"),
    ("{{ range(10)|slice(10**9)|list }}", "slice size"),
    ("{{ messages|tojson(indent=10**9) }}", "JSON indent"),
    ("{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}", "output exceeds"),
]


@pytest.mark.parametrize("template, words", COSTLY)
def test_costly_templates_are_stopped_quickly(model_dirs, tmp_path, monkeypatch, template, words):
    from twice.weights.chat_template import TemplateLimits

    monkeypatch.setattr(TemplateLimits, "steps", 200_000)  # the default (10^6) takes a few seconds to reach
    # Each is stopped by a bound on its size or its steps, never by the render's time limit
    # (made too long to matter here: its own test is below), so no wall clock is needed to
    # tell them apart; the words say which bound stopped it.
    monkeypatch.setattr(TemplateLimits, "seconds", 3600.0)
    tok = template_tokenizer(model_dirs, tmp_path, template)
    with pytest.raises(TokenizerError) as info:
        tok.render_chat(MESSAGES)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert "took longer" not in str(info.value)


def test_render_time_limit(model_dirs, tmp_path, monkeypatch):
    from twice.weights.chat_template import TemplateLimits

    monkeypatch.setattr(TemplateLimits, "seconds", 0.2)
    tok = template_tokenizer(model_dirs, tmp_path, "{% for i in range(100000) %}{% for j in range(100000) %}"
                                                   "{{ messages|tojson }}{% endfor %}{% endfor %}")
    with pytest.raises(TokenizerError, match="longer than 0.2 s"):
        tok.render_chat(MESSAGES)


def test_real_templates_render_unchanged(model_dirs, tmp_path):
    """The limits cost nothing a real template needs: a Qwen2-style template over a long
    conversation renders exactly as plain jinja2 renders it."""
    import jinja2.sandbox

    template = (
        "{%- for message in messages %}{%- if loop.first and message.role != 'system' %}"
        "{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>' + '\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
        "{{ '%d messages, %5.1f%%' % (messages|length, 100.0) }}{{ '{:>6}'.format(messages|length) }}"
        "{{ (messages|map(attribute='role')|unique|list)|tojson }}{{ bos_token ~ eos_token }}"
    )
    tok = template_tokenizer(model_dirs, tmp_path, template)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f" message {i} " * 30}
                for i in range(3000)]
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.filters["tojson"] = lambda x: json.dumps(x)
    want = plain.from_string(template).render(messages=messages, add_generation_prompt=True,
                                              bos_token="<|endoftext|>", eos_token="<|im_end|>")
    assert tok.render_chat(messages) == want


def test_missing_special_tokens(model_dirs, tmp_path):
    tok = template_tokenizer(model_dirs, tmp_path, "{{ bos_token }}{{ messages[0].content }}", bos_token=None)
    with pytest.raises(TokenizerError, match=r"the chat template uses bos_token, but .*tokenizer_config.json "
                                             r"defines no bos_token"):
        tok.render_chat(MESSAGES)
    with pytest.raises(TokenizerError, match="uses bos_token"):  # combined with text: the same error
        template_tokenizer(model_dirs, tmp_path, "{{ bos_token + 'x' }}", bos_token=None).render_chat(MESSAGES)
    # Templates that test for the token first still work without it.
    guarded = "{% if bos_token %}{{ bos_token }}{% endif %}{% if bos_token is defined %}!{% endif %}" \
              "{{ bos_token|default('') }}{{ messages[0].content }}"
    assert template_tokenizer(model_dirs, tmp_path, guarded, bos_token=None).render_chat(MESSAGES) == "Hello"
    assert template_tokenizer(model_dirs, tmp_path, guarded).render_chat(MESSAGES) == \
        "<|endoftext|>!<|endoftext|>Hello"


def test_reserved_names(model_dirs, tmp_path):
    tok = template_tokenizer(model_dirs, tmp_path, "{% set _twice_loop = range %}{% for i in [1] %}{% endfor %}")
    with pytest.raises(TokenizerError, match="reserved name"):
        tok.render_chat(MESSAGES)


# -- GGUF files through the CLI ------------------------------------------------------------
GGUF_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "c", "d", "e", "ab", "Ġ", "Ġa", "abc",
               "h", "i", "hi", "Ġhi"]
GGUF_MERGES = ["a b", "Ġ a", "ab c", "h i", "Ġ hi"]


def write_small_gguf(path: Path, arch: str = "llama", qtype=gguf.GGMLQuantizationType.Q8_0,
                     metadata: dict | None = None) -> Path:
    """A one-layer llama (hidden 32, so that ffn_up can be quantized in 32-wide blocks) with a
    16-token byte-level vocabulary: small enough to convert in milliseconds."""
    rng = np.random.default_rng(0)
    hidden, heads, kv, ffn, vocab = 32, 2, 1, 32, len(GGUF_TOKENS)
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), arch)
    values = {f"{arch}.context_length": 64, f"{arch}.embedding_length": hidden, f"{arch}.block_count": 1,
              f"{arch}.feed_forward_length": ffn, f"{arch}.attention.head_count": heads,
              f"{arch}.attention.head_count_kv": kv, f"{arch}.rope.dimension_count": head_dim,
              f"{arch}.vocab_size": vocab, "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2,
              f"{arch}.rope.freq_base": 10000.0, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
              "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": GGUF_TOKENS,
              "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (vocab - 3), "tokenizer.ggml.merges": GGUF_MERGES,
              "tokenizer.ggml.add_bos_token": False,
              "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    values.update(metadata or {})
    add_gguf_metadata(writer, values)

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    tensors = {"token_embd.weight": w(vocab, hidden), "output_norm.weight": w(hidden),
               "blk.0.attn_norm.weight": w(hidden), "blk.0.ffn_norm.weight": w(hidden),
               "blk.0.attn_q.weight": w(heads * head_dim, hidden), "blk.0.attn_k.weight": w(kv * head_dim, hidden),
               "blk.0.attn_v.weight": w(kv * head_dim, hidden), "blk.0.attn_output.weight": w(hidden, heads * head_dim),
               "blk.0.ffn_gate.weight": w(ffn, hidden), "blk.0.ffn_up.weight": w(ffn, hidden),
               "blk.0.ffn_down.weight": w(hidden, ffn)}
    for name, array in tensors.items():
        if name == "blk.0.ffn_up.weight" and qtype == gguf.GGMLQuantizationType.Q8_1:  # no quantizer: raw blocks
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            writer.add_tensor(name, np.zeros((ffn, hidden // block * size), np.uint8), raw_dtype=qtype)
        elif name == "blk.0.ffn_up.weight" and qtype is not None:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def bad_magic(path):
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 200)
    return "not a GGUF file"


def truncated(path):
    data = write_small_gguf(path).read_bytes()
    path.write_bytes(data[: len(data) // 3])
    return "truncated or corrupt GGUF file"


def cut_in_the_header(path):
    data = write_small_gguf(path).read_bytes()
    path.write_bytes(data[:40])
    return "truncated or corrupt GGUF file"


def unsupported_quantization(path):
    write_small_gguf(path, qtype=gguf.GGMLQuantizationType.Q8_1)
    return "type Q8_1"  # convert: "uses quantization type Q8_1, which cannot be dequantized"; as stored: "has type Q8_1, which twice cannot run"


def unsupported_architecture(path):
    write_small_gguf(path, arch="bert")
    return "GGUF architecture 'bert' is not supported"


def absurd_block_count(path):
    write_small_gguf(path, metadata={"llama.block_count": 2**30})  # 2**31 and up: "at most 2,147,483,647"
    return "metadata says 1073741824 layers (block_count) but the file holds only 11 tensors"


def architecture_not_a_string(path):
    write_small_gguf(path, metadata={"general.architecture": 5})
    return "general.architecture must be a string, got 5"


def value_length_as_text(path):
    write_small_gguf(path, metadata={"llama.attention.value_length": "16"})
    return "metadata llama.attention.value_length must be a positive integer, got '16'"


def rotary_dimension_as_float(path):
    write_small_gguf(path, metadata={"llama.rope.dimension_count": 12.0})
    return "metadata llama.rope.dimension_count must be a positive integer, got 12.0"


GGUF_BREAKS = [bad_magic, truncated, cut_in_the_header, unsupported_quantization, unsupported_architecture,
               absurd_block_count, architecture_not_a_string, value_length_as_text, rotary_dimension_as_float]


@pytest.mark.parametrize("breaker", GGUF_BREAKS, ids=lambda f: f.__name__)
def test_bad_gguf_through_the_cli(tmp_path, capsys, breaker):
    src = tmp_path / "model.gguf"
    words = breaker(src)
    out = tmp_path / "out"
    line = one_error_line(run_inprocess(["convert", str(src), str(out)], capsys))
    assert str(src) in line and words in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]  # no folder, no temp left
    line = one_error_line(generate(capsys, src))
    assert str(src) in line and words in line, line


def test_good_gguf_through_the_cli(tmp_path, capsys):
    src = write_small_gguf(tmp_path / "model.gguf")
    r = run_inprocess(["generate", "abc", "--model", str(src), "-n", "3", "--raw"], capsys)
    assert r.code == 0, r.err
    r = run_inprocess(["convert", str(src), str(tmp_path / "out")], capsys)
    assert r.code == 0 and (tmp_path / "out" / "model.safetensors").is_file(), r.err
    line = one_error_line(run_inprocess(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "o2")], capsys))
    assert "missing.gguf: no such file" in line


# -- prompts -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(model_dirs):
    return model_dirs("llama")


def test_empty_prompts(llama, capsys, monkeypatch):
    assert "the prompt is empty" in one_error_line(generate(capsys, llama, prompt=""))
    assert "the prompt is empty" in one_error_line(generate(capsys, llama, prompt=" \n\t "))
    r = generate(capsys, llama, prompt="-", stdin=b"", monkeypatch=monkeypatch)
    assert "the prompt is empty" in one_error_line(r)


def test_prompt_longer_than_the_context_says_by_how_much(llama, capsys):
    line = one_error_line(generate(capsys, llama, "--raw", prompt="Hello world " * 200))
    assert "tokens but the model's context is 256:" in line and "tokens too many" in line


def test_invalid_utf8_and_nul_bytes_on_stdin(llama, capsys, monkeypatch):
    r = generate(capsys, llama, prompt="-", stdin=b"caf\xe9 au lait", monkeypatch=monkeypatch)
    assert "standard input is not valid UTF-8 (byte 3" in one_error_line(r)
    r = generate(capsys, llama, "--raw", prompt="-", stdin=b"a\x00b\x00c", monkeypatch=monkeypatch)
    assert r.code == 0 and "Traceback" not in r.err  # NUL is a character like any other


@pytest.mark.parametrize("chat", ["--raw", "--chat"])
def test_a_megabyte_prompt_is_refused_quickly(llama, capsys, monkeypatch, chat):
    text = ("The quick brown fox jumps over the lazy dog. " * 23302)[: 2**20]
    started = time.monotonic()
    r = generate(capsys, llama, chat, prompt="-", stdin=text.encode(), monkeypatch=monkeypatch)
    line = one_error_line(r)
    assert time.monotonic() - started < 20
    assert "tokens but the model's context is 256" in line and "tokens too many" in line


def test_tokenizing_is_linear(llama):
    """Four times the text takes about four times as long (not sixteen): a long prompt
    without spaces (one giant 'word' for BPE) included."""
    from twice.weights.tokenizer import Tokenizer

    tok = Tokenizer(llama)
    for unit in ("a", "fox jumps. "):
        times = []
        for n in (2**18, 2**20):
            text = (unit * n)[:n]
            started = time.perf_counter()
            tok.encode(text)
            times.append(time.perf_counter() - started)
        assert times[1] < 4 * times[0] * 3 + 0.5, (unit, times)


def test_max_new_tokens_beyond_the_context_is_clamped(llama, capsys):
    r = generate(capsys, llama, "--raw", "-n", "100000")
    assert r.code == 0 and "max new tokens lowered from 100000 to" in r.err


@pytest.mark.parametrize("flags, words", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--temperature", "nan"], "temperature must be >= 0"),
    (["--top-p", "0"], "top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "top-p must be in (0, 1]"),
    (["--min-p", "1"], "min-p must be in [0, 1)"),
    (["--top-k", "-3"], "top-k must be a whole number >= 0"),
    (["--repetition-penalty", "0"], "repetition penalty must be a finite number > 0"),
    (["--seed", "-1"], "seed must be in [0, 2^63)"),
    (["-n", "0"], "max new tokens must be at least 1"),
    (["--prefill-chunk", "0"], "prefill chunk must be at least 1 token"),
])
def test_impossible_sampling_flags(llama, capsys, flags, words):
    assert words in one_error_line(generate(capsys, llama, *flags))


# -- batch files -------------------------------------------------------------------------------
def batch(capsys, llama, *args, **kw):
    return run_inprocess(["batch", *map(str, args), "--model", str(llama), "--raw", "-n", "2"], capsys, **kw)


def test_batch_input_problems(llama, tmp_path, capsys):
    assert "no such file" in one_error_line(batch(capsys, llama, tmp_path / "missing.txt"))
    assert "is a folder" in one_error_line(batch(capsys, llama, tmp_path))
    (tmp_path / "empty.jsonl").write_text("\n \n")
    assert "holds no prompts" in one_error_line(batch(capsys, llama, tmp_path / "empty.jsonl"))
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    assert "--batch-size must be at least 1" in one_error_line(batch(capsys, llama, src, "--batch-size", "0"))
    assert "--format must be txt or jsonl" in one_error_line(batch(capsys, llama, src, "--format", "xml"))
    src.write_bytes(b"nul \x00 inside\n")
    r = batch(capsys, llama, src)
    assert r.code == 0 and json.loads(r.out)["prompt"] == "nul \x00 inside"


def test_batch_output_symlinks_are_never_followed(llama, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "out.jsonl"
    link.symlink_to(victim)
    for extra in ([], ["--resume"]):
        assert "is a symbolic link" in one_error_line(batch(capsys, llama, src, "-o", link, *extra))
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "would-be-created.jsonl")
    assert "is a symbolic link" in one_error_line(batch(capsys, llama, src, "-o", dangling))
    assert victim.read_text() == "precious\n" and not (tmp_path / "would-be-created.jsonl").exists()


def test_batch_writer_refuses_a_link_swapped_in_after_the_check(llama, tmp_path):
    """Between the checks and the open (a race): O_EXCL for a new file, O_NOFOLLOW and the
    file's identity for --resume."""
    from twice.cli.batch_output import Writer, check_output
    from twice.core.errors import PromptError

    victim = tmp_path / "victim.jsonl"
    victim.write_bytes(b'{"id": "1", "completion": "", "finish_reason": "eos"}\n')
    out = tmp_path / "out.jsonl"
    path, state = check_output(str(out), resume=False)
    out.symlink_to(victim)
    with pytest.raises(PromptError, match="appeared while twice was starting"):
        Writer(path, state)
    out.unlink()
    shutil.copy(victim, out)
    path, state = check_output(str(out), resume=True)
    out.unlink()
    out.symlink_to(victim)
    with pytest.raises(PromptError, match="symbolic link"):
        Writer(path, state)
    out.unlink()
    out.write_bytes(b'{"id": "2", "completion": "", "finish_reason": "eos"}\n')  # another file, same name
    with pytest.raises(PromptError, match="changed while twice was starting"):
        Writer(path, state)
    assert victim.read_bytes() == b'{"id": "1", "completion": "", "finish_reason": "eos"}\n'


def test_batch_resume_on_a_fifo_does_not_hang(llama, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    fifo = tmp_path / "out.jsonl"
    os.mkfifo(fifo)
    assert "not a regular file" in one_error_line(batch(capsys, llama, src, "-o", fifo, "--resume"))


# -- atomic writes and links: chat /save, converted models, the cache ----------------------------
def test_chat_save_never_writes_through_a_link(llama, tmp_path, capsys, monkeypatch):
    victim = tmp_path / "victim.json"
    victim.write_text('{"version": 1, "messages": []}')  # looks like a chat file: the link is the problem
    (tmp_path / "saved.json").symlink_to(victim)
    script = f"Hello\n/save {tmp_path / 'saved.json'}\n/save {tmp_path / 'good.json'}\n".encode()
    r = run_inprocess(["chat", "--model", str(llama), "-n", "2"], capsys, script, monkeypatch)
    assert r.code == 0, r.err
    assert "cannot save to" in r.err and "symbolic link" in r.err
    assert victim.read_text() == '{"version": 1, "messages": []}'
    assert json.loads((tmp_path / "good.json").read_text())["messages"][0]["content"] == "Hello"


def test_chat_save_temp_file_and_late_link(tmp_path, monkeypatch):
    """A link where the temporary file would go is skipped (mkstemp's O_EXCL); a link at the
    destination is refused, and one put there after that check is replaced by the rename,
    not followed."""
    import twice.weights.safe_write as safe_write
    from twice.cli.conversation_file import write_atomic

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    names = iter(["taken", "free", "spare"])
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    (tmp_path / ".saved.json.taken.tmp").symlink_to(victim)
    dest = tmp_path / "saved.json"
    dest.symlink_to(victim)  # as if placed between refuse_overwrite and the write
    with pytest.raises(ValueError, match="symbolic link"):
        write_atomic(dest, '{"version": 1}\n')
    assert dest.is_symlink() and victim.read_text() == "precious"
    dest.unlink()
    real_check = safe_write.refuse_non_regular

    def racing_check(path, error):
        real_check(path, error)
        dest.symlink_to(victim)  # placed between the last check and the rename

    monkeypatch.setattr(safe_write, "refuse_non_regular", racing_check)
    write_atomic(dest, '{"version": 1}\n')
    assert victim.read_text() == "precious"
    assert not dest.is_symlink() and dest.read_text() == '{"version": 1}\n'
    assert (tmp_path / ".saved.json.taken.tmp").is_symlink()  # the attacker's link, untouched
    assert not (tmp_path / ".saved.json.free.tmp").exists()


def test_converted_model_folder_is_atomic_and_ignores_links(tmp_path, monkeypatch):
    import twice.weights.gguf as module

    src = write_small_gguf(tmp_path / "m.gguf")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    # A link where the private temporary folder would be created: mkdtemp takes another name.
    names = iter(["taken", "free"])
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    (tmp_path / ".out.tmp-taken").symlink_to(victim)
    module.convert_gguf(src, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file() and sorted(os.listdir(victim)) == ["keep.txt"]
    # A link swapped in at the destination after the last check: it is moved aside (as a
    # link) and replaced by the new folder, never followed.
    real_check = module._check_destination
    calls = []

    def racing_check(dest, overwrite):
        calls.append(dest)
        if len(calls) == 3:  # convert_gguf's first check, the one under the lock, the last before the rename
            dest.symlink_to(victim, target_is_directory=True)
            return None
        return real_check(dest, overwrite)

    monkeypatch.setattr(module, "_check_destination", racing_check)
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: iter(["x1", "x2"]))
    module.convert_gguf(src, tmp_path / "out2", overwrite=True)
    assert sorted(os.listdir(victim)) == ["keep.txt"] and (victim / "keep.txt").read_text() == "precious"
    assert not (tmp_path / "out2").is_symlink() and (tmp_path / "out2" / "config.json").is_file()
    assert not list(tmp_path.glob(".out2.tmp-*"))  # the private temporary folder is gone


def test_cache_entries_of_another_user_are_not_loaded(tmp_path, monkeypatch, capsys):
    from twice.weights.paths import models_dir
    from twice.weights.resolve import described_gguf

    if os.getuid() != 0:
        pytest.skip("needs root to give a folder to another user")
    monkeypatch.setenv("TWICE_CACHE", str(tmp_path / "cache"))
    src = write_small_gguf(tmp_path / "m.gguf")
    folder = described_gguf(src)  # the folder a GGUF runs from (as stored)
    assert folder.parent == models_dir()
    os.chown(folder, 12345, 12345)  # as if another user had put a model there
    line = one_error_line(generate(capsys, src))
    assert "belongs to another user (uid 12345)" in line and str(folder) in line


# -- no code from the model ever runs ----------------------------------------------------------
def test_no_remote_code_no_unpickling_anywhere():
    """What the model's files hold is data: nothing in twice unpickles, evaluates, or asks
    transformers to run a model's own code, and templates only ever meet the sandbox
    (checked on the syntax tree of every module, so comments and messages do not count)."""
    import ast

    root = Path(__file__).resolve().parent.parent
    sources = [p for d in ("cli", "core", "weights") for p in (root / d).rglob("*.py")]
    assert sources
    unpicklers = {"pickle", "cPickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
    found = []
    for path in sources:
        where = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] in unpicklers for a in node.names):
                found.append(f"{where}:{node.lineno}: imports an unpickler")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in unpicklers:
                found.append(f"{where}:{node.lineno}: imports an unpickler")
            elif isinstance(node, ast.Call):
                func = node.func
                name = ast.unparse(func)
                if isinstance(func, ast.Name) and func.id in ("eval", "exec"):
                    found.append(f"{where}:{node.lineno}: calls {func.id}")
                if name in ("torch.load", "jinja2.Environment", "jinja2.Template", "Environment", "Template",
                            "os.system"):
                    found.append(f"{where}:{node.lineno}: calls {name}")
                for kw in node.keywords:
                    if kw.arg in ("trust_remote_code", "allow_pickle", "weights_only"):
                        found.append(f"{where}:{node.lineno}: passes {kw.arg}")
    assert not found, found
    assert "ImmutableSandboxedEnvironment" in (root / "weights" / "chat_template.py").read_text()
