"""Loading a GGUF file's tensors as stored: no float copy on disk or in memory.

A GGUF runs from the folder resolve.py describes it in (config, tokenizer, and gguf.json
naming the file). Here its tensor table is matched to the model's parameters by the same
plan the float conversion uses (gguf.py: names, shapes, llama's q/k row order), and:

* every matrix (a linear layer's or the embedding's weight) is stored as the file stores
  it: its block bytes are read straight into the model's block buffers (twice.core.qweight),
  row groups of a fused q/k/v or gate/up keeping each their own type; the rows llama.cpp
  permuted for its RoPE are put back in Hugging Face's order (whole rows: a block never
  spans two rows); GPT-2's Conv1D matrices, which its checkpoints hold [in, out] (their
  targets say `transpose`), are already [out, in] in the file (llama.cpp transposed them):
  exactly the layout the linear layers hold, so they are read as they are;
* vectors (norms, biases) and float matrices already in the model's dtype are read into
  ordinary parameters.

The file is read with pread into the buffers, never memory-mapped whole: resident memory
is the model's own tensors, about the file's tensor bytes.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from twice.core.errors import ModelNotFoundError, TwiceError, UnsupportedModelError, WeightsError
from twice.core.model import CausalLM
from twice.core.quant import BY_GGML_TYPE, all_finite

from .files import open_regular, read_json
from .gguf import GGUF_SOURCE, _find_tensor, _load_weight, _model_config, _open_reader, _plan_tensors, _reading, \
    _TensorJob, _unpermute_rows

_FLOAT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}  # dtype → ggml type id


@contextmanager
def named_as_the_gguf(folder: Path, gguf: Path | None):
    """Errors about a described folder's files (config.json, tokenizer files: what twice
    wrote in its cache from a GGUF's metadata) name the GGUF file the user gave instead."""
    if gguf is None:
        yield
        return
    try:
        yield
    except TwiceError as e:
        e.args = (user_facing(str(e), folder, gguf), *e.args[1:])
        raise


