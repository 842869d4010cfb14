"""`twice bench` on a tiny shape: runs in seconds and its JSON has every field."""

import json

import pytest

from clirun import one_error_line, run_inprocess

RUN_FIELDS = {"workload", "engine", "prompt_tokens", "new_tokens", "batch", "ttft_s", "prefill_tokens_per_s",
              "decode_tokens_per_s", "step_p50_s", "step_p99_s", "peak_memory_bytes", "weight_bytes",
              "kv_bytes_per_token", "compile_s", "steps_s", "repeats", "bytes_read_per_step",
              "decode_vs_transformers", "prefill_vs_transformers", "fraction_of_bandwidth", "macs_per_token",
              "attention_macs_per_position", "macs_per_step", "fraction_of_compute_peak"}


def test_bench_tiny_shape_json_has_every_field(tmp_path, capsys):
    out = tmp_path / "bench.json"
    plot = tmp_path / "latency.png"
    args = ["bench", "--shape", "tiny", "--device", "cpu", "--quick", "--repeats", "1", "--json", str(out),
            "-w", "decode", "-w", "naive", "-w", "batch4", "-e", "naive", "-e", "twice", "-e", "twice-native", "-e", "transformers"]
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", str(plot)]
    except ImportError:
        plot = None
    r = run_inprocess(args, capsys)
    assert r.code == 0, r.err
    data = json.loads(out.read_text())
    assert data["setup"]["model"].startswith("tiny") and data["setup"]["threads"] >= 1
    assert data["bandwidth"]["read_bytes_per_s"] > 0 and data["bandwidth"]["copy_bytes_per_s"] > 0
    rows = data["results"]
    engines = {(row["workload"], row["engine"]) for row in rows}
    assert {("decode", "twice"), ("decode", "transformers"), ("naive", "naive"), ("naive", "twice"),
            ("batch4", "twice"), ("batch4", "transformers")} <= engines
    from twice.core import kernels

    if kernels.available():  # the native step runs batch 1 and batches alike
        assert {("decode", "twice-native"), ("batch4", "twice-native")} <= engines
    peak = data["compute_peak"]
    if peak is not None:  # measured where the kernels built with vector multiply-adds
        assert peak["macs_per_s"] > 1e9 and peak["dtype"] == data["setup"]["dtype"] and "MAC peak" in r.out
    for row in rows:
        assert RUN_FIELDS <= set(row), RUN_FIELDS - set(row)
        assert row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0 and row["ttft_s"] > 0
        if row["engine"] != "transformers":
            assert row["decode_vs_transformers"] > 0
        # The tiny shape's matrices: 2 layers × (q, k, v, o: 64·(64+32+32+64); gate, up, down: 3·64·128)
        # + the tied head 512·64; attention: 2 · 2 layers · 4 heads · 16 dims per position.
        assert row["macs_per_token"] == 2 * (64 * 192 + 3 * 64 * 128) + 512 * 64
        assert row["attention_macs_per_position"] == 2 * 2 * 4 * 16
        mean = row["prompt_tokens"] + row["new_tokens"] / 2
        assert row["macs_per_step"] == row["batch"] * int(row["macs_per_token"] + 256 * mean)
        if peak is not None and row["engine"] != "naive":
            assert row["fraction_of_compute_peak"] == row["macs_per_step"] * row["decode_tokens_per_s"] / row[
                "batch"] / peak["macs_per_s"]
    naive = next(x for x in rows if x["engine"] == "naive")
    assert len(naive["steps_s"]) == naive["new_tokens"] - 1
    assert "decode vs hf" in r.out and "twice" in r.out
    if plot is not None:
        assert plot.stat().st_size > 1000


def test_bench_rejects_unknown_names(capsys):
    r = run_inprocess(["bench", "--shape", "nope", "--quick"], capsys)
    assert r.code == 2 and "unknown shape 'nope'" in r.err
    r = run_inprocess(["bench", "--shape", "tiny", "-w", "everything"], capsys)
    assert r.code == 2 and "unknown workload 'everything'" in r.err


