"""Structured output (core/constraints.py through llguidance): on tiny random models every
constrained output is valid — JSON that parses and matches its schema, a regex's full
match, a grammar's language — alone, in a batch beside free rows, and from the CLI; an
invalid or unsatisfiable spec is one line."""

import json
import re

import jsonschema
import pytest
import torch

from clirun import one_error_line, run_inprocess
from twice.core import constraints as c
from twice.core.engine import Done, Engine, GenerationSettings, Request
from twice.core.sampling import SamplingParams, apply_masks
from twice.weights.load import load

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "pet": {"enum": ["cat", "dog", None]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
LIST = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4}
LARK = 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/\n'
LARK_LANGUAGE = r"\([0-9]{1,3}(,[0-9]{1,3})*\)"
GBNF = 'root ::= answer "." \nanswer ::= "yes" | "no" | "maybe"\n'
SAMPLED = SamplingParams(temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def llama_dir(model_dirs):
    return str(model_dirs("llama"))


@pytest.fixture(scope="module")
def engine(llama_dir):
    m = load(llama_dir, device="cpu", dtype="float32")
    return Engine(m.model, m.tokenizer, m.eos_token_ids)


def run(engine, spec, prompt="Describe a person:", n=96, sampling=SamplingParams(), **kw):
    settings = GenerationSettings(max_new_tokens=n, sampling=sampling, constraint=spec, **kw)
    return list(engine.generate(Request(text=prompt), settings, reuse_cache=False))[-1].result


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("schema", [PERSON, LIST], ids=["object", "array"])
def test_json_schema_output_parses_and_validates(engine, schema, sampling):
    r = run(engine, c.json_schema(schema), sampling=sampling)
    assert r.finish_reason in ("stop", "eos"), r.text
    jsonschema.validate(json.loads(r.text), schema)


@pytest.mark.parametrize("prompt", ["Hello", "The answer is", "Give me an object"])
def test_json_object_output_is_an_object(engine, prompt):
    r = run(engine, c.ConstraintSpec("json_object"), prompt, n=64)
    assert r.finish_reason in ("stop", "eos"), r.text
    assert isinstance(json.loads(r.text), dict)


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("pattern", [r"[a-c]{3}x", r"(0|[1-9][0-9]{0,3})-(yes|no)", r"\w{2,5} \d\d"])
def test_regex_output_fullmatches(engine, pattern, sampling):
    r = run(engine, c.ConstraintSpec("regex", pattern), sampling=sampling)
    assert r.finish_reason in ("stop", "eos")
    assert re.fullmatch(pattern, r.text), r.text


@pytest.mark.parametrize("kind,text,language", [("lark", LARK, LARK_LANGUAGE),
                                                ("gbnf", GBNF, r"(yes|no|maybe)\.")])
def test_grammar_output_is_in_its_language(engine, kind, text, language):
    for sampling in (SamplingParams(), SAMPLED):
        r = run(engine, c.ConstraintSpec(kind, text), n=64, sampling=sampling)
        if r.finish_reason == "length":  # a list of numbers may go on; what there is is a prefix of the language
            assert re.fullmatch(r"\(([0-9]{1,3},)*[0-9]{0,3}", r.text), r.text
        else:
            assert re.fullmatch(language, r.text), r.text


def test_max_tokens_mid_json_ends_length_with_the_output_cut(engine):
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 40}}, "required": ["text"]}
    r = run(engine, c.json_schema(schema), n=5)
    assert r.finish_reason == "length" and len(r.token_ids) == 5
    assert r.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)


def test_a_batch_of_constrained_and_free_rows(engine):
    """Constrained rows are valid, free rows get their tokens alone, and a constrained row
    gets what it gets alone with the same constraint."""
    prompts = ["Hello there", "Describe a person:", "Once upon a time", "List:"]
    specs = [None, c.json_schema(PERSON), None, c.ConstraintSpec("regex", r"[a-c]{3}x")]
    settings = [GenerationSettings(max_new_tokens=128 if s else 24, constraint=s, ignore_eos=s is None)
                for s in specs]
    done = {e.row: e.result for e in engine.generate_batch([Request(text=p) for p in prompts], settings)
            if isinstance(e, Done)}
    jsonschema.validate(json.loads(done[1].text), PERSON)
    assert re.fullmatch(r"[a-c]{3}x", done[3].text)
    for i, (p, s) in enumerate(zip(prompts, settings)):
        alone = list(engine.generate(Request(text=p), s, reuse_cache=False))[-1].result
        assert done[i].token_ids == alone.token_ids


