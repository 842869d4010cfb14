"""Side-by-side measurements: twice (eager and compiled) against transformers and against
a cache-less loop, on the same weights, dtype, device and threads, in one process.

Nothing here prints: each runner returns a `Run` with its numbers, and the caller
(`twice bench`, scripts/bench.py) renders them. Medians of repeats after a warm-up;
peak memory is what the run added on top of the weights already resident (both models
are loaded in the same process, so absolute RSS would count each one's weights twice).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from .cache import KVCache
from .config import ModelConfig, config_from_dict
from .device import DTYPE_NAMES, synchronize
from .engine import Done, Engine, GenerationSettings, Request
from .hugepages import release_freed_memory
from .model import CausalLM
from .qweight import BlockEmbedding, BlockLinear
from .models import build_model, family
from .native_decode import supported as native_supported

# Random-weight stand-ins with the exact shapes of real checkpoints (no download needed).
SHAPES: dict[str, dict] = {
    "tiny": dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 tie_word_embeddings=True),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    "smollm2-360m": dict(model_type="llama", vocab_size=49152, hidden_size=960, intermediate_size=2560,
                         num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Issue 15's families (scripts/bench_families.py): the real config.json's fields; where
    # ours plus transformers' twin in float32 would not fit a small machine (or a run would
    # take too long), fewer layers / experts, as each comment says. Vocabulary, widths, heads,
    # windows, caps and RoPE stay the real model's, so a step's head and per-layer costs are real.
    # google/gemma-3-270m: all 18 layers (5 sliding : 1 global), tied 262144-row head.
    "gemma-3-270m": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                         num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                         hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=512,
                         layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
                         rope_theta=1000000.0, rope_local_base_freq=10000.0, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, attn_logit_softcapping=None,
                         final_logit_softcapping=None, tie_word_embeddings=True),
    # google/gemma-2-2b: 4 of its 26 layers (alternating sliding 4096 / global), tied 256000-row head.
    "gemma-2-2b-4l": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                          hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
                          attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=10000.0,
                          rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True),
    # microsoft/Phi-3-mini-4k-instruct: 4 of its 32 layers (no GQA: 32 kv heads; window 2047).
    "phi-3-mini-4l": dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                          num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=32,
                          sliding_window=2047, rope_theta=10000.0, rms_norm_eps=1e-5,
                          max_position_embeddings=4096, original_max_position_embeddings=4096,
                          tie_word_embeddings=False),
    # allenai/OLMo-2-0425-1B: 4 of its 16 layers, untied 100352-row head.
    "olmo-2-1b-4l": dict(model_type="olmo2", vocab_size=100352, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, rope_theta=500000.0,
                         rms_norm_eps=1e-6, max_position_embeddings=4096, attention_bias=False,
                         tie_word_embeddings=False),
    # Qwen/Qwen3-30B-A3B: 4 of its 48 layers, 16 of its 128 experts (still 8 chosen per token).
    "qwen3-30b-a3b-4l16e": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                moe_intermediate_size=768, num_hidden_layers=4, num_attention_heads=32,
                                num_key_value_heads=4, head_dim=128, num_experts=16, num_experts_per_tok=8,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
                                use_sliding_window=False, attention_bias=False, tie_word_embeddings=False),
    # mistralai/Mixtral-8x7B-v0.1: 1 of its 32 layers, 4 of its 8 experts (2 chosen per token): one
    # layer's experts alone are 1.4 G parameters.
    "mixtral-8x7b-1l4e": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                              num_local_experts=4, num_experts_per_tok=2, rope_theta=1000000.0, rms_norm_eps=1e-5,
                              max_position_embeddings=32768, sliding_window=None, tie_word_embeddings=False),
}


def dense_equivalent(shape: dict) -> dict:
    """A dense (llama-family) shape whose one token reads as many parameters as the mixture
    of experts `shape` does: the same attention, head and layers, one gated MLP as wide as
    its chosen experts together (top_k · expert width), widened by the router's parameters
    (hidden · experts per layer = 3 · hidden · experts / 3). Qwen3-MoE's twin is qwen3 (its
    attention has q/k norms), Mixtral's llama. Compare Family.active_parameter_count with
    parameter_count of the result (scripts/bench_families.py reports both)."""
    d = dict(shape)
    moe_type = d.pop("model_type")
    experts = d.pop("num_local_experts", None) or d.pop("num_experts")
    top_k = d.pop("num_experts_per_tok")
    width = d.pop("moe_intermediate_size", None) or d["intermediate_size"]
    for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "use_sliding_window", "attention_bias",
                "sliding_window", "num_experts", "num_local_experts", "router_aux_loss_coef"):
        d.pop(key, None)
    d["model_type"] = "qwen3" if moe_type == "qwen3_moe" else "llama"
    d["intermediate_size"] = top_k * width + round(experts / 3)
    return d


@dataclass
class Run:
    engine: str  # one of ENGINES
    prompt_tokens: int
    new_tokens: int
    batch: int
    ttft_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float  # aggregate over the batch
    step_p50_s: float
    step_p99_s: float
    peak_memory_bytes: int  # added during the run, on top of the resident weights
    weight_bytes: int
    kv_bytes_per_token: int
    compile_s: float = 0.0
    steps_s: list[float] = field(default_factory=list)  # per decode step (median run)
    repeats: int = 1
    macs_per_token: int = 0  # the model's matrices, once per generated token (model_macs)
    attention_macs_per_position: int = 0  # q·k and p·v, per token per cached position

    @property
    def mean_position(self) -> float:
        """The cache length halfway through decode: where per-step costs are averaged."""
        return self.prompt_tokens + self.new_tokens / 2

    def bytes_read_per_step(self) -> int:
        """Weights once plus the KV cache read at the mean position, per step (one batch)."""
        return self.weight_bytes + self.batch * int(self.kv_bytes_per_token * self.mean_position)

    def macs_per_step(self) -> int:
        """Multiply-adds of one step for the whole batch, attention at the mean position."""
        return self.batch * int(self.macs_per_token + self.attention_macs_per_position * self.mean_position)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["bytes_read_per_step"] = self.bytes_read_per_step()
        d["macs_per_step"] = self.macs_per_step()
        return d


# -- models ----------------------------------------------------------------------------
def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        from .errors import PromptError

        raise PromptError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return config_from_dict(dict(SHAPES[name]), source=f"shape {name}")


def random_model(config: ModelConfig, device, dtype, seed: int = 0) -> CausalLM:
    model = build_model(config, torch.device(device), dtype)
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".ln_" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def hf_twin(model: CausalLM, share: bool = False):
    """A transformers model with the same config and the same weights (in memory).

    share: the twin's parameters are views of ours wherever the layouts agree (every row
    block of a fused matrix, stacked experts; not a transposed one, which is copied), and
    transformers' own initialisation is skipped, so a large shape costs its weights once,
    not twice. Both models then read the very same memory; neither may change its weights."""
    import transformers

    c = model.config
    # The shared fields under their Hugging Face names, the family's own from the config's
    # other keys (soft-caps, experts, ...: kept in `extra` as the config.json had them).
    kwargs = dict(c.extra)
    kwargs.update(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                  num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                  rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings, head_dim=c.head_dim,
                  hidden_act=c.hidden_act)
    if c.rope_parameters is not None:
        kwargs["rope_parameters"] = dict(c.rope_parameters)
    if c.sliding_window is not None:
        kwargs.update(sliding_window=c.sliding_window, layer_types=list(c.layer_types) or None)
    kwargs.update(getattr(model, "hf_config_kwargs", dict)())  # what only the family knows how to say
    name = family(c.model_type).hf_config.get(c.model_type)
    if name is None or c.model_type == "gpt2":
        raise ValueError(f"no transformers twin for {c.model_type}")
    hf_config = getattr(transformers, name)(**kwargs)
    first = next(model.parameters())
    if share:
        from transformers.initialization import no_init_weights

        with no_init_weights():  # every parameter is replaced below: untouched pages cost no memory
            hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=first.dtype)
        hf.tie_weights()
    else:
        hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=first.dtype)
    hf = hf.to(first.device)
    hf.eval().requires_grad_(False)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, m in model.named_modules():  # block-stored weights: the twin gets them dequantized
        if isinstance(m, (BlockLinear, BlockEmbedding)):
            params[f"{name}.weight"] = m.weight.dequantize(first.dtype)
    assigned: set[int] = set()
    with torch.no_grad():
        for name, places in model.placements().items():
            (target,) = places  # one process: each checkpoint tensor fills one place
            try:
                dest = hf.get_parameter(name)
            except AttributeError:  # e.g. lm_head.weight of a tied model
                continue
            src = params[target.param]
            if target.rows is not None:
                src = src[target.row : target.row + target.rows]
            if target.stored_shape is not None:  # stacked experts, grouped by expert there
                src = src.reshape(target.stored_shape)
            if (share and not target.transpose and src.is_contiguous() and src.dtype == dest.dtype
                    and src.shape == dest.shape):
                dest.data = src.detach()
                assigned.add(id(dest))
            else:
                dest.copy_(src.t() if target.transpose else src)
                assigned.add(id(dest))
    if share:
        missed = [n for n, p in hf.named_parameters() if id(p) not in assigned]
        if missed:  # would hold uninitialised memory: never measure such a twin
            raise ValueError(f"transformers' twin has parameters ours do not give: {', '.join(missed[:3])}")
    return hf


# -- memory ----------------------------------------------------------------------------
class _PeakMemory:
    """Peak memory added during a block: CUDA allocator peak, or the process's RSS
    high-water mark (reset through /proc/self/clear_refs on Linux)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            # CPU models keep freed heap memory (hugepages.keep_freed_memory); handed back
            # first, a run's activations count as added and are touched afresh, as in a new
            # process, instead of reusing what the run before left.
            release_freed_memory()
            _reset_rss_peak()
            self.base = _rss()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _rss_peak()
        self.added = max(0, peak - self.base)