def user_facing(message: str, folder: Path, gguf: Path) -> str:
    """`message` with the cache folder's files replaced by the GGUF's parts they came from."""
    for name, part in (("config.json", "metadata"), ("generation_config.json", "metadata"),
                       ("tokenizer_config.json", "tokenizer metadata"), ("tokenizer.json", "tokenizer")):
        message = message.replace(str(folder / name), f"{gguf} ({part})")
    return message.replace(str(folder), str(gguf))


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a described folder runs from (None for an ordinary model folder)."""
    marker = folder / GGUF_SOURCE
    if not marker.exists():
        return None
    entry = read_json(marker, WeightsError)
    file = entry.get("file") if isinstance(entry, dict) else None
    if not isinstance(file, str):
        raise WeightsError(f"{marker}: has no \"file\" naming the GGUF it describes")
    path = Path(file)
    try:
        st = path.stat()
    except OSError:
        raise ModelNotFoundError(f"{marker}: the GGUF it describes, {path}, is gone") from None
    if st.st_size != entry.get("size") or st.st_mtime_ns != entry.get("mtime_ns"):
        raise ModelNotFoundError(f"{marker}: {path} changed since it was read; give the .gguf file itself again")
    return path


class StoredTensors:
    """A GGUF file's tensors matched to a model of its config (planned once, read by `fill`)."""

    def __init__(self, src: Path):
        self.src = src
        reader = _open_reader(src, big_arrays=False)  # the tokenizer was read into the header folder
        with _reading(src):
            config = _model_config(reader.metadata, src, _find_tensor(reader, "rope_freqs.weight"),
                                   lambda name: _find_tensor(reader, name))
            self.jobs: dict[str, _TensorJob] = {j.name: j for j in _plan_tensors(reader, config, src,
                                                                                  dequantized=False)}
        # Only the tensor table is kept: the metadata (a vocabulary of 150k strings and as many
        # merges: tens of MB) was the tokenizer's, which the header folder already holds.

    def tensor_bytes(self) -> int:
        return sum(j.tensor.n_bytes for j in self.jobs.values())

    def layouts(self, model: CausalLM, dtype: torch.dtype) -> dict[str, list[tuple[str, int]]]:
        """Which weights of `model` (built on the meta device) are stored as blocks, and in
        which row groups: every matrix whose file type is not already the model's dtype.
        A target marked `transpose` (GPT-2's Conv1D) is one too: a GGUF matrix is always
        stored [out, in], as the layer holds it."""
        targets = model.placements()
        params = dict(model.named_parameters(remove_duplicate=False))
        parts: dict[str, list[tuple[int, str, int]]] = {}
        for name, job in self.jobs.items():
            if len(job.shape) != 2:
                continue
            for target in targets[name]:
                rows = target.rows if target.rows is not None else params[target.param].shape[0]
                parts.setdefault(target.param, []).append((target.row, BY_GGML_TYPE[int(job.tensor.tensor_type)].name,
                                                           rows))
        keep_float = {p for p, ps in parts.items() if all(_FLOAT_TYPES.get(dtype) == _type_id(t) for _, t, _ in ps)}
        layouts = {p: [(t, rows) for _, t, rows in sorted(ps)] for p, ps in parts.items() if p not in keep_float}
        for name, job in self.jobs.items():  # tensor parallelism splits rows, or columns by whole blocks
            for target in targets[name]:
                if target.param in layouts and target.param_dim == 1:
                    c = BY_GGML_TYPE[int(job.tensor.tensor_type)]
                    if target.source.start % c.block_size or target.source.stop % c.block_size:
                        raise UnsupportedModelError(
                            f"{self.src}: tensor {job.tensor.name} ({c.name}, blocks of {c.block_size} values) cannot "
                            f"be split over {model.shard.world} ranks: each rank's "
                            f"{target.source.stop - target.source.start} columns would cut a block; use fewer ranks, "
                            "or --dequantize")
        return layouts

    def fill(self, model: CausalLM) -> None:
        """Read every tensor into `model` (built with `layouts`)."""
        targets = model.placements()
        modules = dict(model.named_modules())
        params = dict(model.named_parameters(remove_duplicate=False))
        with open_regular(self.src, WeightsError) as f, torch.inference_mode():
            fd = f.fileno()
            for name, job in self.jobs.items():
                whole = weight = None  # the whole tensor, read once for the slices of it this rank keeps
                for target in targets[name]:
                    module = modules.get(target.param.removesuffix(".weight"))
                    if hasattr(module, "part_for_row"):  # stored as blocks
                        buffer, first = module.part_for_row(target.row)
                        if target.source is None:
                            rows = job.stored_shape[0]
                            dest = getattr(module, buffer)[target.row - first: target.row - first + rows]
                            self._read_blocks(fd, job, dest)
                            continue
                        # this rank's rows, or its columns as whole blocks, of the whole tensor
                        if whole is None:
                            whole = torch.empty(job.stored_shape[0], job.tensor.n_bytes // job.stored_shape[0],
                                                dtype=torch.uint8)
                            self._read_blocks(fd, job, whole)
                        src = target.source
                        if target.param_dim == 0:
                            piece = whole[src.start: src.stop]
                        else:
                            c = BY_GGML_TYPE[int(job.tensor.tensor_type)]
                            per = c.type_size // c.block_size if c.block_size == 1 else None
                            a, b = ((src.start * per, src.stop * per) if per else
                                    (src.start // c.block_size * c.type_size, src.stop // c.block_size * c.type_size))
                            piece = whole[:, a:b]
                        rows = piece.shape[0]
                        getattr(module, buffer)[target.row - first: target.row - first + rows].copy_(piece)
                        continue
                    param = params[target.param]
                    dest = param if target.rows is None else param[target.row: target.row + target.rows]
                    if dest.dtype in _FLOAT_TYPES and _FLOAT_TYPES[dest.dtype] == int(job.tensor.tensor_type) \
                            and not job.unpermute_heads and len(job.shape) == 2 and target.source is None:
                        self._read_blocks(fd, job, dest.view(torch.uint8).view(dest.shape[0], -1))
                        continue
                    if weight is None:
                        weight = torch.from_numpy(np.array(_load_weight(job, self.src, hf_layout=False),
                                                           dtype=np.float32))
                    src = target.source
                    dest.copy_(weight if src is None else weight.narrow(target.param_dim, src.start, src.stop - src.start))

    def _read_blocks(self, fd: int, job: _TensorJob, dest: torch.Tensor) -> None:
        """The tensor's bytes as stored into `dest` (uint8 [rows, row_bytes]), rows put back
        in Hugging Face's order where llama.cpp permuted them."""
        t = job.tensor
        if dest.numel() != t.n_bytes or not dest.is_contiguous():
            raise WeightsError(f"{self.src}: tensor {t.name} holds {t.n_bytes} bytes, its place {dest.numel()}")
        target = dest if not job.unpermute_heads else torch.empty_like(dest)
        view = memoryview(target.numpy()).cast("B")
        done = 0
        while done < t.n_bytes:
            got = os.preadv(fd, [view[done:]], t.data_offset + done)
            if got <= 0:
                raise WeightsError(f"{self.src}: truncated at tensor {t.name}")
            done += got
        c = BY_GGML_TYPE[int(t.tensor_type)]
        if t.swapped and not c.quantized:  # a big-endian file's float values, to this machine's order
            np.frombuffer(view, dtype=f"u{c.type_size}").byteswap(inplace=True)
        if not all_finite(target, c.name):  # the blocks run as they are: refused as the float copy would be
            raise WeightsError(f"{self.src}: tensor {t.name} ({c.name}) holds NaN or infinite "
                               f"{'block scales' if c.quantized else 'values'}")
        if job.unpermute_heads:
            order = _unpermute_rows(np.arange(dest.shape[0]), job.unpermute_heads)
            dest.copy_(target[torch.from_numpy(np.ascontiguousarray(order))])


def stored_formats(src: Path) -> dict:
    """What a GGUF's tensors are stored as, from its header alone: values and tensors per
    type, the tensor bytes, and the bits per weight over the matrices (`twice info`)."""
    from twice.core.quant import BY_GGML_TYPE as types

    values: dict[str, int] = {}
    tensors: dict[str, int] = {}
    matrix_values = matrix_bytes = total = 0
    for t in _open_reader(src, big_arrays=False).tensors:
        c = types.get(int(t.tensor_type))
        name = c.name if c else getattr(t.tensor_type, "name", str(t.tensor_type))
        values[name] = values.get(name, 0) + t.n_elements
        tensors[name] = tensors.get(name, 0) + 1
        total += t.n_bytes
        if len(t.shape) == 2:
            matrix_values += t.n_elements
            matrix_bytes += t.n_bytes
    return {"types": dict(sorted(values.items(), key=lambda kv: -kv[1])), "tensors": tensors,
            "weight_bytes": total, "bits_per_weight": 8 * matrix_bytes / matrix_values if matrix_values else 0.0}


def _type_id(type_name: str) -> int:
    from twice.core.quant import CODECS

    return CODECS[type_name].ggml_type