def test_a_bad_spec_fails_its_batch_row_only(engine):
    bad = c.json_schema({"type": "integer", "minimum": 5, "maximum": 3})
    settings = [GenerationSettings(max_new_tokens=4, constraint=bad), GenerationSettings(max_new_tokens=4)]
    events = list(engine.generate_batch([Request(text="a"), Request(text="b")], settings))
    failed = [e for e in events if type(e).__name__ == "Failed"]
    assert [e.row for e in failed] == [0] and "never be satisfied" in failed[0].message
    assert [e.row for e in events if isinstance(e, Done)] == [1]


@pytest.mark.parametrize("spec,words", [
    (lambda: c.json_schema({"type": "integer", "minimum": 5, "maximum": 3}), "can never be satisfied"),
    (lambda: c.json_schema({"allOf": [{"type": "string"}, {"type": "integer"}]}), "can never be satisfied"),
    (lambda: c.json_schema({"type": "frog"}), "invalid JSON schema"),
    (lambda: c.json_schema("{not json"), "not valid JSON"),
    (lambda: c.json_schema("[1, 2]"), "must be an object"),
    (lambda: c.ConstraintSpec("regex", "[a-c"), "invalid regex"),
    (lambda: c.ConstraintSpec("lark", "start: missing_rule"), "invalid Lark grammar"),
    (lambda: c.ConstraintSpec("gbnf", "root ::= (unclosed"), "GBNF"),
    (lambda: c.ConstraintSpec("xml"), "a constraint is one of"),
])
def test_invalid_or_unsatisfiable_specs_are_one_line(engine, spec, words):
    with pytest.raises(c.ConstraintError) as e:
        c.validate(spec())
    assert words in str(e.value) and "\n" not in str(e.value)
    # The engine refuses it before any work, with the same line.
    if "one of" not in words and "JSON" not in words.split()[-1]:
        with pytest.raises(c.ConstraintError):
            run(engine, spec(), n=2)


def test_mask_shape_padded_vocabulary_and_eos_only_when_accepting(engine):
    tok, eos = engine.tokenizer, sorted(engine.eos)
    k = c.Constraint(c.ConstraintSpec("regex", "ab"), tok, 600, eos)  # a model vocabulary padded past the tokenizer's
    m = k.mask()
    assert m.shape == (600,) and m.dtype == torch.bool and not m[tok.vocab_size:].any()
    assert not m[eos].any()  # nothing generated yet: EOS would end an incomplete output
    for t in tok.encode("ab", add_special_tokens=False):
        assert m[t] or k.mask()[t]
        k.advance(t)
    assert k.accepting and k.is_finished and k.error is None
    assert k.mask()[eos].all()  # complete: EOS is the one thing left
    # a token the mask forbids puts the constraint in error and finishes the row
    k2 = c.Constraint(c.ConstraintSpec("regex", "ab"), tok, 600, eos)
    assert k2.advance(tok.encode("zz", add_special_tokens=False)[0]) and k2.error


def test_apply_masks_leaves_free_rows_and_the_input_alone():
    logits = torch.randn(3, 8)
    before = logits.clone()
    m = torch.zeros(6, dtype=torch.bool)
    m[2] = True  # shorter than the vocabulary: ids 6, 7 disallowed
    out = apply_masks(logits, [None, m, None])
    assert torch.equal(logits, before) and torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    assert out[1].argmax() == 2 and torch.isinf(out[1][[0, 1, 3, 4, 5, 6, 7]]).all()
    assert apply_masks(logits, [None, None, None]) is logits


def test_response_format_mapping():
    f = c.constraint_from_response_format
    assert f(None) is None and f({"type": "text"}) is None
    assert f({"type": "json_object"}).kind == "json_object"
    s = f({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}})
    assert s.kind == "json_schema" and json.loads(s.source) == PERSON
    assert f({"type": "regex", "regex": "a+"}).kind == "regex"
    assert f({"type": "grammar", "grammar": GBNF}).kind == "gbnf"
    assert f({"type": "grammar", "grammar": LARK}).kind == "lark"
    for bad, words in [({"type": "json_schema", "json_schema": {"name": "p"}}, "schema is missing"),
                       ({"type": "json_schema"}, "json_schema is missing"),
                       ({"type": "yaml"}, "response_format.type must be"),
                       ("json", "must be an object"),
                       ({"type": "regex", "regex": 3}, "regex must be a string"),
                       ({"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 2,
                                                                           "maximum": 1}}}, "never be satisfied")]:
        with pytest.raises(c.ConstraintError, match=words):
            f(bad)


