"""The mixture-of-experts families: Mixtral, Qwen3-MoE (Qwen3-30B-A3B, ...), Qwen1.5/2-MoE.

Each is the llama block (core/llama.py) with its MLP replaced, on the sparse layers, by a
router and experts (core/experts.py). They differ by flags, as llama/qwen2/qwen3 do:

* mixtral: every layer sparse; `num_local_experts`, experts of `intermediate_size`; the top-k
  weights always renormalized and kept in float32; llama attention without biases; an optional
  `sliding_window` on every layer (as mistral's).
* qwen3_moe: `num_experts` of `moe_intermediate_size`; top-k renormalized only if
  `norm_topk_prob`; q/k RMSNorm per head (as qwen3), `attention_bias`; dense layers among the
  sparse ones: layer i is sparse unless listed in `mlp_only_layers` or (i + 1) is not a multiple
  of `decoder_sparse_step` (a dense layer's MLP has `intermediate_size`); a window on every
  layer when `use_sliding_window`.
* qwen2_moe: as qwen3_moe without the q/k norms, with q/k/v biases (`qkv_bias`) and a shared
  expert (`shared_expert_intermediate_size`) whose output, scaled by sigmoid of a one-row gate,
  is added to the experts'; windows as transformers' Qwen2MoeConfig places them.

Tensor parallelism splits every expert by rows (each rank holds a slice of every expert's
gate/up rows and down columns, the router replicated), so every rank does the same share of
each token's work whichever experts it picks; the weighted sum is all-reduced once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig, layer_types_from, size_field
from .errors import ConfigError, UnsupportedModelError, WeightsError
from .experts import SparseMoE, expert_targets
from .family import Family, GgufForm, GgufNames, attention_parameters
from .fields import Fields, show
from .layers import GatedMLP
from . import llama
from .llama import LlamaModel
from .model import Target, columns, fused_rows
from .parallel import Shard


@dataclass(frozen=True)
class MoeOptions:
    experts: int
    top_k: int
    renormalize: bool  # top-k weights divided by their sum (mixtral always; qwen's norm_topk_prob)
    float_weights: bool  # the top-k weights stay float32 (mixtral) or take the activation dtype (qwen)
    expert_intermediate: int
    shared_intermediate: int  # 0: no shared expert
    sparse: tuple[bool, ...]  # per layer: router + experts, else a dense MLP of intermediate_size

    @property
    def sparse_layers(self) -> int:
        return sum(self.sparse)


class Block(llama.Block):
    """llama's block with a sparse feed-forward part on the layers the config makes sparse."""

    def make_mlp(self, c: ModelConfig, layer: int, shard: Shard) -> torch.nn.Module:
        o = c.options
        if not o.sparse[layer]:
            inter = shard.part(c.intermediate_size, "intermediate_size")[1]
            return GatedMLP(c.hidden_size, inter, c.hidden_act, False, shard=shard)
        inter = shard.part(o.expert_intermediate, "moe_intermediate_size")[1]
        shared = shard.part(o.shared_intermediate, "shared_expert_intermediate_size")[1] if o.shared_intermediate else 0
        return SparseMoE(c.hidden_size, o.experts, inter, c.hidden_act, o.top_k, o.renormalize, o.float_weights,
                         shared, shard=shard)