def _rss() -> int:
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _rss_peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return _rss()


def _reset_rss_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def measure_bandwidth(device, megabytes: int = 512, repeats: int = 5) -> dict:
    """Memory bandwidth the device reaches: a read-only pass (sum) and a copy, over a buffer
    far larger than any cache. Decode is read-bound, so `read` is the roofline used."""
    device = torch.device(device)
    n = megabytes * 2**20 // 4
    x = torch.ones(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    reads, copies = [], []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            synchronize(device)
            t = time.perf_counter()
            x.sum()
            synchronize(device)
            reads.append(time.perf_counter() - t)
            t = time.perf_counter()
            y.copy_(x)
            synchronize(device)
            copies.append(time.perf_counter() - t)
    read = x.nbytes / statistics.median(reads[1:])
    copy = 2 * x.nbytes / statistics.median(copies[1:])
    return {"read_bytes_per_s": read, "copy_bytes_per_s": copy, "buffer_bytes": x.nbytes,
            "threads": torch.get_num_threads(), "device": str(device)}


def best_bandwidth(*measurements: dict) -> dict:
    """The highest of several measurements (taken before and after the runs: on a shared
    machine a neighbour can halve what one measurement sees), with all of them kept."""
    best = dict(max(measurements, key=lambda m: m["read_bytes_per_s"]))
    best["copy_bytes_per_s"] = max(m["copy_bytes_per_s"] for m in measurements)
    best["read_measurements"] = [m["read_bytes_per_s"] for m in measurements]
    return best


# -- runners ---------------------------------------------------------------------------
class NullTokenizer:
    """For random-weight shapes: token ids have no text."""

    class _Stream:
        def step(self, token_id):
            return ""

        def finish(self):
            return ""

    def stream(self, context=()):
        return self._Stream()

    def decode(self, ids, skip_special_tokens=True):
        return ""


def prompt_ids(vocab_size: int, batch: int, prompt_tokens: int, seed: int = 1) -> list[list[int]]:
    """The prompts every engine gets (scripts/peer_llamacpp.py too): seeded random ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, prompt_tokens), generator=g).tolist()


def _median_run(runs: list[Run]) -> Run:
    ordered = sorted(runs, key=lambda r: r.decode_tokens_per_s)
    middle = ordered[len(ordered) // 2]
    middle.ttft_s = statistics.median(r.ttft_s for r in runs)
    middle.prefill_tokens_per_s = statistics.median(r.prefill_tokens_per_s for r in runs)
    middle.repeats = len(runs)
    return middle


def _steps_summary(steps: list[float]) -> tuple[float, float]:
    if not steps:
        return 0.0, 0.0
    s = sorted(steps)
    return s[len(s) // 2], s[min(len(s) - 1, int(len(s) * 0.99))]


def run_twice(engine: Engine, prompt_tokens: int, new_tokens: int, batch: int = 1, repeats: int = 3,
              name: str | None = None, warmup: bool = True) -> Run:
    """Median of `repeats` runs, after one untimed run unless `warmup` is False (the caller
    warmed the engine up already: scripts/bench_families.py's alternating rounds)."""
    config = engine.config
    prompts = prompt_ids(config.vocab_size, batch, prompt_tokens)
    settings = GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)
    compile_s = 0.0
    runs = []
    skip = 1 if warmup else 0
    for i in range(repeats + skip):  # the first run warms up (and compiles)
        with _PeakMemory(engine.device) as mem:
            if batch == 1:
                results = [e.result for e in engine.generate(Request(ids=prompts[0]), settings, reuse_cache=False)
                           if isinstance(e, Done)]
            else:
                t0 = time.perf_counter()
                results = [e.result for e in engine.generate_batch([Request(ids=p) for p in prompts],
                                                                   [settings] * batch) if isinstance(e, Done)]
                wall = time.perf_counter() - t0
        r = results[0]
        compile_s += r.compile_seconds
        if i < skip:
            continue
        if batch == 1:
            decode_tps = r.decode_tokens_per_second
        else:  # aggregate: all rows' tokens after the first over the decode span
            first = min(x.ttft_seconds for x in results)
            span = wall - first - r.compile_seconds  # compiling (and recording a GPU graph) is not decoding
            decode_tps = sum(x.generated_tokens - 1 for x in results) / span if span > 0 else 0.0
        p50, p99 = _steps_summary(r.step_seconds)
        runs.append(Run(name or engine_name(engine), prompt_tokens, new_tokens, batch,
                        r.ttft_seconds, r.prefill_tokens_per_second, decode_tps, p50, p99, mem.added,
                        engine.weight_bytes, r.cache.bytes_per_token, steps_s=list(r.step_seconds)))
    run = _median_run(runs)
    run.compile_s = compile_s
    return run


@torch.inference_mode()
def run_naive(model: CausalLM, prompt_tokens: int, new_tokens: int, repeats: int = 1) -> Run:
    """No cache: every new token re-runs the whole sequence (the for-loop-and-argmax baseline)."""
    config = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    seq = torch.tensor(prompt_ids(config.vocab_size, 1, prompt_tokens), device=device)
    runs = []
    for i in range(repeats + 1):
        tokens = seq
        steps = []
        with _PeakMemory(device) as mem:
            t0 = time.perf_counter()
            for _ in range(new_tokens if i else 2):
                t = time.perf_counter()
                cache = KVCache(config, 1, tokens.shape[1], dtype, device)  # scratch space, thrown away
                nxt = model(tokens, cache).argmax(-1, keepdim=True)
                synchronize(device)
                steps.append(time.perf_counter() - t)
                tokens = torch.cat([tokens, nxt], dim=1)
            total = time.perf_counter() - t0
        if i == 0:
            continue
        p50, p99 = _steps_summary(steps[1:])
        runs.append(Run("naive", prompt_tokens, new_tokens, 1, steps[0], prompt_tokens / steps[0],
                        (new_tokens - 1) / (total - steps[0]), p50, p99, mem.added, model.weight_bytes(),
                        0, steps_s=steps[1:]))
    return _median_run(runs)


@torch.inference_mode()
def run_transformers(hf, prompt_tokens: int, new_tokens: int, batch: int = 1, repeats: int = 3,
                     static_cache: bool = False, compile: bool = False, warmup: bool = True) -> Run:
    """`generate(do_sample=False)` with per-token times taken by a logits processor; median of
    `repeats` runs after an untimed one unless `warmup` is False."""
    from transformers import LogitsProcessor, LogitsProcessorList

    device = next(hf.parameters()).device
    config = hf.config
    ids = torch.tensor(prompt_ids(config.vocab_size, batch, prompt_tokens), device=device)
    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            synchronize(device)
            stamps.append(time.perf_counter())
            return scores

    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                  pad_token_id=0, attention_mask=torch.ones_like(ids), logits_processor=LogitsProcessorList([Stamp()]))
    if static_cache:
        kwargs["cache_implementation"] = "static"
    compile_s = 0.0
    if compile:
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead" if device.type == "cuda" else None)
    runs = []
    skip = 1 if warmup else 0
    for i in range(repeats + skip):
        stamps.clear()
        with _PeakMemory(device) as mem:
            t0 = time.perf_counter()
            hf.generate(ids, **kwargs)
            synchronize(device)
        if i < skip:
            compile_s = time.perf_counter() - t0 if compile else 0.0
            continue
        first, last = stamps[0], stamps[-1]
        steps = [b - a for a, b in zip(stamps, stamps[1:])]
        p50, p99 = _steps_summary(steps)
        decode = batch * (len(stamps) - 1) / (last - first) if last > first else 0.0
        weight_bytes = sum(p.nbytes for p in {p.data_ptr(): p for p in hf.parameters()}.values())
        kv = 2 * config.num_hidden_layers * config.num_key_value_heads * _head_dim(config) * \
            next(hf.parameters()).element_size()
        name = "transformers" + ("-static" if static_cache else "") + ("-compiled" if compile else "")
        runs.append(Run(name, prompt_tokens, new_tokens, batch, first - t0, batch * prompt_tokens / (first - t0),
                        decode, p50, p99, mem.added, weight_bytes, kv, steps_s=steps))
    run = _median_run(runs)
    run.compile_s = compile_s
    return run


