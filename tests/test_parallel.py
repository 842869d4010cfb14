"""Tensor parallelism on CPU with gloo and 2 processes: the same logits and greedy tokens
as one process, each rank holding 1/N of the layers' weights and of the KV cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from twice.core.engine import Engine, GenerationSettings, Request
from twice.weights.load import load

# torchrun launches several processes a test: outside the default run, in CI (README: -m '').
pytestmark = pytest.mark.slow

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
params = {n: p.nbytes for n, p in m.model.named_parameters()}
out = {"rank": shard.rank, "logits": logits[0].tolist(), "tokens": result.token_ids, "params": params,
       "cache_bytes_per_token": result.cache.bytes_per_token}
open(sys.argv[3] + f".{shard.rank}", "w").write(json.dumps(out))
dist.barrier()
dist.destroy_process_group()
"""


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def torchrun(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Launch 2 ranks the way users do: torchrun picks a free port (--standalone) and stops
    every rank when one fails, so a failure never leaves a rank waiting for its peer."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(TORCHRUN + args, env=env, capture_output=True, text=True, timeout=timeout)


def split_bytes(params: dict[str, int]) -> int:
    """Bytes of the layers' parameters that tensor parallelism splits: all but those every rank
    holds whole (norms, a mixture's router and its shared expert's gate, the biases added after
    an all-reduce)."""
    whole = ("norm", "ln_", "mlp.gate.", "shared_expert_gate", "o_proj.bias", "c_proj.bias", "down_proj.bias")
    return sum(b for n, b in params.items() if n.startswith(("layers.", "h.")) and not any(k in n for k in whole))


def run_two_ranks(folder: Path, ids: list[int], out: Path, script: str = WORKER) -> list[dict]:
    worker = out.parent / "worker.py"
    worker.write_text(script)
    r = torchrun([str(worker), str(folder), json.dumps(ids), str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


# a mixture (each expert's rows split, the router and shared-expert gate replicated), gemma2
# (sandwich norms, soft-capping), olmo2 (q/k norms over the whole projection: their squares
# all-reduced), phi3 (fused checkpoint tensors: three slices of qkv_proj per rank) and gpt2
# (the same of Conv1D's [in, out] c_attn: three column slices, and biases)
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2_moe", "gemma2", "olmo2", "phi3", "gpt2"])
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
    whole_layer_bytes = split_bytes({n: p.nbytes for n, p in whole.model.named_parameters()})
    for r in ranks:
        assert (torch.tensor(r["logits"]) - expected).abs().max() < 1e-4
        assert r["tokens"] == tokens.result.token_ids
        assert split_bytes(r["params"]) * 2 == whole_layer_bytes  # the layers' weights are split in half
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


def run_cli_ranks(args: list[str]) -> subprocess.CompletedProcess:
    """`twice ARGS` on 2 ranks under torchrun (stdout and stderr of both ranks together)."""
    # The console script beside this interpreter: CI calls .venv/bin/python without activating the venv.
    twice = str(Path(sys.executable).parent / "twice")
    return torchrun(["--no-python", twice, *args])


def _records(path: Path) -> list[dict]:
    keep = ("id", "completion", "finish_reason", "prompt_tokens", "generated_tokens")
    return [{k: json.loads(line)[k] for k in keep} for line in path.read_text().splitlines()]


def test_generate_with_tp2_prints_once_and_equals_tp1(model_dirs, capsys):
    from clirun import run_inprocess

    folder = str(model_dirs("llama"))
    args = ["generate", "The cache", "-m", folder, "-n", "12", "--raw", "--temperature", "0", "--json"]
    single = run_inprocess(args, capsys)
    assert single.code == 0, single.err
    r = run_cli_ranks(args + ["--tp", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = r.stdout.splitlines()  # only rank 0 prints
    assert json.loads(line)["token_ids"] == json.loads(single.out)["token_ids"]


def test_data_parallel_batch_equals_one_rank(model_dirs, tmp_path):
    folder = str(model_dirs("llama"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "word " * (i % 5 + 1) + str(i)}) + "\n"
                               for i in range(9)))
    one = tmp_path / "one.jsonl"
    two = tmp_path / "two.jsonl"
    common = ["batch", str(prompts), "-m", folder, "-n", "6", "--raw", "--temperature", "0", "--batch-size", "2"]
    r = subprocess.run([sys.executable, "-c", "from twice.cli.app import main; main()", *common, "-o", str(one)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    r = run_cli_ranks(common + ["-o", str(two)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "merged the parts of 2 ranks" in r.stderr
    assert sorted(_records(one), key=lambda d: d["id"]) == sorted(_records(two), key=lambda d: d["id"])
    assert [d["id"] for d in _records(two)] == [f"p{i}" for i in range(9)]  # merged in input order
    assert not list(tmp_path.glob("two.jsonl.part-*"))  # parts removed after the merge


def test_data_parallel_resume_after_a_lost_rank(model_dirs, tmp_path):
    """A part left by a killed run (with a torn last line) and a missing part: --resume
    finishes the job and every id appears exactly once."""
    folder = str(model_dirs("llama"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"prompt number {i}"}) + "\n" for i in range(6)))
    out = tmp_path / "out.jsonl"
    common = ["batch", str(prompts), "-m", folder, "-n", "4", "--raw", "-o", str(out)]
    # Rank 1 died after its first line (its second torn) and the merge never happened; rank
    # 0's part is missing.
    first = json.dumps({"id": 1, "completion": "kept as it was", "finish_reason": "length"})
    (tmp_path / "out.jsonl.part-1-of-2").write_text(first + "\n" + '{"id": 3, "compl')
    r = run_cli_ranks(common)
    assert r.returncode != 0 and "already exists; pass --resume" in r.stderr
    r = run_cli_ranks(common + ["--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == list(range(6))
    assert records[1]["completion"] == "kept as it was"


def test_tensor_parallel_batch_equals_one_rank(model_dirs, tmp_path):
    folder = str(model_dirs("qwen3"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\nthe second one is longer than the first\nthird\n")
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    common = ["batch", str(prompts), "-m", folder, "-n", "8", "--raw", "--temperature", "0"]
    r = subprocess.run([sys.executable, "-c", "from twice.cli.app import main; main()", *common, "-o", str(one)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    r = run_cli_ranks(common + ["-o", str(two), "--tp", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(_records(one), key=lambda d: d["id"]) == sorted(_records(two), key=lambda d: d["id"])


def test_tp_flag_without_torchrun_is_a_clear_error(model_dirs, capsys):
    from clirun import run_inprocess

    r = run_inprocess(["generate", "hi", "-m", str(model_dirs("llama")), "--tp", "2"], capsys)
    assert r.code == 2 and "launch with torchrun --nproc-per-node 2" in r.err


def test_tp2_of_block_stored_weights_equals_tp1(tokenizer, tmp_path, capsys):
    """A GGUF run as stored splits over ranks by whole blocks: rows of q/k/v and gate/up,
    columns of o_proj and down_proj at block boundaries (each rank quantizes its half of the
    activations in the same blocks as one rank would)."""
    from clirun import run_inprocess
    from test_gguf_stored import _wide_model

    folder = _wide_model(tmp_path / "wide", "llama", tokenizer)
    path = tmp_path / "wide-q8_0.gguf"
    assert run_inprocess(["quantize", str(folder), str(path), "--type", "q8_0"], capsys).code == 0
    ids = list(range(5, 25))
    whole = load(str(path), device="cpu", dtype="float32")
    from twice.core.cache import KVCache

    with torch.inference_mode():
        expected = whole.model(torch.tensor([ids]), KVCache(whole.config, 1, 64, torch.float32, "cpu"),
                               all_logits=True)[0]
    for r in run_two_ranks(path, ids, tmp_path / "out"):
        assert (torch.tensor(r["logits"]) - expected).abs().max() < 1e-3 * expected.abs().max()

