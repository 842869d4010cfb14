"""Sizes before work (issue 13, items 9 and 10, and argv text of item 12).

- A prompt that cannot fit the context is refused before it is tokenized, by a sound
  bound from its length (`Tokenizer.fewest_tokens`: never more than the real count);
  standard input is read in bounded chunks; `--truncate left` tokenizes only an end.
- Chat templates are bounded by construction: every call's work is counted before it
  runs, every string, list and printed value is sized before it is built, and templates
  nested too deeply for jinja2's parser or Python's compiler end in one line.
- Text flags given invalid UTF-8 (argv's surrogate escapes) end in one line naming the
  argument and the byte.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, \
    pre_tokenizers, trainers

from clirun import one_error_line, run_inprocess
from twice.core.errors import PromptError, TokenizerError
from twice.weights.tokenizer import PromptTooLong, Tokenizer, text_bound

import tiny


@pytest.fixture(scope="module")
def llama(model_dirs):
    return model_dirs("llama")


class EncodeSpy:
    """Records the length of every text the tokenizer library is asked to encode."""

    def __init__(self, monkeypatch):
        self.lengths: list[int] = []
        original = Tokenizer.encode
        spy = self

        def encode(tok, text, *args, **kwargs):
            real = tok.hf

            class Wrapped:
                def __getattr__(self, name):
                    return getattr(real, name)

                def encode(self, t, *a, **k):
                    spy.lengths.append(len(t))
                    return real.encode(t, *a, **k)

            tok.__dict__["hf"] = Wrapped()
            try:
                return original(tok, text, *args, **kwargs)
            finally:
                tok.__dict__["hf"] = real

        monkeypatch.setattr(Tokenizer, "encode", encode)


# -- the bound: sound for every tokenizer shape it accepts, None where there is none --------
TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 200,
    "#" * 9000,
    " " * 9000,
    "\n" * 5000 + "x",
    "a" * 9000,
    "é" * 3000 + "e\u0301" * 3000 + "\u1e17" * 100,  # precomposed, combining, and both
    "\u03b1\u0313\u0300\u0345" * 2000,  # four characters that NFC makes one
    "e" + "\u0301" * 8000,
    "日本語のテキスト" * 1000,
    "😀🚀🎉👍🏽🧑‍💻" * 1000,
    "<|im_start|>" * 1000 + "<|endoftext|>x" * 500,
    "\ufb01" * 4000 + "\ufdfa" * 100,  # NFKC expands these
    "1234567890" * 1000,
    "\x00\x01\x02 \t\r\n" * 1500,
]


def _train(tok: HFTokenizer, specials=("<|endoftext|>", "<|im_start|>"), alphabet=()) -> HFTokenizer:
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=list(alphabet))
    tok.train_from_iterator(tiny.CORPUS + ["#" * 64, " " * 64, "\n" * 32], trainer)
    return tok


def byte_level():
    return tiny.train_tokenizer()


def byte_level_nfc():  # Qwen2's shape
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+"), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return _train(tok, alphabet=pre_tokenizers.ByteLevel.alphabet())


def sentencepiece_like():  # Llama 2 / Mistral's shape: Prepend + Replace, byte fallback
    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return _train(tok, specials=("<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))))


def nfkc_metaspace():
    tok = HFTokenizer(models.BPE(unk_token="<unk>", fuse_unk=False))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return _train(tok, specials=("<unk>",), alphabet=sorted(set("".join(TEXTS)) | set("▁")))


@pytest.mark.parametrize("make", [byte_level, byte_level_nfc, sentencepiece_like, nfkc_metaspace])
def test_the_bound_never_exceeds_the_real_count(make):
    hf = make()
    bound = text_bound(hf)
    assert bound is not None
    for text in TEXTS:
        for piece in (text, text[: len(text) // 3], text[-777:]):
            real = len(hf.encode(piece, add_special_tokens=False).ids)
            assert bound.fewest_tokens(piece) <= real, (make.__name__, piece[:20], bound)
            tail = piece[-bound.tail_chars(50):]
            if len(tail) < len(piece):
                assert len(hf.encode(tail, add_special_tokens=False).ids) >= 50


def test_the_bound_is_tight_enough_to_matter():
    """On ordinary text the bound is within a small factor of the count: for byte-level
    BPE it is the longest token's bytes (81 for SmolLM2, 19 here)."""
    hf = byte_level()
    text = TEXTS[0]
    assert text_bound(hf).fewest_tokens(text) * 40 >= len(hf.encode(text).ids)