def _head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def model_macs(model: CausalLM) -> tuple[int, int]:
    """Multiply-adds per generated token: every matrix of the layers and the head once
    (embedding rows are looked up, not multiplied); and per cached position attended, q·k
    and p·v for every query head of every layer."""
    head, head_module = model.lm_head_weight, getattr(model, "lm_head", None)
    matrices = sum(m.weight.shape.numel() for m in model.modules()
                   if isinstance(m, (torch.nn.Linear, BlockLinear)) and m is not head_module)
    c = model.config
    return matrices + head.shape.numel(), 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim


def measure_compute_peak(model: CausalLM) -> dict | None:
    """The CPU's multiply-add peak in the model's dtype on torch's threads (kernels/peak.c),
    the roofline of batched decode as bandwidth is batch 1's; None on a GPU or where the
    kernels have no such instructions."""
    from . import kernels

    first = next(model.parameters())
    if first.device.type != "cpu":
        return None
    threads = torch.get_num_threads()
    # Block-stored weights multiply int8 activations with integer dot products: their peak.
    dtype = torch.int8 if any(isinstance(m, BlockLinear) for m in model.modules()) else first.dtype
    peak = kernels.peak_macs(dtype, threads)
    if peak is None:
        return None
    return {"macs_per_s": peak, "dtype": "int8" if dtype is torch.int8 else DTYPE_NAMES.get(dtype, str(dtype)),
            "threads": threads,
            "device": "cpu"}


