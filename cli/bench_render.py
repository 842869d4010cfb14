"""Tables, JSON and plots for `twice bench` (numbers in, text and pictures out)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from .format import human_bytes, seconds


def _reference(results, workload, engine="transformers"):
    return next((r for w, r in results if w == workload and r.engine == engine), None)


def ratio(value: float, reference: float | None) -> str:
    return f"{value / reference:.2f}×" if reference else "—"


def _fraction_of_bandwidth(r, bandwidth: dict) -> float | None:
    """The run's bytes read per second over the measured read bandwidth (None: naive)."""
    read = bandwidth["read_bytes_per_s"]
    if not read or r.engine == "naive":
        return None
    return r.bytes_read_per_step() * (r.decode_tokens_per_s / r.batch) / read


def _fraction_of_peak(r, peak: dict | None) -> float | None:
    """The run's multiply-adds per second over the measured peak (None: no peak, or naive)."""
    if peak is None or r.engine == "naive" or not r.macs_per_token:
        return None
    return r.macs_per_step() * (r.decode_tokens_per_s / r.batch) / peak["macs_per_s"]


KEY_COLUMNS = 2  # workload and engine: repeated in every part when the table is split


def _columns(results, bandwidth: dict, peak: dict | None, two_line: bool = False) -> list[tuple[str, str, list[str]]]:
    """(header, justify, one cell per result) for every column of the results table;
    `two_line`: headers in two lines where a header is wider than its numbers."""
    rows = []
    for w, r in results:
        ref = _reference(results, w)
        frac = _fraction_of_bandwidth(r, bandwidth)
        compute = _fraction_of_peak(r, peak)
        rows.append((w.name, r.engine, str(r.prompt_tokens), str(r.new_tokens), str(r.batch), seconds(r.ttft_s),
                     f"{r.prefill_tokens_per_s:,.0f}", f"{r.decode_tokens_per_s:,.1f}", seconds(r.step_p50_s),
                     seconds(r.step_p99_s), human_bytes(r.peak_memory_bytes),
                     ratio(r.decode_tokens_per_s, ref.decode_tokens_per_s if ref else None),
                     ratio(r.prefill_tokens_per_s, ref.prefill_tokens_per_s if ref else None),
                     f"{100 * frac:.0f}%" if frac else "—", f"{100 * compute:.0f}%" if compute else "—"))
    headers = ("workload", "engine", "P", "G", "B", "TTFT", "prefill tok/s", "decode tok/s", "p50", "p99",
               "peak +mem", "decode vs hf", "prefill vs hf", "% mem bw", "% MAC peak")
    if two_line:  # a column is then as narrow as its widest number
        headers = ("workload", "engine", "P", "G", "B", "TTFT", "prefill\ntok/s", "decode\ntok/s", "p50", "p99",
                   "peak\n+mem", "decode\nvs hf", "prefill\nvs hf", "% mem\nbw", "% MAC\npeak")
    return [(h, "left" if i < KEY_COLUMNS else "right", [row[i] for row in rows]) for i, h in enumerate(headers)]


def _table(columns, title: str | None, caption: str | None) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold", caption=caption, caption_justify="left")
    for header, justify, _ in columns:
        t.add_column(header, justify=justify, no_wrap=True)  # numbers are never wrapped or cut
    for cells in zip(*(values for _, _, values in columns)):
        t.add_row(*cells)
    return t


CAPTION = ("TTFT: start → first token. decode tok/s: (tokens − 1) ÷ (last − first token), summed over the batch. "
           "peak +mem: memory added during the run on top of the loaded weights. % mem bw: (weights + mean KV "
           "read per step) × steps/s ÷ the measured read bandwidth (decode's limit at batch 1). % MAC peak: "
           "multiply-adds per step (matrices + attention at the mean position, whole batch) × steps/s ÷ the "
           "measured multiply-add peak (the limit as batches grow).")


def _title(setup: dict) -> str:
    why = setup.get("dtype_reason")
    return (f"twice bench · {setup['model']} · {setup['device']} {setup['dtype']}" + (f" ({why})" if why else "")
            + f" · {setup['threads']} threads")


def results_table(results, setup: dict, bandwidth: dict, peak: dict | None = None, caption: bool = True) -> Table:
    """Every run in one table, one-line headers (about 175 columns)."""
    return _table(_columns(results, bandwidth, peak), _title(setup), CAPTION if caption else None)