class MoeModel(LlamaModel):
    """LlamaModel's embedding, RoPE, final norm and head (and its hidden_states), with these blocks."""

    Block = Block

    def features(self) -> frozenset[str]:
        extra = {"moe"} | ({"moe:shared"} if self.config.options.shared_intermediate else set())
        return super().features() | extra

    def active_weight_bytes(self) -> int:
        """All weights but the experts a token does not choose: (experts - top_k) / experts of
        each sparse layer's stacked expert matrices are not read."""
        o = self.config.options
        unread = 0
        for block in self.layers:
            if isinstance(block.mlp, SparseMoE):
                e = block.mlp.experts
                stacked = sum(b.nbytes for m in (e.gate_up_proj, e.down_proj)
                              for b in [*m.parameters(recurse=False), *m.buffers(recurse=False)] if b.dim() == 2)
                unread += stacked * (o.experts - o.top_k) // o.experts
        return self.weight_bytes() - unread

    def targets(self) -> dict[str, Target]:
        c, o, shard = self.config, self.config.options, self.shard
        t = super().targets()  # llama's names; a sparse layer's MLP entries are replaced below
        for i in range(c.num_hidden_layers):
            if not o.sparse[i]:
                continue
            hf, ours = f"model.layers.{i}", f"layers.{i}.mlp"
            for name in ("gate_proj", "up_proj", "down_proj"):
                del t[f"{hf}.mlp.{name}.weight"]
            if c.model_type == "mixtral":  # the Hub's names, and transformers 5's (block_sparse_moe → mlp)
                t[f"{hf}.block_sparse_moe.gate.weight"] = Target(f"{ours}.gate.weight")
                t.update(expert_targets(f"{hf}.block_sparse_moe", ours, ("w1", "w3", "w2"), o.experts, c.hidden_size,
                                        o.expert_intermediate, shard, stacked=False))
                t.update(expert_targets(f"{hf}.mlp", ours, ("w1", "w3", "w2"), o.experts, c.hidden_size,
                                        o.expert_intermediate, shard, per_expert=False))
            else:
                t.update(expert_targets(f"{hf}.mlp", ours, ("gate_proj", "up_proj", "down_proj"), o.experts,
                                        c.hidden_size, o.expert_intermediate, shard))
            t[f"{hf}.mlp.gate.weight"] = Target(f"{ours}.gate.weight")
            if o.shared_intermediate:
                s0, sn = shard.part(o.shared_intermediate, "shared_expert_intermediate_size")
                part = (s0, sn, o.shared_intermediate)
                t.update(fused_rows(f"{hf}.mlp.shared_expert", f"{ours}.shared_expert.gate_up_proj",
                                    ("gate_proj", "up_proj"), (part, part), False))
                t[f"{hf}.mlp.shared_expert.down_proj.weight"] = columns(f"{ours}.shared_expert.down_proj.weight", *part)
                t[f"{hf}.mlp.shared_expert_gate.weight"] = Target(f"{ours}.shared_expert_gate.weight")
        return t


# -- the families' configs ------------------------------------------------------------------------------

def configure(model_type: str, f: Fields, d: dict, layers: int) -> dict:
    src = f.source
    mixtral = model_type == "mixtral"
    # transformers' MixtralConfig and Qwen3MoeConfig read num_experts as num_local_experts (their
    # attribute_map): the Hub's qwen3_moe configs say num_experts, save_pretrained writes the other.
    keys = ("num_experts",) if model_type == "qwen2_moe" else ("num_local_experts", "num_experts")
    given = [k for k in keys if d.get(k) is not None]
    if len(given) == 2 and d[given[0]] != d[given[1]]:
        raise ConfigError(f"{src}: num_experts ({show(d['num_experts'])}) and num_local_experts "
                          f"({show(d['num_local_experts'])}) name the same count and must agree")
    count_key = given[0] if given else keys[-1 if model_type == "qwen3_moe" else 0]
    experts = f.int(count_key, _EXPERTS[model_type], lo=1)
    top_k = f.int("num_experts_per_tok", lo=1)
    if top_k > experts:
        raise ConfigError(f"{src}: num_experts_per_tok ({top_k}) must not exceed {count_key} ({experts})")
    if mixtral:
        expert_inter = size_field(f, "intermediate_size")
        sparse = (True,) * layers
    else:
        expert_inter = size_field(f, "moe_intermediate_size")
        step = f.int("decoder_sparse_step", 1, lo=1)
        dense = f.list("mlp_only_layers", [])
        for i in dense:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers:
                raise ConfigError(f"{src}: mlp_only_layers must list layer indices 0..{layers - 1}, got {show(i)}")
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    shared = size_field(f, "shared_expert_intermediate_size") if model_type == "qwen2_moe" else 0

    window, layer_types = None, ()
    if mixtral:
        qkv_bias = o_bias = False
        if d.get("sliding_window") is not None:
            window, layer_types = size_field(f, "sliding_window"), ("sliding_attention",) * layers
    elif model_type == "qwen3_moe":
        qkv_bias = o_bias = f.bool("attention_bias", False)
        if f.bool("use_sliding_window", False) and d.get("sliding_window") is not None:
            window, layer_types = size_field(f, "sliding_window"), ("sliding_attention",) * layers
    else:  # qwen2_moe: transformers' default places windows on the even layers below max_window_layers
        qkv_bias, o_bias = f.bool("qkv_bias", True), False
        if f.bool("use_sliding_window", False) and d.get("sliding_window") is not None:
            window = size_field(f, "sliding_window")
            layer_types = layer_types_from(f, d, layers)
            if layer_types is None:
                first = f.int("max_window_layers", 28, lo=0)
                layer_types = tuple("sliding_attention" if (i + 1) % 2 and i < first else "full_attention"
                                    for i in range(layers))
    options = MoeOptions(experts=experts, top_k=top_k, renormalize=mixtral or f.bool("norm_topk_prob", False),
                         float_weights=mixtral, expert_intermediate=expert_inter, shared_intermediate=shared,
                         sparse=sparse)
    return dict(qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=False, qk_norm=model_type == "qwen3_moe",
                sliding_window=window, layer_types=layer_types, options=options)