def test_speculative_decoding_with_a_constraint_is_refused(engine):
    with pytest.raises(c.ConstraintError, match="speculative"):
        run(engine, c.ConstraintSpec("regex", "a+"), lookup=True)


# -- the CLI -----------------------------------------------------------------------------
def generate(args, capsys, llama_dir):
    return run_inprocess(["generate", "-m", llama_dir, "--temperature", "0", "--raw", "--json", *args], capsys)


def test_generate_flags_give_valid_output(tmp_path, capsys, llama_dir):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    lark, gbnf, bare = tmp_path / "g.lark", tmp_path / "g.gbnf", tmp_path / "grammar.txt"
    lark.write_text(LARK)
    gbnf.write_text(GBNF)
    bare.write_text(GBNF)  # no extension: GBNF by its `::=`
    r = generate(["-n", "96", "--json-schema", str(schema), "Describe a person:"], capsys, llama_dir)
    assert r.code == 0, r.err
    d = json.loads(r.out)
    jsonschema.validate(json.loads(d["text"]), PERSON)
    assert d["finish_reason"] == "stop" and d["settings"]["constraint"]["json_schema"] == PERSON
    r = generate(["-n", "24", "--regex", r"[a-c]{3}x", "hello"], capsys, llama_dir)
    assert r.code == 0 and re.fullmatch(r"[a-c]{3}x", json.loads(r.out)["text"])
    r = generate(["-n", "64", "--json-object", "Hello"], capsys, llama_dir)
    assert r.code == 0 and isinstance(json.loads(json.loads(r.out)["text"]), dict)
    for path in (gbnf, bare):
        r = generate(["-n", "16", "--grammar", str(path), "Is it?"], capsys, llama_dir)
        d = json.loads(r.out)
        assert r.code == 0 and re.fullmatch(r"(yes|no|maybe)\.", d["text"]) and d["settings"]["constraint"]["type"] == "gbnf"
    r = generate(["-n", "64", "--grammar", str(lark), "Numbers"], capsys, llama_dir)
    d = json.loads(r.out)
    assert r.code == 0 and d["settings"]["constraint"]["type"] == "lark"
    assert re.fullmatch(LARK_LANGUAGE if d["finish_reason"] == "stop" else r"\(([0-9]{1,3},)*[0-9]{0,3}", d["text"])
    # plain text output (no --json) is the constrained text too
    r = run_inprocess(["generate", "-m", llama_dir, "--temperature", "0", "--raw", "-n", "8", "--regex", "[0-9]{4}",
                       "x"], capsys)
    assert r.code == 0 and re.fullmatch(r"[0-9]{4}\n", r.out)