def results_tables(results, setup: dict, bandwidth: dict, peak: dict | None = None,
                   width: int | None = None) -> list[Table]:
    """The results table fitted to `width` columns (CAPTION, the definitions, is left to the
    caller to print at the full width): whole when it fits (with one-line headers, else
    two-line ones, about 145 columns), else cut into parts that each fit, every part led by
    the workload and engine columns, so that no number is ever squeezed, wrapped or cut to
    "1,…" (at 80 columns: three parts)."""
    if width is None or _width(results_table(results, setup, bandwidth, peak, caption=False)) <= width:
        return [results_table(results, setup, bandwidth, peak, caption=False)]
    columns = _columns(results, bandwidth, peak, two_line=True)
    if _width(_table(columns, None, None)) <= width:
        return [_table(columns, _title(setup), None)]
    key, rest = columns[:KEY_COLUMNS], columns[KEY_COLUMNS:]
    parts: list[list] = [[]]
    for column in rest:
        if parts[-1] and _width(_table(key + parts[-1] + [column], None, None)) > width:
            parts.append([])
        parts[-1].append(column)
    tables = [_table(key + part, None, None) for part in parts]
    tables[0].title = _title(setup)
    return tables


def _width(table: Table) -> int:
    from rich.console import Console

    return Console(width=10_000).measure(table).maximum


def bandwidth_line(bandwidth: dict) -> str:
    seen = ", ".join(f"{r / 1e9:.1f}" for r in bandwidth.get("read_measurements", []))
    return (f"memory bandwidth on {bandwidth['device']} ({bandwidth['threads']} threads, "
            f"{human_bytes(bandwidth['buffer_bytes'])} buffer): read {bandwidth['read_bytes_per_s'] / 1e9:.1f} GB/s"
            + (f" (best of {seen} GB/s, before and after the runs)" if seen else "")
            + f", copy {bandwidth['copy_bytes_per_s'] / 1e9:.1f} GB/s")


def peak_line(peak: dict) -> str:
    return (f"multiply-add peak on {peak['device']} ({peak['threads']} threads, {peak['dtype']}, registers only): "
            f"{peak['macs_per_s'] / 1e9:.1f} GMAC/s")


def suite_json(results, setup: dict, bandwidth: dict, peak: dict | None = None) -> dict:
    rows = []
    for w, r in results:
        ref = _reference(results, w)
        d = {"workload": w.name, **r.to_dict()}
        d["decode_vs_transformers"] = r.decode_tokens_per_s / ref.decode_tokens_per_s if ref else None
        d["prefill_vs_transformers"] = r.prefill_tokens_per_s / ref.prefill_tokens_per_s if ref else None
        d["fraction_of_bandwidth"] = _fraction_of_bandwidth(r, bandwidth)
        d["fraction_of_compute_peak"] = _fraction_of_peak(r, peak)
        rows.append(d)
    return {"setup": setup, "bandwidth": bandwidth, "compute_peak": peak, "results": rows}


def latency_plot(results, path: Path, setup: dict) -> None:
    """Per-token decode latency against position: naive grows with the sequence (O(N²) in
    total), cached stays flat (O(N))."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from twice.core.errors import PromptError

        raise PromptError("--plot needs matplotlib (pip install matplotlib)") from None
    # One panel per workload: naive vs cached on the long prompt (the O(N²) vs O(N) picture)
    # first, then the decode-bound run comparing the cached engines.
    order = {"naive": 0, "decode": 1}
    names = sorted({w.name for w, r in results if r.batch == 1 and r.steps_s}, key=lambda n: (order.get(n, 2), n))
    names = [n for n in names if n in order] or names[:2]
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(6 * max(1, len(names)), 4.5), dpi=120, squeeze=False)
    for ax, name in zip(axes[0], names):
        for w, r in results:
            if w.name != name or r.batch != 1 or not r.steps_s:
                continue
            positions = range(r.prompt_tokens + 1, r.prompt_tokens + 1 + len(r.steps_s))
            ax.plot(list(positions), [s * 1000 for s in r.steps_s], label=r.engine, linewidth=1)
        w = next(w for w, _ in results if w.name == name)
        ax.set_title(f"{name}: P={w.prompt_tokens}, G={w.new_tokens}", fontsize=10)
        ax.set_xlabel("position of the generated token")
        ax.set_ylabel("decode step latency (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{setup['model']} · {setup['device']} {setup['dtype']} · {setup['threads']} threads")
    fig.tight_layout()
    if Path(path).suffix:  # rendered in memory, then written whole and never through a link
        import io

        from twice.weights.safe_write import write_atomic

        buffer = io.BytesIO()
        fig.savefig(buffer, format=Path(path).suffix[1:].lower())
        write_atomic(Path(path), buffer.getvalue())
    else:  # matplotlib adds its default extension to the name
        fig.savefig(path)
    plt.close(fig)
