"""Tensor parallelism on CPU with gloo and 2 processes: the same logits and greedy tokens
as one process, each rank holding 1/N of the layers' weights and of the KV cache."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from twice.core.engine import Engine, GenerationSettings, Request
from twice.weights.load import load

WORKER = r"""
import json, os, sys, torch
import torch.distributed as dist
from twice.core.parallel import init_from_env
from twice.core.engine import Engine, GenerationSettings, Request
from twice.weights.load import load

launch = init_from_env("cpu")
shard = launch.tensor_parallel(2)
m = load(sys.argv[1], device="cpu", dtype="float32", shard=shard)
ids = json.loads(sys.argv[2])
from twice.core.cache import KVCache
cache = KVCache(m.config, 1, 64, torch.float32, "cpu", kv_heads=m.model.kv_heads)
with torch.inference_mode():
    logits = m.model(torch.tensor([ids]), cache, all_logits=True)
engine = Engine(m.model, m.tokenizer, m.eos_token_ids)
result = list(engine.generate(Request(ids=ids), GenerationSettings(max_new_tokens=16, ignore_eos=True)))[-1].result
layer_bytes = sum(p.nbytes for n, p in m.model.named_parameters() if n.startswith("layers.") and "norm" not in n)
out = {"rank": shard.rank, "logits": logits[0].tolist(), "tokens": result.token_ids, "layer_bytes": layer_bytes,
       "cache_bytes_per_token": result.cache.bytes_per_token}
open(sys.argv[3] + f".{shard.rank}", "w").write(json.dumps(out))
dist.barrier()
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(folder: Path, ids: list[int], out: Path, script: str = WORKER) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", script, str(folder), json.dumps(ids), str(out)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=180)
        errs.append((p.returncode, err.decode()[-2000:]))
    for code, err in errs:
        assert code == 0, err
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tp2_equals_tp1(model_dirs, tmp_path, family):
    folder = model_dirs(family)
    ids = list(range(5, 25))
    whole = load(str(folder), device="cpu", dtype="float32")
    from twice.core.cache import KVCache

    with torch.inference_mode():
        cache = KVCache(whole.config, 1, 64, torch.float32, "cpu")
        expected = whole.model(torch.tensor([ids]), cache, all_logits=True)[0]
    engine = Engine(whole.model, whole.tokenizer, whole.eos_token_ids)
    tokens = list(engine.generate(Request(ids=ids), GenerationSettings(max_new_tokens=16, ignore_eos=True)))[-1]
    ranks = run_two_ranks(folder, ids, tmp_path / "out")
    whole_layer_bytes = sum(p.nbytes for n, p in whole.model.named_parameters()
                            if n.startswith("layers.") and "norm" not in n)
    for r in ranks:
        assert (torch.tensor(r["logits"]) - expected).abs().max() < 1e-4
        assert r["tokens"] == tokens.result.token_ids
        assert r["layer_bytes"] * 2 == whole_layer_bytes  # the layers' weights are split in half
        assert r["cache_bytes_per_token"] * 2 == tokens.result.cache.bytes_per_token


def test_tp_refuses_kv_heads_not_divisible(model_dirs, tmp_path):
    """qwen2's tiny model has one KV head: it cannot be split over 2 ranks."""
    script = WORKER.split("m = load(")[0] + (
        "from twice.core.errors import TwiceError\n"
        "try:\n"
        "    load(sys.argv[1], device='cpu', shard=shard)\n"
        "    msg = 'loaded'\n"
        "except TwiceError as e:\n"
        "    msg = str(e)\n"
        "open(sys.argv[3] + f'.{shard.rank}', 'w').write(json.dumps({'msg': msg}))\n"
        "dist.barrier(); dist.destroy_process_group()\n"
    )
    ranks = run_two_ranks(model_dirs("qwen2"), [1, 2], tmp_path / "out", script=script)
    for r in ranks:
        assert r["msg"] == ("num_key_value_heads (1) is not divisible by the tensor-parallel degree 2; "
                            "use a --tp that divides it")