def _count(c: ModelConfig, experts: int) -> int:
    """Parameters with `experts` experts per sparse layer counted (all of them, or the top_k a token reads)."""
    o, h = c.options, c.hidden_size
    attn = attention_parameters(h, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.qkv_bias, c.o_bias)
    norms = 2 * h + (2 * c.head_dim if c.qk_norm else 0)
    sparse = (h * o.experts + experts * 3 * h * o.expert_intermediate
              + (3 * h * o.shared_intermediate + h if o.shared_intermediate else 0))
    dense = 3 * h * c.intermediate_size
    mlps = o.sparse_layers * sparse + (c.num_hidden_layers - o.sparse_layers) * dense
    head = 0 if c.tie_word_embeddings else c.vocab_size * h
    return c.num_hidden_layers * (attn + norms) + mlps + c.vocab_size * h + h + head


def parameter_count(c: ModelConfig) -> int:
    return _count(c, c.options.experts)


def active_parameter_count(c: ModelConfig) -> int:
    """What one token's forward pass reads: every weight but the unchosen experts'."""
    return _count(c, c.options.top_k)


# -- the families in llama.cpp's GGUF files --------------------------------------------------------------

# llama.cpp stacks the experts of a layer in one tensor (ffn_gate_exps [experts, inter, hidden],
# ...); a checkpoint's per-expert tensors all name it (`experts.*.` stands for any expert number).
_GGUF_EXPERTS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.*.gate_proj",
                 "ffn_up_exps": "mlp.experts.*.up_proj", "ffn_down_exps": "mlp.experts.*.down_proj",
                 "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                 "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_GGUF_MIXTRAL = GgufNames(llama.GGUF_NAMES.whole, {
    **llama.GGUF_NAMES.layer, "ffn_gate_inp": "block_sparse_moe.gate", "ffn_gate_exps": "block_sparse_moe.experts.*.w1",
    "ffn_up_exps": "block_sparse_moe.experts.*.w3", "ffn_down_exps": "block_sparse_moe.experts.*.w2"})
_GGUF_QWEN = GgufNames(llama.GGUF_NAMES.whole, {**llama.GGUF_NAMES.layer, **_GGUF_EXPERTS})


def _gguf_experts(m) -> tuple[int, int]:
    experts, used = m.int("expert_count"), m.int("expert_used_count")
    if used > experts:
        raise WeightsError(f"{m.src}: {m.arch}.expert_used_count {used} exceeds {m.arch}.expert_count {experts}")
    return experts, used


def _gguf_read_mixtral(config: dict, m) -> None:
    """Mixtral as llama.cpp holds it: the llama architecture with expert_count experts of
    feed_forward_length rows, expert_used_count per token (softmax, top-k, renormalized), every
    layer sparse, no window."""
    experts, used = _gguf_experts(m)
    config.update(num_local_experts=experts, num_experts_per_tok=used, sliding_window=None)
    del config["attention_bias"], config["mlp_bias"]


def _gguf_read_qwen3(config: dict, m) -> None:
    """Qwen3-MoE as llama.cpp runs it (models/qwen3moe.cpp): every layer sparse, experts of
    expert_feed_forward_length rows, the top-k weights always renormalized, q/k norms per head."""
    experts, used = _gguf_experts(m)
    config.update(num_experts=experts, num_experts_per_tok=used, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], moe_intermediate_size=m.int("expert_feed_forward_length"))
    del config["mlp_bias"]


