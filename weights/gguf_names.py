"""Tensor names in llama.cpp's GGUF files and in Hugging Face checkpoints: one table, both
directions. Reading a GGUF (gguf.py, gguf_load.py) maps its names to the checkpoint names the
model families' targets() know; writing one (gguf_write.py) maps them back. Layer tensors
are `blk.N.STEM.weight|bias` ↔ `PREFIX.N.HF_STEM.weight|bias`."""

from __future__ import annotations

import re

# Per architecture: (GGUF name → HF name for whole-model tensors, GGUF layer stem → HF layer
# stem, HF layer prefix). The llama table serves llama, mistral-as-llama, qwen2 and qwen3.
_LLAMA = (
    {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
     "output.weight": "lm_head.weight"},
    {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
     "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
     "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
     "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
    "model.layers",
)
# GPT-2 (llama.cpp's gpt2 architecture) under transformers' GPT2LMHeadModel names.
_GPT2 = (
    {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
     "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
     "output.weight": "lm_head.weight"},
    {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
     "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    "transformer.h",
)
# OLMo 2: norms after attention and MLP (post_attention_norm / post_ffw_norm), q/k norms over
# the whole projections under the names qwen3 uses for its per-head ones.
_OLMO2 = (
    _LLAMA[0],
    {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
     "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
     "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
     "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
     "ffn_down": "mlp.down_proj"},
    "model.layers",
)
# Mixtures of experts (core/moe.py): llama.cpp stacks the experts of a layer in one tensor
# (ffn_gate_exps [experts, inter, hidden], ...); a checkpoint's per-expert tensors all name it
# (`experts.*.` stands for any expert number). Writing stacks them (gguf_write._stacked_plan),
# reading slices them back per expert (expert_hf_name, gguf._expert_slices).
_EXPERTS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.*.gate_proj",
            "ffn_up_exps": "mlp.experts.*.up_proj", "ffn_down_exps": "mlp.experts.*.down_proj",
            "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
            "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_MIXTRAL = (_LLAMA[0], {**_LLAMA[1], "ffn_gate_inp": "block_sparse_moe.gate",
                        "ffn_gate_exps": "block_sparse_moe.experts.*.w1", "ffn_up_exps": "block_sparse_moe.experts.*.w3",
                        "ffn_down_exps": "block_sparse_moe.experts.*.w2"}, "model.layers")
_QWEN_MOE = (_LLAMA[0], {**_LLAMA[1], **_EXPERTS}, "model.layers")
# Phi-3: q/k/v fused (attn_qkv) and gate|up fused (ffn_up, [2 · intermediate, hidden]) in both.
_PHI3 = (
    _LLAMA[0],
    {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_qkv": "self_attn.qkv_proj",
     "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
    "model.layers",
)
# Gemma 2 / 3: sandwich norms (attn_norm, post_attention_norm, ffn_norm = the pre-feed-forward
# norm, post_ffw_norm), gemma3's per-head q/k norms. Every norm's weight is w + 1 in the file
# (llama.cpp's converter adds gemma's 1): gguf.py subtracts it, gguf_write.py adds it.
_GEMMA = (
    _LLAMA[0],
    {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
     "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
     "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_q": "self_attn.q_proj",
     "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
     "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
    "model.layers",
)
GEMMA_ARCHITECTURES = ("gemma2", "gemma3", "gemma3_text")
TABLES = {"llama": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA, "gpt2": _GPT2, "olmo2": _OLMO2, "mixtral": _MIXTRAL,
          "qwen2moe": _QWEN_MOE, "qwen2_moe": _QWEN_MOE, "qwen3moe": _QWEN_MOE, "qwen3_moe": _QWEN_MOE, "phi3": _PHI3,
          **{a: _GEMMA for a in GEMMA_ARCHITECTURES}}
_EXPERT_NUMBER = re.compile(r"\.experts\.\d+\.")
# GPT-2's Conv1D weights (HF names): [in, out] in the checkpoint, [out, in] in the GGUF
# (convert_hf_to_gguf transposes them), which is the layout twice's linear layers hold.
GPT2_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, layers: int, arch: str = "llama") -> str | None:
    """The checkpoint name of a GGUF tensor (None: not a weight of this architecture)."""
    glob, table, prefix = TABLES.get(arch, _LLAMA)
    if gguf_name in glob:
        return glob[gguf_name]
    match = _GGUF_LAYER.fullmatch(gguf_name)
    if match and int(match[1]) < layers and match[2] in table and "*" not in table[match[2]]:
        return f"{prefix}.{int(match[1])}.{table[match[2]]}.{match[3]}"
    return None


def expert_hf_name(gguf_name: str, layers: int, arch: str) -> str | None:
    """The per-expert checkpoint name, `*` for the expert number, of a stacked expert tensor
    (`blk.N.ffn_gate_exps.weight` → `model.layers.N.block_sparse_moe.experts.*.w1.weight`);
    None for every other tensor."""
    glob, table, prefix = TABLES.get(arch, _LLAMA)
    match = _GGUF_LAYER.fullmatch(gguf_name)
    if match and int(match[1]) < layers and "*" in table.get(match[2], ""):
        return f"{prefix}.{int(match[1])}.{table[match[2]]}.{match[3]}"
    return None


def gguf_name(hf: str, arch: str, layers: int) -> str | None:
    """The GGUF name of a checkpoint tensor (GPT-2's with or without `transformer.`)."""
    glob, table, prefix = TABLES.get(arch, _LLAMA)
    if arch == "gpt2" and not hf.startswith(("transformer.", "lm_head.")):
        hf = f"transformer.{hf}"
    for g, h in glob.items():
        if h == hf:
            return g
    if not hf.startswith(prefix + "."):
        return None
    rest = hf[len(prefix) + 1:]
    index, _, leaf = rest.partition(".")
    stem, _, kind = _EXPERT_NUMBER.sub(".experts.*.", "." + leaf)[1:].rpartition(".")
    if not index.isdigit() or int(index) >= layers or kind not in ("weight", "bias"):
        return None
    for g, h in table.items():
        if h == stem:
            return f"blk.{int(index)}.{g}.{kind}"
    return None
