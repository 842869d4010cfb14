"""Tiny random models of every supported family, built with transformers itself, and a
byte-level BPE tokenizer trained on the spot. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB = 512
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Caches trade memory for speed.",
    "Prefill runs the prompt once; decode feeds one token at a time. 12345 67890",
    "Café, naïve, jalapeño, Ångström, façade — accents everywhere. ¿Qué tal? Größe!",
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。",
    "Emoji: 😀 🚀 🎉 👍🏽 🧑‍💻 ❤️ and symbols ∑ ∫ √ ≠ ≤ ≥ → ←.",
    "def f(x):\n    return x * 2  # code with    spaces\n\tand tabs\n",
    "Hello world! How are you today? I am fine, thank you.",
] * 20


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def spm_tokenizer(folder: Path, style: str = "gemma") -> None:
    """A SentencePiece BPE tokenizer trained on the tiny corpus, into `folder` as
    tokenizer.model plus the tokenizer.json transformers makes of it (replacing the folder's
    tokenizer files), with the added_tokens_decoder real folders have (llama.cpp's converter
    types tokens from it). style "gemma": Gemma's (byte fallback, no dummy prefix, digits split,
    whitespace kept, <pad> <eos> <bos> <unk> at 0..3, turn markers); "llama": Llama 2's (a
    prefix space, <unk> <s> </s> at 0..2)."""
    import io
    import json

    import sentencepiece as spm
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
        (folder / name).unlink(missing_ok=True)
    gemma = style == "gemma"
    if gemma:
        specials = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                        bos_piece="<bos>", unk_piece="<unk>")
        names = ["<pad>", "<eos>", "<bos>", "<unk>"]
        markers = ["<start_of_turn>", "<end_of_turn>"]
    else:
        specials = dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>")
        names, markers = ["<unk>", "<s>", "</s>"], []
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_writer=model, vocab_size=480, model_type="bpe",
        byte_fallback=True, add_dummy_prefix=not gemma, normalization_rule_name="identity", split_digits=gemma,
        remove_extra_whitespaces=False, character_coverage=1.0, user_defined_symbols=markers or None,
        hard_vocab_limit=False, minloglevel=2, **specials)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    bos, eos, unk = (names[2], names[1], names[3]) if gemma else (names[1], names[2], names[0])
    config = {"tokenizer_class": "GemmaTokenizer" if gemma else "LlamaTokenizer", "bos_token": bos,
              "eos_token": eos, "unk_token": unk, "add_bos_token": True, "add_eos_token": False}
    if gemma:
        config["pad_token"] = "<pad>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    kwargs = {"extra_special_tokens": markers} if markers else {}
    AutoTokenizer.from_pretrained(folder, **kwargs).save_pretrained(folder)  # + tokenizer.json from the .model
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True} for i, t in enumerate(names + markers)}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def save_tokenizer(folder: Path, tok: Tokenizer, chat_template: str | None = CHAT_TEMPLATE) -> None:
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "model_max_length": 256, "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template:
        cfg["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def hf_config(family: str):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.08, bos_token_id=0, eos_token_id=2, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "llama3":  # Llama 3.1-style rope scaling, MHA, tied head
        return LlamaConfig(**{**common, "num_key_value_heads": 4, "tie_word_embeddings": True,
                              "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}})
    if family == "mistral":  # a small window so the tests cross it
        return MistralConfig(**{**common, "sliding_window": 12})
    if family == "qwen2":
        return Qwen2Config(**{**common, "num_key_value_heads": 1, "tie_word_embeddings": True})
    if family == "qwen3":  # explicit head_dim that is not hidden/heads
        return Qwen3Config(**{**common, "head_dim": 24})
    # Real head sizes (64, 128): the native decode step has vector code for exactly these,
    # and takes the query heads of one kv head 4 (64) or 2 (128) at a time: groups of 5 and
    # 3 leave a remainder.
    if family == "llama-hd64":
        return LlamaConfig(**{**common, "hidden_size": 80, "num_attention_heads": 5, "num_key_value_heads": 1,
                              "head_dim": 64})
    if family == "qwen3-hd128":
        return Qwen3Config(**{**common, "hidden_size": 96, "head_dim": 128, "num_attention_heads": 6, "num_key_value_heads": 2})
    if family == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                          initializer_range=0.08, bos_token_id=0, eos_token_id=2)
    if family == "olmo2":  # GQA; q/k norms over the whole projections (their weights: tests/test_family_olmo2.py)
        from transformers import Olmo2Config

        return Olmo2Config(**{**common, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    if family in ("phi3", "phi3-long"):  # Phi-4-mini-like: longrope, partial rotary 0.75 (12 of 16 dims), GQA
        from transformers import Phi3Config

        # "phi3" never leaves the short factors in the standard checks (prompts + 32 tokens < 64);
        # "phi3-long" crosses original_max_position_embeddings 16 (tests/test_family_phi3.py) and a window.
        original, longest = (64, 256) if family == "phi3" else (16, 64)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
                "original_max_position_embeddings": original}
        extra = {} if family == "phi3" else {"sliding_window": 12}
        return Phi3Config(**{**common, "max_position_embeddings": longest, "original_max_position_embeddings": original,
                             "rope_parameters": rope, "pad_token_id": 0, **extra})
    if family == "mixtral":  # 8 experts, top-2, a window the tests' prompts cross
        from transformers import MixtralConfig

        return MixtralConfig(**{**common, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 12})
    if family in ("qwen3_moe", "qwen3_moe-nonorm"):  # more experts than top-k; a dense layer among sparse ones
        from transformers import Qwen3MoeConfig

        norm = family == "qwen3_moe"
        return Qwen3MoeConfig(**{**common, "num_hidden_layers": 3, "head_dim": 24, "num_experts": 8,
                                 "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": norm,
                                 "mlp_only_layers": [1] if norm else [], "decoder_sparse_step": 1 if norm else 2})
    if family == "qwen2_moe":  # a shared expert with its sigmoid gate; a sliding layer below max_window_layers
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(**{**common, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                 "shared_expert_intermediate_size": 64, "use_sliding_window": True,
                                 "sliding_window": 12, "max_window_layers": 2})
    if family in ("gemma2", "gemma3", "gemma3-mm"):
        return gemma_config(family, common)
    raise KeyError(family)


def gemma_config(family: str, common: dict):
    """Gemma 2 and 3 at sizes where every feature acts: windows of 8 (the standard checks'
    prompts are 24+ tokens), sliding and global layers, caps far below the random logits
    (initializer_range 0.5), query_pre_attn_scalar unlike head_dim, GQA. (make_model also
    draws the norms' weights: transformers starts gemma's (1 + w) norms at w = 0.)"""
    from transformers import Gemma2Config, Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    base = {**common, "initializer_range": 0.5, "sliding_window": 8, "pad_token_id": 0}
    if family == "gemma2":  # layers: sliding, global, sliding, global; untied head
        return Gemma2Config(**{**base, "num_hidden_layers": 4, "head_dim": 16, "query_pre_attn_scalar": 24,
                               "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0})
    # gemma3: S S G S S (sliding_window_pattern 3), a local rope base, linear scaling on global
    # layers, q/k norms, a final cap (transformers applies no attention cap in gemma3), tied head
    text = Gemma3TextConfig(**{**base, "num_hidden_layers": 5, "head_dim": 24, "query_pre_attn_scalar": 32,
                               "sliding_window_pattern": 3, "tie_word_embeddings": True,
                               "final_logit_softcapping": 3.0 if family == "gemma3" else None,
                               "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 1e6,
                               "rope_local_base_freq": 10000.0})
    if family == "gemma3":
        return text
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=8)
    return Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                        tie_word_embeddings=True)


FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gpt2", "phi3", "olmo2", "mixtral", "qwen3_moe", "qwen3_moe-nonorm", "qwen2_moe", "gemma2", "gemma3"]


def make_model(folder: Path, family: str, tok: Tokenizer, seed: int = 0, **config) -> Path:
    """The tiny random `family` model (`config`: fields that replace its config's) in folder."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    hf = hf_config(family)
    for key, value in config.items():
        setattr(hf, key, value)
    model = AutoModelForCausalLM.from_config(hf).eval()
    if family.startswith("gemma"):  # transformers starts gemma's (1 + w) norms at w = 0
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    save_tokenizer(folder, tok)
    return folder


def to_hub_form(folder: Path) -> None:
    """Rewrite config.json the way Hub checkpoints carry it: rope_theta and rope_scaling at
    the top level instead of transformers 5's rope_parameters."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters", None)
    if rope:
        cfg["rope_theta"] = rope.pop("rope_theta")
        kind = rope.pop("rope_type", "default")
        cfg["rope_scaling"] = None if kind == "default" else {"rope_type": kind, **rope}
    path.write_text(json.dumps(cfg, indent=1))


def set_json(path: Path, **changes) -> None:
    """Edit a JSON file: set each key, or remove it when the value is None."""
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def add_gguf_metadata(writer, metadata: dict) -> None:
    """Write plain Python values as GGUF metadata (ints as uint32, floats as float32)."""
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)


def cpu_flags() -> set[str]:
    """This CPU's feature flags, for tests of instruction-set-specific kernels: the reader
    `--dtype auto` decides by (twice.core.device.cpu_flags)."""
    from twice.core.device import cpu_flags as flags

    return flags()


def gguf_files(root: Path, dirs, name: str | None = None):
    """(family, kind) → the tiny model of `dirs(family)` written by `twice quantize --type kind`
    into `root`, once each. `name` sets general.name (llama.cpp picks token attributes by it)."""
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, kind: str) -> Path:
        if (family, kind) not in made:
            from twice.weights.gguf_write import write_gguf

            made[family, kind] = root / f"{family}-{kind}.gguf"
            extra = {} if name is None else {"name": name}
            write_gguf(dirs(family), made[family, kind], kind, **extra)
        return made[family, kind]

    return get