@pytest.mark.parametrize("args, words", [
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),  # was an IndexError after loading
    (["--json", "/nonexistent-folder/x.json"], "the folder /nonexistent-folder does not exist"),  # after the run
    (["--json", "."], "is a folder"),
    (["--model", "some-model"], "--model has no effect with --shape"),  # was ignored
    (["--quantize", "q8_0"], "--quantize has no effect with --shape"),
    (["--kv", "-w", "decode"], "-w/--workload has no effect with --kv"),
    # these were tracebacks, the last three after the whole sweep
    (["--json", "x" * 300 + ".json"], "cannot be written (File name too long)"),
    (["--json", "/proc/self/x.json"], "/proc/self/x.json: cannot be written"),
    (["--plot", "out.txt"], "matplotlib draws"),
    (["--kv", "--kv-batch", str(2**63)], "--kv-batch must be 1 to 2,147,483,647"),
])
def test_bench_refuses_before_measuring(capsys, args, words):
    from clirun import one_error_line

    line = one_error_line(run_inprocess(["bench", "--shape", "tiny", "--quick", *args], capsys))
    assert words in line, line


def test_bench_kv_measures_each_setting_once(capsys):
    r = run_inprocess(["bench", "--shape", "tiny", "--kv", "--quick", "--repeats", "1", "--kv-context", "16",
                       "--kv-context", "16", "--kv-context", "1000000", "--kv-dtype", "float32", "--kv-dtype",
                       "float32"], capsys)
    assert r.code == 0, r.err
    rows = [line for line in r.out.splitlines() if line.startswith("│ float32")]
    assert len(rows) == 1, r.out
    said = " ".join(r.err.split())  # the console wraps it
    assert "skip context 1,000,000: with 4 decode steps it needs 1,000,004 positions, the model has 4,096" in said


def test_bench_that_measures_nothing_says_so(capsys):
    # Every engine asked for skipped (was an empty table, exit 0): one line with the reasons.
    r = run_inprocess(["bench", "--shape", "tiny", "--quick", "--repeats", "1", "-w", "batch4", "-e",
                       "twice-compiled"], capsys)
    assert r.code == 2 and r.out == "" and "Traceback" not in r.err, r
    line = r.err.strip().splitlines()[-1]  # after the progress notes
    assert line.startswith("twice: error: ") and "nothing was measured: batch4/twice-compiled: the compiled step serves batch 1 on the CPU" in line, line


def test_bench_kv_default_sweep_skips_what_the_head_size_cannot_hold(capsys):
    r = run_inprocess(["bench", "--shape", "tiny", "--kv", "--kv-context", "16", "--quick", "--repeats", "1"], capsys)
    assert r.code == 0, r.err  # tiny's head size is 16: its own defaults (q8_0, q4_0) were refused
    assert "skip --kv-dtype q8_0: it needs a head size that is a multiple of 32" in r.err
    # named by the user, it is refused in one line before anything is measured, as generate refuses it
    for args in (["--kv", "--kv-context", "16"], []):
        r = run_inprocess(["bench", "--shape", "tiny", *args, "--kv-dtype", "q4_0", "--quick", "--repeats", "1"],
                          capsys)
        assert one_error_line(r) == ("twice: error: --kv-dtype q4_0 needs a head size that is a multiple of 32, "
                                     "this model's is 16"), r.err
        assert "bandwidth" not in r.err


def test_block_weights_are_measured_against_the_int8_peak(model_dirs):
    """A quantized model's batches run integer dot products: bench's compute roofline for it is
    the u8·s8 peak (peak.c kind 2), a float model's the float one."""
    import torch

    from twice.core import benchmark, kernels
    from twice.weights.load import load

    folder = str(model_dirs("llama"))
    quantized = benchmark.measure_compute_peak(load(folder, device="cpu", dtype="float32", weights="q8_0").model)
    plain = benchmark.measure_compute_peak(load(folder, device="cpu", dtype="float32").model)
    if kernels.peak_macs(torch.int8, 1) is None:  # no AVX2 here: nothing to measure
        assert quantized is None
        return
    assert quantized["dtype"] == "int8" and quantized["macs_per_s"] > 1e9
    assert plain["dtype"] == "float32"