@pytest.mark.parametrize("change", [
    lambda t: setattr(t, "normalizer", normalizers.Strip()),
    lambda t: setattr(t, "normalizer", normalizers.Replace(Regex(r"\s+"), " ")),
    lambda t: setattr(t, "normalizer", normalizers.BertNormalizer()),
    lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Whitespace()),
    lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Split(" ", "removed")),
    lambda t: t.add_tokens([AddedToken("<mask>", lstrip=True)]),
    lambda t: setattr(t, "model", models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
    lambda t: setattr(t, "model", models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True)),
    lambda t: setattr(t, "model", models.BPE({"a": 0, "b": 1}, [])),
], ids=["strip", "regex_replace", "bert_normalizer", "whitespace", "split_removed", "lstrip_token", "wordpiece",
        "fused_unk", "unknown_dropped"])
def test_no_bound_where_text_can_vanish(change):
    """Parts that can turn much text into one token or none admit no bound: such a
    tokenizer tokenizes whole (under the 64 MiB read limit), as before."""
    hf = byte_level()
    change(hf)
    assert text_bound(hf) is None


def test_tokenizer_json_truncation_and_padding_are_ignored(model_dirs, tmp_path):
    """transformers turns tokenizer.json's truncation and padding off for a call that does
    not ask for them; so does twice (a truncation there cut a long prompt's end silently)."""
    folder = tmp_path / "m"
    shutil.copytree(model_dirs("llama"), folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    data["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    data["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    text = "The quick brown fox jumps over the lazy dog."
    assert Tokenizer(folder).encode(text) == Tokenizer(model_dirs("llama")).encode(text)


def test_encode_with_a_limit(llama):
    tok = Tokenizer(llama)
    text = "The quick brown fox jumps over the lazy dog. " * 10000
    with pytest.raises(PromptTooLong) as info:
        tok.encode(text, limit=1000)
    assert info.value.at_least > 1000 and "\n" not in str(info.value)
    assert len(tok.encode(text[:2000], limit=1000)) <= 1000  # under the bound: tokenized as ever


def test_encode_refuses_lone_surrogates_in_one_line(llama):
    with pytest.raises(PromptError, match=r"unpaired surrogate \(U\+DCFF\) at character 3"):
        Tokenizer(llama).encode("abc\udcffdef")


# -- prompts through the CLI and the engine -------------------------------------------------
def generate(capsys, folder, *args, prompt="-", **kw):
    return run_inprocess(["generate", prompt, "--model", str(folder), "-n", "2", *args], capsys, **kw)


@pytest.mark.parametrize("mode", ["--raw", "--chat"])
def test_a_huge_prompt_is_refused_before_it_is_tokenized(llama, capsys, monkeypatch, mode):
    spy = EncodeSpy(monkeypatch)
    text = ("The quick brown fox jumps over the lazy dog. " * 50000)[: 2 * 2**20]
    line = one_error_line(generate(capsys, llama, mode, stdin=text.encode(), monkeypatch=monkeypatch))
    assert "the prompt is at least" in line and "tokens but the model's context is 256" in line
    assert "refused before tokenizing" in line
    assert not spy.lengths or max(spy.lengths) < 100  # the chat check at start renders "Hello"


def test_standard_input_is_read_in_bounded_chunks(llama, capsys, monkeypatch):
    import twice.cli.prompt_input as prompt_input

    monkeypatch.setattr(prompt_input, "MAX_PROMPT_BYTES", 10_000)
    stream = io.BytesIO(b"x" * 50_000)

    class In:
        buffer = stream

        def isatty(self):
            return False

    monkeypatch.setattr(sys, "stdin", In())
    capsys.readouterr()
    r = run_inprocess(["generate", "-", "--model", str(llama), "-n", "2"], capsys)
    assert "standard input holds more than 0.00953674 MiB" in one_error_line(r)
    assert stream.tell() <= 10_001  # the rest was never read


def test_truncate_left_tokenizes_only_an_end(llama, capsys, monkeypatch):
    spy = EncodeSpy(monkeypatch)
    text = "The quick brown fox jumps over the lazy dog. " * 40000
    r = generate(capsys, llama, "--raw", "--truncate", "left", "--json", stdin=text.encode(),
                 monkeypatch=monkeypatch)
    assert r.code == 0, r.err
    assert "dropped the first" in r.err and "characters" in r.err and "--truncate left" in r.err
    assert max(spy.lengths) < len(text) // 20
    assert json.loads(r.out)["prompt_tokens"] == 256 - 2


def test_truncate_left_keeps_the_same_tokens_as_tokenizing_whole(model_dirs):
    from twice.core.engine import Engine, GenerationSettings, Request
    from twice.weights.load import load

    m = load(str(model_dirs("llama")), device="cpu", dtype="float32")
    engine = Engine(m.model, m.tokenizer, m.eos_token_ids)
    settings = GenerationSettings(max_new_tokens=8, truncate="left")
    for text in ("The quick brown fox jumps over the lazy dog. " * 3000, tiny.CORPUS[2] * 900):
        ids, cut = engine._tokenize(Request(text=text), settings)
        assert cut > 0
        whole = m.tokenizer.encode(text)
        assert engine._truncate(ids, settings)[0] == engine._truncate(whole, settings)[0]


def test_batch_lines_too_long_are_refused_before_they_are_tokenized(llama, tmp_path, capsys, monkeypatch):
    import twice.cli.batch_input as batch_input

    spy = EncodeSpy(monkeypatch)
    monkeypatch.setattr(batch_input, "MAX_LINE_CHARS", 300_000)
    prompts = tmp_path / "p.jsonl"
    long = "The quick brown fox jumps over the lazy dog. " * 5000
    lines = [{"id": "ok", "prompt": "Hello"}, {"id": "long", "prompt": long},
             {"id": "huge", "prompt": long * 2}]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    r = run_inprocess(["batch", str(prompts), "-o", str(out), "--model", str(llama), "-n", "2", "--raw"], capsys)
    assert r.code in (0, 2) and "Traceback" not in r.err
    assert "p.jsonl:2: the prompt is at least" in r.err and "refused before tokenizing" in r.err
    assert "p.jsonl:3: the line is 450,028 characters; a line is at most 300,000" in r.err
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["ok"]
    assert max(spy.lengths) < 100


# -- invalid UTF-8 in argv text --------------------------------------------------------------
ARGV_CASES = [
    (["generate", "caf\udce9", "--raw"], "the prompt argument is not valid UTF-8 (byte 3: b'\\xe9')"),
    (["generate", "hi", "--system", "ab\udcff"], "--system is not valid UTF-8 (byte 2: b'\\xff')"),
    (["generate", "hi", "--stop", "ok", "--stop", "\u00e9\udc80"], "--stop is not valid UTF-8 (byte 2: b'\\x80')"),
    (["chat", "--system", "\udcc3"], "--system is not valid UTF-8 (byte 0: b'\\xc3')"),
    (["batch", "-", "--stop", "x\udcfe"], "--stop is not valid UTF-8 (byte 1: b'\\xfe')"),
]


@pytest.mark.parametrize("args, words", ARGV_CASES, ids=["prompt", "system", "stop", "chat_system", "batch_stop"])
def test_invalid_utf8_in_text_arguments(llama, capsys, args, words):
    r = run_inprocess([*args, "--model", str(llama)], capsys)
    assert words in one_error_line(r)


# -- chat templates: bounded by construction ----------------------------------------------------
def compiled(text: str):
    from twice.weights.chat_template import ChatTemplate

    return ChatTemplate(text, Path("chat_template.jinja"), {"bos_token": "<s>"}, Path("tokenizer_config.json"))


MESSAGES = [{"role": "user", "content": "Hello"}]
BIG = "{% set s = 'x' * 10000000 %}"
COSTLY = [
    ("{{ range(100000)|sort }}", "sorting 100,000 items"),
    ("{{ range(100000)|groupby('real')|list }}", "sorting 100,000 items"),
    ("{{ (range(100000)|list * 3)|max }}", "a list repeated"),
    ("{{ ('x' * 16000000)|list|length }}", "the list filter over 16,000,000 items"),
    ("{{ ('x' * 16000000)|unique|list }}", "the unique filter over 16,000,000 items"),
    ("{{ ('x' * 16000000)|sort }}", "the sort filter over 16,000,000 items"),
    ("{{ ('x' * 16000000)|map('upper')|list }}", "the map filter over 16,000,000 items"),
    ("{{ ('x' * 16000000)|select|list }}", "the select filter over 16,000,000 items"),
    ("{{ ('x' * 16000000)|batch(3)|list }}", "the batch filter"),
    ("{{ ('x' * 16000000)|join(',') }}", "the join filter"),
    ("{{ ('x' * 16000000)|sum }}", "the sum filter"),
    ("{{ ([[0] * 1000] * 100)|sum(start=[]) }}", "summing 100 sequences"),
    ("{{ ('x ' * 8000000)|wordwrap(5)|length }}", "the wordwrap filter"),
    ("{{ ('x ' * 8000000)|title|length }}", "the title filter"),
    ("{{ ('x\n' * 8000000)|indent|length }}", "indent"),
    ("{{ ('ab ' * 5000000).split()|length }}", "split into more than"),
    ("{{ ('ab,' * 5000000).rsplit(',')|length }}", "rsplit into more than"),
    ("{{ ('a\n' * 5000000).splitlines()|length }}", "str.splitlines"),
    (BIG + "{{ [s] * 100 }}", "a printed value"),
    (BIG + "{{ ([s] * 100)|join }}", "the join filter's text of 20,000,010"),
    (BIG + "{{ ''.join([s] * 100) }}", "a joined string"),
    (BIG + "{{ ''.join(([s] * 100)|map('lower')) }}", "characters and items in all"),
    (BIG + "{{ ([s] * 100)|tojson }}", "the tojson filter's text"),
    (BIG + "{{ ([s] * 100)|string }}", "the string filter's text"),
    (BIG + "{{ ([s] * 100)|upper }}", "the upper filter's text"),
    (BIG + "{{ [s] ~ [s] }}", "a joined string"),
    (BIG + "{{ ('{0}' * 100).format(s) }}", "a formatted string"),
    (BIG + "{{ ('%(a)s' * 100) % {'a': s} }}", "a formatted string"),
    (BIG + "{{ '%s%s' % (s, s) }}", "a formatted string"),
    (BIG + "{{ '%s%s'|format(s, s) }}", "a formatted string"),
    ("{{ ('{:>9999}' * 2000).format(*range(2000)) }}", "a formatted string"),
    ("{{ ('%9999d' * 2000) % ((0,) * 2000) }}", "a formatted string"),
    ("{{ strftime_now('%c' * 8000000) }}", "a formatted date"),
    ("{% set ns = namespace(l=[]) %}{% for i in range(100) %}{% set ns.l = ns.l + ['x' * 10000000 ~ i] %}"
     "{% endfor %}", "characters and items in all"),
    ("{% set ns = namespace(x=[]) %}{% for i in range(100) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}",
     "nested more than 64 deep"),
]


@pytest.mark.parametrize("template, words", COSTLY)
def test_costly_calls_are_stopped_before_they_run(monkeypatch, template, words):
    from twice.weights.chat_template import TemplateLimits

    monkeypatch.setattr(TemplateLimits, "steps", 200_000)
    monkeypatch.setattr(TemplateLimits, "seconds", 3600.0)  # stopped by a bound, never by the time limit
    with pytest.raises(TokenizerError) as info:
        compiled(template).render(MESSAGES)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert "took longer" not in str(info.value)


NESTED = [
    ("{% if true %}" * 5000 + "x" + "{% endif %}" * 5000, "blocks inside blocks more than 32 deep"),
    ("{% for i in [1] %}" * 3000 + "{% endfor %}" * 3000, "blocks inside blocks more than 32 deep"),
    ("{% macro m() %}" * 200 + "{% endmacro %}" * 200, "blocks inside blocks more than 32 deep"),
    ("{% set x %}" * 100 + "{% endset %}" * 100, "blocks inside blocks more than 32 deep"),
    ("{% for i in [1] %}" * 25 + "{% endfor %}" * 25, "for Python to compile it (too many statically nested blocks)"),
    ("{{ " + "(" * 10000 + "1" + ")" * 10000 + " }}", "brackets inside brackets more than 32 deep"),
    ("{{ " + "[" * 5000 + "]" * 5000 + " }}", "brackets inside brackets more than 32 deep"),
    ("{{ 'x'" + "|trim" * 2000 + " }}", "more than 200 operators and filters in one expression"),
    ("{{ 1" + " + 1" * 5000 + " }}", "more than 200 operators and filters in one expression"),
    ("{% if " + " or ".join(["a"] * 3000) + " %}{% endif %}", "more than 200 operators"),
    ("x" * (2**20 + 1), "chat template is 1,048,577 characters; the limit is 1,048,576"),
]


@pytest.mark.parametrize("template, words", NESTED, ids=["ifs", "fors", "macros", "set_blocks", "fors_python",
                                                         "parens", "lists", "filter_chain", "plus_chain", "or_chain",
                                                         "source_size"])
def test_templates_nested_too_deeply_give_one_line(template, words):
    with pytest.raises(TokenizerError) as info:
        compiled(template)
    message = str(info.value)
    assert message.startswith("chat_template.jinja: chat template is") and words in message, message
    assert "\n" not in message


def test_a_template_nested_too_deeply_through_the_cli(model_dirs, tmp_path, capsys):
    folder = tmp_path / "m"
    shutil.copytree(model_dirs("llama"), folder)
    (folder / "chat_template.jinja").write_text("{% if true %}" * 5000 + "{% endif %}" * 5000)
    r = run_inprocess(["generate", "hi", "--model", str(folder), "-n", "2", "--chat"], capsys)
    assert "chat template is nested too deeply" in one_error_line(r)


def test_what_real_templates_do_still_renders():
    """Ordinary uses of the charged filters and methods render as plain jinja2 renders them,
    constants folded at compile time by jinja2 included."""
    text = ("{{ 'abc'|upper }}|{{ 'a b c'.split()|join('-') }}|{{ messages|map(attribute='role')|unique|list }}|"
            "{{ messages|selectattr('role', 'equalto', 'user')|list|length }}|{{ [3, 1, 2]|sort }}|"
            "{{ 'x\ny'|indent(2) }}|{{ '%s=%d' % ('a', 1) }}|{{ '{}-{}'.format(1, 2) }}|{{ [1, [2]] }}|"
            "{{ {'a': 1}|tojson }}|{{ 'one two'|wordcount }}|{{ 'a\nb'.splitlines() }}|{{ [[1], [2]]|sum(start=[]) }}|"
            "{{ 'a,b'.rsplit(',', 1) }}|{{ range(5)|batch(2)|list }}|{{ [1, 2] ~ 'x' }}|{{ {'b': 1, 'a': 2}|dictsort }}")
    import jinja2.sandbox

    plain = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.filters["tojson"] = lambda x: json.dumps(x)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert compiled(text).render(messages) == plain.from_string(text).render(messages=messages)
