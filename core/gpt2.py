"""GPT-2: learned absolute positions, LayerNorm with bias, biased fused QKV, plain GELU MLP.

Checkpoints store GPT-2's projections as Conv1D weights [in, out]; the name map marks them
`transpose` so they land in ordinary [out, in] linear layers.

Tensor parallelism splits by heads and MLP units as llama's does: a rank's share of the fused
c_attn is three column slices of the one checkpoint tensor (its q, k and v heads; columns, as
Conv1D stores [in, out]) and of its bias three slices; c_fc its columns, both c_proj their rows
(each rank's partial sums all-reduced before the bias is added once); embeddings, positions and
LayerNorms whole.
"""

from __future__ import annotations

import torch

from .attention import CachedSelfAttention, Step
from .cache import KVCache
from .config import ModelConfig
from .layers import Embedding, Linear, PlainMLP
from .errors import UnsupportedModelError, WeightsError
from .family import Family, GgufForm, GgufNames, attention_parameters
from .fields import Fields
from .model import CausalLM, Placement, Source, Target, fused
from .parallel import SINGLE, Shard


class Block(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: Shard):
        super().__init__()
        c = config
        scale = c.head_dim**-0.5 if c.scale_attn_weights else 1.0
        if c.scale_attn_by_inverse_layer_idx:
            scale /= layer + 1
        heads = shard.part(c.num_attention_heads, "num_attention_heads")[1]
        self.ln_1 = torch.nn.LayerNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.attn = CachedSelfAttention(c.hidden_size, heads, heads, c.head_dim, True, True, scale=scale, layer=layer,
                                        window=None, shard=shard)
        self.ln_2 = torch.nn.LayerNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = PlainMLP(c.hidden_size, shard.part(c.intermediate_size, "intermediate_size")[1], c.hidden_act,
                            shard=shard)

    def forward(self, x: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), step, cache)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(CausalLM):
    def __init__(self, config: ModelConfig, shard: Shard = SINGLE):
        super().__init__(config, shard)
        self.wte = Embedding(config.vocab_size, config.hidden_size)
        self.wpe = Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = torch.nn.ModuleList(Block(config, i, shard) for i in range(config.num_hidden_layers))
        self.ln_f = torch.nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.wte.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def features(self) -> frozenset[str]:
        return frozenset({"block:gpt2", f"act:{self.config.hidden_act}", "qkv_bias", "o_bias", "mlp_bias"}
                         | ({"tp"} if self.shard.active else set()))

    def hidden_states(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(step.positions)
        for block in self.h:
            x = block(x, step, cache)
        return self.ln_f(x)

    def targets(self) -> dict[str, Placement]:
        c, shard = self.config, self.shard
        h0, hn = (x * c.head_dim for x in shard.part(c.num_attention_heads, "num_attention_heads"))
        i0, i_n = shard.part(c.intermediate_size, "intermediate_size")
        H, inter = c.hidden_size, c.intermediate_size
        t: dict[str, Placement] = {
            "wte.weight": Target("wte.weight"),
            "wpe.weight": Target("wpe.weight"),
            "ln_f.weight": Target("ln_f.weight"),
            "ln_f.bias": Target("ln_f.bias"),
        }
        for i in range(c.num_hidden_layers):
            p = f"h.{i}"
            for norm in ("ln_1", "ln_2"):
                t[f"{p}.{norm}.weight"] = Target(f"{p}.{norm}.weight")
                t[f"{p}.{norm}.bias"] = Target(f"{p}.{norm}.bias")
            for hf, ours in (("attn.c_attn", "attn.qkv_proj"), ("attn.c_proj", "attn.o_proj"),
                             ("mlp.c_fc", "mlp.c_fc"), ("mlp.c_proj", "mlp.c_proj")):
                t[f"{p}.{hf}.weight"] = Target(f"{p}.{ours}.weight", transpose=True)
                t[f"{p}.{hf}.bias"] = Target(f"{p}.{ours}.bias")
            if shard.active:  # Conv1D [in, out]: a rank's outputs are columns, its inputs rows
                qkv = f"{p}.attn.qkv_proj"
                t[f"{p}.attn.c_attn.weight"] = fused([Target(f"{qkv}.weight", k * hn, hn, transpose=True,
                                                             source=Source(1, h0, h0 + hn, H)) for k in range(3)])
                t[f"{p}.attn.c_attn.bias"] = fused([Target(f"{qkv}.bias", k * hn, hn, source=Source(0, h0, h0 + hn, H))
                                                    for k in range(3)])
                t[f"{p}.attn.c_proj.weight"] = Target(f"{p}.attn.o_proj.weight", transpose=True,
                                                      source=Source(0, h0, h0 + hn, H))
                t[f"{p}.mlp.c_fc.weight"] = Target(f"{p}.mlp.c_fc.weight", transpose=True,
                                                   source=Source(1, i0, i0 + i_n, inter))
                t[f"{p}.mlp.c_fc.bias"] = Target(f"{p}.mlp.c_fc.bias", source=Source(0, i0, i0 + i_n, inter))
                t[f"{p}.mlp.c_proj.weight"] = Target(f"{p}.mlp.c_proj.weight", transpose=True,
                                                     source=Source(0, i0, i0 + i_n, inter))
        # transformers saves GPT2LMHeadModel under "transformer."; the original
        # OpenAI-converted checkpoints carry the bare names. Accept both.
        t.update({f"transformer.{name}": target for name, target in list(t.items())})
        t["lm_head.weight"] = Target("wte.weight" if c.tie_word_embeddings else "lm_head.weight")
        return t


# -- the family's config ---------------------------------------------------------------------------------

def _complete(d: dict) -> None:
    d.pop("head_dim", None)  # always hidden / heads
    hidden = d.get("hidden_size")
    if d.get("intermediate_size") is None and isinstance(hidden, int) and not isinstance(hidden, bool):
        d["intermediate_size"] = 4 * hidden


def configure(model_type: str, f: Fields, d: dict, layers: int) -> dict:
    return dict(qkv_bias=True, o_bias=True, mlp_bias=True, scale_attn_weights=f.bool("scale_attn_weights", True),
                scale_attn_by_inverse_layer_idx=f.bool("scale_attn_by_inverse_layer_idx", False))


def parameter_count(c: ModelConfig) -> int:
    h = c.hidden_size
    attn = attention_parameters(h, c.num_attention_heads, c.num_key_value_heads, c.head_dim, True, True)
    mlp = 2 * h * c.intermediate_size + c.intermediate_size + h
    head = 0 if c.tie_word_embeddings else c.vocab_size * h
    return c.num_hidden_layers * (attn + mlp + 4 * h) + (c.vocab_size + c.max_position_embeddings) * h + 2 * h + head


# -- GPT-2 in llama.cpp's GGUF files (its gpt2 architecture) -----------------------------------------

_GGUF_NAMES = GgufNames(
    whole={"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
           "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
           "output.weight": "lm_head.weight"},
    layer={"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
           "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    prefix="transformer.h",
    optional_root="transformer.",
)
# Conv1D weights: [in, out] in the checkpoint, [out, in] in the file (the converter transposes
# them), which is the layout twice's linear layers hold.
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def _gguf_read(config: dict, m) -> None:
    """config.json of a Hugging Face GPT-2 (GPT2LMHeadModel) from `gpt2.*` metadata, as
    llama.cpp's convert_hf_to_gguf.py writes it (GPT2Model): learned positions (no RoPE
    keys), LayerNorm with bias and its epsilon, the tanh-approximated GELU llama.cpp runs
    (transformers' "gelu_new"), one key/value head per attention head. The sizes go under
    the names both transformers' GPT2Config (through its attribute map) and twice read;
    the MLP width, epsilon and activation under GPT-2's own (n_inner, layer_norm_epsilon,
    activation_function)."""
    hidden, heads = m.int("embedding_length"), m.int("attention.head_count")
    kv_heads = m.kv_heads(heads)
    if kv_heads != heads:
        raise UnsupportedModelError(f"{m.src}: gpt2 with {kv_heads} key/value heads for {heads} attention heads "
                                    "(grouped-query attention) is not supported")
    if hidden % heads:
        raise WeightsError(f"{m.src}: embedding_length {hidden} is not divisible by head_count {heads}")
    for key in ("key_length", "value_length"):
        if m.get(f"attention.{key}", hidden // heads) != hidden // heads:
            raise UnsupportedModelError(f"{m.src}: gpt2 attention {key} {m.get(f'attention.{key}')!r} is not "
                                        f"embedding_length / head_count ({hidden // heads}), which GPT-2 cannot "
                                        "express")
    config.update({
        "hidden_size": hidden,
        "num_hidden_layers": m.int("block_count"),
        "num_attention_heads": heads,
        "max_position_embeddings": m.int("context_length"),
        "n_inner": m.int("feed_forward_length"),
        "layer_norm_epsilon": m.float("attention.layer_norm_epsilon"),
        "activation_function": "gelu_new",
    })


def _gguf_write(config: ModelConfig, raw: dict, arch: str) -> list:
    return [(f"{arch}.attention.layer_norm_epsilon", "float32", config.rms_norm_eps)]


# transformers' names of the GELU llama.cpp's gpt2 computes whatever the file says (exact
# "gelu" is another function): the form's activations, which the writer checks.
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _gguf_check(config: ModelConfig, where) -> None:
    if config.scale_attn_by_inverse_layer_idx or not config.scale_attn_weights:
        raise UnsupportedModelError(f"{where}: GPT-2 attention scaling options (scale_attn_weights false, "
                                    "scale_attn_by_inverse_layer_idx) have no GGUF form")


FAMILY = Family(
    model_types=("gpt2",),
    model=GPT2Model,
    configure=configure,
    parameter_count=parameter_count,
    defaults={"gpt2": dict(max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=True,
                           hidden_act="gelu_new")},
    # GPT-2 spells the common fields its own way: these four as transformers' GPT2Config.attribute_map
    # (hidden_size, if also given, wins) ...
    aliases={"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
             "n_positions": "max_position_embeddings"},
    # ... and these three only so (a hidden_act in a gpt2 config.json changes nothing in transformers)
    renamed={"n_inner": "intermediate_size", "layer_norm_epsilon": "rms_norm_eps", "activation_function": "hidden_act"},
    complete=_complete,
    rotary=False,
    hf_config={"gpt2": "GPT2Config"},
    gguf={"gpt2": GgufForm("gpt2", "GPT2LMHeadModel", _GGUF_NAMES, read=_gguf_read, write=_gguf_write,
                           check=_gguf_check, shared_keys=False, transposed=_CONV1D,
                           activations=_TANH_GELU, o_bias=True)},
)