def describe_setup(model: CausalLM) -> dict:
    first = next(model.parameters())
    return {"device": str(first.device), "dtype": DTYPE_NAMES.get(first.dtype, str(first.dtype)),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "weight_bytes": model.weight_bytes(), "parameters": model.config.parameter_count(),
            "model_type": model.config.model_type}


# -- the suite -------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    name: str
    prompt_tokens: int
    new_tokens: int
    batch: int = 1


WORKLOADS = {
    "decode": Workload("decode", 32, 256),  # short prompt, long answer: decode-bound
    "prefill": Workload("prefill", 2048, 16),  # long prompt, short answer: prefill-bound
    "naive": Workload("naive", 1000, 100),  # cached vs recomputing everything
    "batch1": Workload("batch1", 32, 64, 1),
    "batch4": Workload("batch4", 32, 64, 4),
    "batch16": Workload("batch16", 32, 64, 16),
    "batch32": Workload("batch32", 32, 64, 32),
}
# twice: the eager PyTorch layers; twice-native: the one-call C decode step (CPU, llama
# family: what `twice generate` uses there); twice-compiled: the torch.compile'd step.
ENGINES = ("naive", "transformers", "transformers-static", "twice", "twice-native", "twice-compiled")
BATCH1_ONLY = ("twice-compiled",)  # on the CPU