@pytest.mark.parametrize("setup,words", [
    (lambda p: ["--json-schema", str(p / "no-such.json")], "file not found"),
    (lambda p: ["--json-schema", _write(p / "bad.json", "{nope")], "not valid JSON"),
    (lambda p: ["--json-schema", _write(p / "never.json", '{"type": "integer", "minimum": 3, "maximum": 1}')],
     "can never be satisfied"),
    (lambda p: ["--json-schema", _write(p / "list.json", "[1]")], "must be an object"),
    (lambda p: ["--json-schema", str(p)], "not a regular file"),
    (lambda p: ["--regex", "(unclosed"], "--regex: invalid regex"),
    (lambda p: ["--grammar", _write(p / "g.lark", "start: nowhere")], "invalid Lark grammar"),
    (lambda p: ["--grammar", _write(p / "g.gbnf", "root ::= (")], "GBNF"),
    (lambda p: ["--regex", "a", "--json-object"], "exclude each other"),
    (lambda p: ["--regex", "a", "--lookup"], "does not work with --lookup"),
])
def test_generate_bad_constraints_are_one_line_before_the_model_loads(tmp_path, capsys, setup, words):
    args = setup(tmp_path)
    files = {f: f.read_bytes() for f in tmp_path.iterdir() if f.is_file()}
    r = run_inprocess(["generate", "-m", str(tmp_path / "no-model-here"), *args, "hi"], capsys)
    line = one_error_line(r)
    assert words in line, line
    assert all(f.read_bytes() == b for f, b in files.items())  # nothing touched


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_batch_constraints_run_wide_and_per_line(tmp_path, capsys, llama_dir):
    lines = [{"id": "free", "prompt": "Hello there", "max_new_tokens": 6, "response_format": {"type": "text"}},
             {"id": "regex", "prompt": "Count:"},
             {"id": "person", "prompt": "Describe a person:", "max_new_tokens": 128,
              "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
             {"id": "object", "prompt": "Hello", "max_new_tokens": 64, "response_format": {"type": "json_object"}},
             {"id": "never", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
                 "schema": {"type": "string", "minLength": 5, "maxLength": 2}}}},
             {"id": "typo", "prompt": "x", "response_format": "json"}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = run_inprocess(["batch", str(src), "-o", str(out), "-m", llama_dir, "--temperature", "0", "--raw",
                       "--regex", "[0-9]{1,3}(,[0-9]{1,3}){2}", "-n", "32", "-b", "3"], capsys)
    assert r.code == 0, r.err
    got = {d["id"]: d for d in map(json.loads, out.read_text().splitlines())}
    assert set(got) == {"free", "regex", "person", "object"}
    assert re.fullmatch(r"[0-9]{1,3}(,[0-9]{1,3}){2}", got["regex"]["completion"])
    jsonschema.validate(json.loads(got["person"]["completion"]), PERSON)
    assert isinstance(json.loads(got["object"]["completion"]), dict)
    assert got["free"]["generated_tokens"] == 6 or got["free"]["finish_reason"] == "eos"
    assert ":5:" in r.err and "never be satisfied" in r.err and ":6:" in r.err and "must be an object" in r.err


def test_batch_bad_run_wide_constraint_is_one_line(tmp_path, capsys, llama_dir):
    src = tmp_path / "in.txt"
    src.write_text("a\nb\n")
    r = run_inprocess(["batch", str(src), "-m", llama_dir, "--regex", "[z-a]"], capsys)
    assert "invalid regex" in one_error_line(r) and src.read_text() == "a\nb\n"


# -- a constraint engine that fails part way ----------------------------------------------
TOO_COMPLEX = r"(x{1000}){1000}"  # valid, but llguidance's lexer gives up once it is under way


def test_a_grammar_that_fails_part_way_ends_the_row_with_an_error_not_a_stop(engine):
    spec = c.ConstraintSpec("regex", TOO_COMPLEX, "--regex")
    r = run(engine, spec, prompt="x", n=32)
    assert r.finish_reason == "error", (r.finish_reason, r.text)
    assert r.error.startswith("--regex: structured output stopped after ") and "constraint engine failed" in r.error
    assert "\n" not in r.error and r.to_dict()["error"] == r.error
    assert not re.fullmatch(TOO_COMPLEX, r.text)  # what it made is incomplete: it must not be called finished
    # The other rows of its batch go on.
    free = GenerationSettings(max_new_tokens=5)
    events = engine.generate_batch([Request(text="x"), Request(text="Hello")],
                                   [GenerationSettings(max_new_tokens=32, constraint=spec), free])
    done = {e.result.row: e.result for e in events if isinstance(e, Done)}
    assert done[0].finish_reason == "error" and done[1].finish_reason in ("length", "eos")
    assert done[1].error is None and "error" not in done[1].to_dict()


def test_generate_and_batch_report_a_grammar_that_fails_part_way(tmp_path, capsys, llama_dir):
    r = generate(["-n", "32", "--regex", TOO_COMPLEX, "x"], capsys, llama_dir)
    assert "structured output stopped after" in one_error_line(r)
    body = json.loads(r.out)  # what was made is still printed, and says why it ended
    assert body["finish_reason"] == "error" and "constraint engine failed" in body["error"]
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("x\n")
    r = run_inprocess(["batch", str(src), "-o", str(out), "-m", llama_dir, "--temperature", "0", "--raw",
                       "--regex", TOO_COMPLEX, "-n", "32"], capsys)
    assert r.code == 0, r.err
    line = json.loads(out.read_text())
    assert line["finish_reason"] == "error" and "constraint engine failed" in line["error"] and "completion" in line
