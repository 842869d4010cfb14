"""Tensor names in llama.cpp's GGUF files and in Hugging Face checkpoints, both directions,
by the tables the model families declare (core/family.GgufNames, one per model_type's GGUF
form). Reading a GGUF (gguf.py, gguf_load.py) maps its names to the checkpoint names the
families' targets() know; writing one (gguf_write.py) maps them back. Layer tensors are
`blk.N.STEM.weight|bias` ↔ `PREFIX.N.HF_STEM.weight|bias`; llama.cpp's stacked expert tensors
(`ffn_gate_exps`, [experts, rows, cols]) name every expert's checkpoint tensor (`experts.*.`
stands for the expert number): writing stacks them (gguf_write._stacked_plan), reading slices
them back per expert (expert_hf_name, gguf._expert_slices)."""

from __future__ import annotations

import re

from twice.core.family import GgufNames

# Layer and expert numbers as written: ASCII digits without leading zeros (int() would also read
# "01" or "١" as 1, and a second tensor so named would take the first one's place).
_NUMBER = "(?:0|[1-9][0-9]*)"
_EXPERT_NUMBER = re.compile(rf"\.experts\.{_NUMBER}\.", re.ASCII)
_GGUF_LAYER = re.compile(rf"blk\.({_NUMBER})\.(\w+)\.(weight|bias)", re.ASCII)
_INDEX = re.compile(_NUMBER, re.ASCII)


def _names(model_type: str) -> GgufNames:
    from twice.core.models import GGUF_FORMS

    return GGUF_FORMS[model_type].names


def hf_name(gguf_name: str, layers: int, model_type: str) -> str | None:
    """The checkpoint name of a GGUF tensor (None: not a weight of this model type)."""
    t = _names(model_type)
    if gguf_name in t.whole:
        return t.whole[gguf_name]
    match = _GGUF_LAYER.fullmatch(gguf_name)
    if match and int(match[1]) < layers and match[2] in t.layer and "*" not in t.layer[match[2]]:
        return f"{t.prefix}.{int(match[1])}.{t.layer[match[2]]}.{match[3]}"
    return None


def expert_hf_name(gguf_name: str, layers: int, model_type: str) -> str | None:
    """The per-expert checkpoint name, `*` for the expert number, of a stacked expert tensor
    (`blk.N.ffn_gate_exps.weight` → `model.layers.N.block_sparse_moe.experts.*.w1.weight`);
    None for every other tensor."""
    t = _names(model_type)
    match = _GGUF_LAYER.fullmatch(gguf_name)
    if match and int(match[1]) < layers and "*" in t.layer.get(match[2], ""):
        return f"{t.prefix}.{int(match[1])}.{t.layer[match[2]]}.{match[3]}"
    return None


def gguf_name(hf: str, model_type: str, layers: int) -> str | None:
    """The GGUF name of a checkpoint tensor (GPT-2's with or without `transformer.`)."""
    t = _names(model_type)
    if t.optional_root and not hf.startswith(t.optional_root) and not hf.startswith("lm_head."):
        hf = t.optional_root + hf
    for g, h in t.whole.items():
        if h == hf:
            return g
    if not hf.startswith(t.prefix + "."):
        return None
    rest = hf[len(t.prefix) + 1:]
    index, _, leaf = rest.partition(".")
    stem, _, kind = _EXPERT_NUMBER.sub(".experts.*.", "." + leaf)[1:].rpartition(".")
    if not _INDEX.fullmatch(index) or int(index) >= layers or kind not in ("weight", "bias"):
        return None
    for g, h in t.layer.items():
        if h == stem:
            return f"blk.{int(index)}.{g}.{kind}"
    return None


def reads_as(hf: str, model_type: str, layers: int) -> bool:
    """Whether reading a GGUF gives a tensor exactly this checkpoint name (GPT-2's names with
    `transformer.`, the per-expert names; not their other spellings)."""
    g = gguf_name(hf, model_type, layers)
    if g is None:
        return False
    back = hf_name(g, layers, model_type) or expert_hf_name(g, layers, model_type) or ""
    return back == hf or back == _EXPERT_NUMBER.sub(".experts.*.", hf)