def engine_name(engine: Engine) -> str:
    return {"native": "twice-native", "compiled": "twice-compiled"}.get(engine.decode_path, "twice")


def _on_cpu(model: CausalLM) -> bool:
    return next(model.parameters()).device.type == "cpu"


def default_engines(workload: Workload, model: CausalLM | None = None) -> tuple[str, ...]:
    if workload.name == "naive":
        return ("naive", "twice", "transformers")
    native = ("twice-native",) if model is not None and native_supported(model) else ()
    if workload.batch > 1:
        compiled = ("twice-compiled",) if model is not None and not _on_cpu(model) else ()
        return ("twice", *native, *compiled, "transformers")
    return ("twice", *native, "twice-compiled", "transformers")


def scaled(workload: Workload, factor: float) -> Workload:
    """A smaller copy (for quick runs): lengths divided by `factor`, at least 4 tokens."""
    return Workload(workload.name, max(4, int(workload.prompt_tokens / factor)),
                    max(4, int(workload.new_tokens / factor)), workload.batch)


def run_suite(model: CausalLM, tokenizer, workloads: list[Workload], engines: list[str] | None = None,
              repeats: int = 3, progress=None, kv_dtype: str | None = None) -> list[tuple[Workload, Run]]:
    """Every (workload, engine) pair; engines that cannot run here (transformers not
    installed, no twin for this family) are skipped with a progress note. `kv_dtype`: the
    twice engines' KV cache type (--kv-dtype; benchmark_kv.py sweeps them)."""
    say = progress or (lambda message: None)
    engines_by_name: dict[str, Engine] = {}

    def twice_engine(name: str) -> Engine:
        if name not in engines_by_name:
            engines_by_name[name] = Engine(model, tokenizer, compile=name == "twice-compiled",
                                           native=name == "twice-native", kv_dtype=kv_dtype)
        return engines_by_name[name]

    hf = None
    macs = model_macs(model)  # the same for every engine: they run the same weights
    results: list[tuple[Workload, Run]] = []
    for w in workloads:
        for name in engines or default_engines(w, model):
            if w.prompt_tokens + w.new_tokens > model.config.max_position_embeddings:
                say(f"skip {w.name}/{name}: longer than the context")
                continue
            if name in BATCH1_ONLY and w.batch > 1 and _on_cpu(model):
                # the compiled step serves batch 1 on the CPU (any batch on a GPU)
                say(f"skip {w.name}/{name}: the compiled step serves batch 1 on the CPU")
                continue
            say(f"{w.name}: {name} (P={w.prompt_tokens}, G={w.new_tokens}, batch {w.batch})")
            if name == "naive":
                run = run_naive(model, w.prompt_tokens, w.new_tokens, repeats=1)
            elif name.startswith("twice"):
                engine = twice_engine(name)
                if engine_name(engine) != name:  # that decode step does not apply to this model here
                    say(f"skip {name}: not available for this model or machine")
                    continue
                run = run_twice(engine, w.prompt_tokens, w.new_tokens, w.batch, repeats)
            else:
                if hf is None:
                    try:
                        hf = hf_twin(model)
                    except (ImportError, ValueError) as e:
                        say(f"skip transformers: {e}")
                        hf = False
                if not hf:
                    continue
                run = run_transformers(hf, w.prompt_tokens, w.new_tokens, w.batch, repeats,
                                       static_cache=name == "transformers-static")
            run.macs_per_token, run.attention_macs_per_position = macs
            results.append((w, run))
    return results