def _gguf_read_qwen2(config: dict, m) -> None:
    """Qwen2-MoE as llama.cpp runs it (src/models/qwen2moe.cpp): every layer sparse, the top-k
    softmax weights never renormalized, a shared expert (expert_shared_feed_forward_length rows,
    feed_forward_length where absent) behind its sigmoid gate, q/k/v biases, no window."""
    experts, used = _gguf_experts(m)
    inter = config["intermediate_size"]
    config.update(num_experts=experts, num_experts_per_tok=used, norm_topk_prob=False, decoder_sparse_step=1,
                  mlp_only_layers=[], qkv_bias=True, use_sliding_window=False,
                  moe_intermediate_size=m.int("expert_feed_forward_length", default=max(inter // used, 1)),
                  shared_expert_intermediate_size=m.int("expert_shared_feed_forward_length", default=inter))
    del config["attention_bias"], config["mlp_bias"]


def _gguf_write(config: ModelConfig, raw: dict, arch: str) -> list:
    o = config.options
    kv = [(f"{arch}.expert_count", "uint32", o.experts), (f"{arch}.expert_used_count", "uint32", o.top_k)]
    if config.model_type == "mixtral":
        return llama.FAMILY.gguf["llama"].write(config, raw, arch) + kv
    kv.append((f"{arch}.expert_feed_forward_length", "uint32", o.expert_intermediate))
    if config.model_type == "qwen2_moe":
        kv.append((f"{arch}.expert_shared_feed_forward_length", "uint32", o.shared_intermediate))
    return kv


def _gguf_check(config: ModelConfig, where) -> None:
    """What llama.cpp's qwen3moe / qwen2moe graphs fix: every layer sparse; qwen3moe always
    renormalizes the top-k weights, qwen2moe never, and needs its shared expert and own head."""
    o, t = config.options, config.model_type
    if t == "mixtral":
        return
    arch = FAMILY.gguf[t].arch
    if o.renormalize != (t == "qwen3_moe"):
        raise UnsupportedModelError(f"{where}: {t} with norm_topk_prob {str(o.renormalize).lower()} has no GGUF form "
                                    f"(llama.cpp's {arch} {'always' if t == 'qwen3_moe' else 'never'} renormalizes "
                                    "the top-k weights)")
    if not all(o.sparse):
        raise UnsupportedModelError(f"{where}: {t} with dense layers (mlp_only_layers, decoder_sparse_step) has no "
                                    f"GGUF form (llama.cpp's {arch} makes every layer sparse)")
    if t == "qwen2_moe" and not o.shared_intermediate:
        raise UnsupportedModelError(f"{where}: qwen2_moe without a shared expert has no GGUF form (llama.cpp's "
                                    "qwen2moe needs one)")
    if t == "qwen2_moe" and config.tie_word_embeddings:
        raise UnsupportedModelError(f"{where}: qwen2_moe with a tied lm_head has no GGUF form (llama.cpp's "
                                    "qwen2moe needs its own output tensor)")


_GGUF = {"mixtral": GgufForm("llama", "MixtralForCausalLM", _GGUF_MIXTRAL, read=_gguf_read_mixtral, write=_gguf_write,
                             experts=True, permuted_qk=True),
         "qwen3_moe": GgufForm("qwen3moe", "Qwen3MoeForCausalLM", _GGUF_QWEN, read=_gguf_read_qwen3,
                               write=_gguf_write, check=_gguf_check, experts=True),
         "qwen2_moe": GgufForm("qwen2moe", "Qwen2MoeForCausalLM", _GGUF_QWEN, read=_gguf_read_qwen2,
                               write=_gguf_write, check=_gguf_check, experts=True)}


_EXPERTS = {"mixtral": 8, "qwen2_moe": 60, "qwen3_moe": 128}  # transformers' default expert counts
_QWEN = dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=32768,
             decoder_sparse_step=1, norm_topk_prob=False, use_sliding_window=False, sliding_window=4096)
FAMILY = Family(
    model_types=("mixtral", "qwen2_moe", "qwen3_moe"),
    model=MoeModel,
    configure=configure,
    parameter_count=parameter_count,
    active_parameter_count=active_parameter_count,
    defaults={
        "mixtral": dict(rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
                        max_position_embeddings=4096 * 32, num_experts_per_tok=2),
        "qwen2_moe": dict(_QWEN, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                          num_experts_per_tok=4, qkv_bias=True, max_window_layers=28),
        "qwen3_moe": dict(_QWEN, moe_intermediate_size=768, num_experts_per_tok=8,
                          attention_bias=False),
    },
    hf_config={"mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig"},
    gguf=_GGUF,
)
