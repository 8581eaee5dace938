"""PNG plots (matplotlib, Agg): overhead vs M, throughput vs batch, divergence, kernels, engine, server,
training, MoE layer."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from .schema import NOT_MEANINGFUL, model_name  # noqa: E402

STOCK, INVARIANT = "#1f77b4", "#d62728"


def _finish(fig, results: dict, path: Path, timed: bool = True) -> str:
    device = results.get("device", "?")
    quick = " (quick mode: scaled-down shapes)" if results.get("quick") else ""
    fig.suptitle(f"Model preset {model_name(results)}{quick}", fontsize=11, weight="bold")
    fig.text(0.01, 0.005, f"{device} · commit {str(results.get('commit'))[:12]} · torch {results.get('torch')} · "
             f"triton {results.get('triton')}", fontsize=7, color="gray", ha="left", va="bottom")
    if timed and not results.get("timings_meaningful"):
        fig.text(0.5, 0.5, NOT_MEANINGFUL, fontsize=17, color="red", alpha=0.22, ha="center", va="center",
                 rotation=20, weight="bold")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _log_ticks(ax, xs) -> None:
    """Log axes labelled as plain numbers: x at the measured values, y at 1-2-5 steps."""
    xs = sorted(set(xs))
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.xaxis.set_minor_formatter(NullFormatter())
    if ax.get_yscale() == "log":
        low, high = ax.get_ylim()
        decades = math.log10(high / low) if low > 0 else 99
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 3 else (1.0,)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())


def _row_preset(row: dict) -> str:
    return f"{row['preset']}: " if row.get("preset") else ""


def _suffix(results: dict) -> str:
    return "" if results.get("timings_meaningful") else f"\n({NOT_MEANINGFUL})"


def overhead_vs_m(results: dict, out: Path) -> str | None:
    rows = results.get("matmul") or []
    if not rows:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    cmap = plt.get_cmap("tab10")
    for i, shape in enumerate(dict.fromkeys(r["shape"] for r in rows)):
        sel = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["M"])
        ms = [r["M"] for r in sel]
        label = f"{shape} ({sel[0]['N']}×{sel[0]['K']})"
        ax1.plot(ms, [r["ratio"] for r in sel], "o-", color=cmap(i), label=label)
        ax2.plot(ms, [r["stock_tflops"] for r in sel], "s--", color=cmap(i), alpha=0.7)
        ax2.plot(ms, [r["invariant_tflops"] for r in sel], "o-", color=cmap(i), label=label)
    ax1.axhline(1.0, color="black", lw=0.8, ls=":", label="parity")
    ax1.set(xscale="log", yscale="log", xlabel="M (rows = tokens in the batch)",
            ylabel="invariant time / stock time (×, lower is better)",
            title="Invariant linear overhead vs M" + _suffix(results))
    ax2.set(xscale="log", yscale="log", xlabel="M (rows = tokens in the batch)", ylabel="throughput (TFLOP/s)",
            title="Linear throughput: stock F.linear (dashed ■) vs invariant (solid ●)" + _suffix(results))
    ax2.plot([], [], "k--s", label="stock (F.linear)")
    ax2.plot([], [], "k-o", label="invariant")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        _log_ticks(ax, [r["M"] for r in rows])
    return _finish(fig, results, out / "overhead_vs_m.png")


def _grouped_bars(ax, labels, stock, invariant, ylabel, title):
    xs = range(len(labels))
    width = 0.38
    values = {"stock": stock, "invariant": invariant}
    for offset, (name, color) in zip((-width / 2, width / 2), (("stock", STOCK), ("invariant", INVARIANT))):
        heights = [v if v is not None else 0 for v in values[name]]
        bars = ax.bar([x + offset for x in xs], heights, width, color=color, label=name)
        for bar, v in zip(bars, values[name]):
            if v is None:
                ax.annotate("n/a", (bar.get_x() + bar.get_width() / 2, 0), ha="center", va="bottom", fontsize=8)
    for x, s, i in zip(xs, stock, invariant):
        if s and i:
            ax.annotate(f"{i / s:.2f}×", (x, max(s, i)), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(list(xs), labels)
    ax.set(ylabel=ylabel, title=title)
    ax.margins(y=0.15)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def throughput_vs_batch(results: dict, out: Path) -> str | None:
    e2e, decode = results.get("e2e") or [], results.get("decode") or []
    if not e2e and not decode:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    model = f"{_row_preset(e2e[0])}{e2e[0]['layers']} layers, hidden {e2e[0]['hidden']}" if e2e else ""
    _grouped_bars(ax1, [f"{r['batch']}×{r['seq']}" for r in e2e], [r.get("stock_tokens_per_s") for r in e2e],
                  [r.get("invariant_tokens_per_s") for r in e2e], "tokens / s (higher is better)",
                  f"Scoring throughput ({model})\n(label = invariant/stock tokens/s)" + _suffix(results))
    ax1.set_xlabel("batch × sequence length")
    _grouped_bars(ax2, [f"B={r['batch']}" for r in decode], [r.get("stock_decode_tokens_per_s") for r in decode],
                  [r.get("invariant_decode_tokens_per_s") for r in decode], "generated tokens / s (higher is better)",
                  "Greedy decode with KV cache\n(label = invariant/stock tokens/s)" + _suffix(results))
    if decode:
        ax2.set_xlabel(f"batch (prompt {decode[0]['prompt']} tokens, {decode[0]['new_tokens']} new tokens)")
    return _finish(fig, results, out / "throughput_vs_batch.png")


def divergence(results: dict, out: Path) -> str | None:
    rows = results.get("divergence") or []
    if not rows:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.55 * len(rows) + 2.6), sharey=True)
    ys = list(range(len(rows)))[::-1]
    h = 0.38
    for offset, mode, color in ((h / 2, "stock", STOCK), (-h / 2, "invariant", INVARIANT)):
        diffs = [r.get(f"{mode}_max_abs_diff") for r in rows]
        fracs = [r.get(f"{mode}_frac_unequal") for r in rows]
        ax1.barh([y + offset for y in ys], [d or 0 for d in diffs], h, color=color, label=mode)
        ax2.barh([y + offset for y in ys], [100 * (f or 0) for f in fracs], h, color=color, label=mode)
        for y, r, d in zip(ys, rows, diffs):
            checked = r.get(f"{mode}_rows_checked")
            text = "not run" if not checked else (f"{d:.3g}" if d else "0 (bitwise equal)")
            ax1.annotate(text, (d or 0, y + offset), xytext=(3, 0), textcoords="offset points", va="center",
                         fontsize=7, color=color)
            text = "not run" if not checked else f"{r[f'{mode}_rows_unequal']}/{checked}"
            ax2.annotate(text, (100 * (r.get(f"{mode}_frac_unequal") or 0), y + offset), xytext=(3, 0),
                         textcoords="offset points", va="center", fontsize=7, color=color)
    first = rows[0]
    model = (f"{_row_preset(first)}{first['layers']} layer(s), hidden {first['hidden']}, MLP {first['intermediate']}, "
             f"{first['dtype']}")
    ax1.set_yticks(ys, [r["case"] for r in rows], fontsize=8)
    ax1.set(xlabel="max |Δ logit|, batch vs alone (logit units)", title=f"Logit drift, batch vs alone\n({model})")
    ax2.set(xlabel="rows not bitwise equal (%)", xlim=(0, 115), title="Rows whose logits change with the batch")
    for ax in (ax1, ax2):
        ax.margins(x=0.2)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    ax2.set_xlim(0, 115)
    return _finish(fig, results, out / "divergence.png", timed=False)


def kernels(results: dict, out: Path) -> str | None:
    norm = results.get("rmsnorm") or []
    attn, dec = ([r for r in results.get(key) or [] if not r.get("window")]  # windowed rows: the tables only
                 for key in ("attention", "decode_attention"))
    if not (norm or attn or dec):
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    hidden = f", hidden {norm[0]['N']}" if norm else ""
    stock_norm = ((norm[0].get("stock_class") if norm else None)
                  or (results.get("model") or {}).get("rms_norm", "RMSNorm"))
    for ax, rows, key, xlabel, title in (
            (axes[0], norm, "M", f"rows (M){hidden}", f"RMSNorm: HF {stock_norm} vs invariant"),
            (axes[2], dec, "kv_len", "context length (keys)", "Decode attention (Lq=1): SDPA vs invariant")):
        for batch in dict.fromkeys(r.get("batch", "") for r in rows):
            sel = [r for r in rows if r.get("batch", "") == batch]
            tag = f" B={batch}" if batch != "" else ""
            ax.plot([r[key] for r in sel], [r["stock_ms"] for r in sel], "s--", color=STOCK, label=f"stock{tag}",
                    alpha=0.6 if batch == 1 else 1)
            ax.plot([r[key] for r in sel], [r["invariant_ms"] for r in sel], "o-", color=INVARIANT,
                    label=f"invariant{tag}", alpha=0.6 if batch == 1 else 1)
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="time (ms, lower is better)", title=title + _suffix(results))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        if rows:
            _log_ticks(ax, [r[key] for r in rows])
    _grouped_bars(axes[1], [f"{r['batch']}×{r['q_len']}" for r in attn], [r["stock_ms"] for r in attn],
                  [r["invariant_ms"] for r in attn], "time (ms, lower is better)",
                  "Prefill attention, left-padded: SDPA vs invariant\n(label = invariant/stock time)" + _suffix(results))
    heads = f" (heads q/kv/d {attn[0]['heads']}/{attn[0]['kv_heads']}/{attn[0]['head_dim']})" if attn else ""
    axes[1].set_xlabel(f"batch × sequence length{heads}")
    return _finish(fig, results, out / "kernels.png")


ENGINE_LINES = (("invariant_engine", "engine, invariant kernels", INVARIANT, "o-"),
                ("stock_engine", "engine, stock kernels", STOCK, "s--"),
                ("hf_generate", "HF generate (stock, left-padded batches)", "#7f7f7f", "^:"))


def engine(results: dict, out: Path) -> str | None:
    rows = results.get("engine") or []
    if not rows:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    first = rows[0]
    model = f"{_row_preset(first)}{first['layers']} layers, hidden {first['hidden']}"
    for mode, label, color, style in ENGINE_LINES:
        sel = sorted((r for r in rows if r["mode"] == mode and r.get("tokens_per_s")), key=lambda r: r["concurrency"])
        if not sel:
            continue
        xs = [r["concurrency"] for r in sel]
        ax1.plot(xs, [r["tokens_per_s"] for r in sel], style, color=color, label=label)
        tpot = [(r["concurrency"], r["tpot_ms"]) for r in sel if r.get("tpot_ms")]
        ax2.plot([x for x, _ in tpot], [y for _, y in tpot], style, color=color, label=label)
        if mode == "invariant_engine":
            for r in sel:
                ratio = r.get("invariant_to_stock_engine")
                parts = [f"{ratio:.2f}× stock engine"] if ratio else []
                if r.get("invariant_rows_checked"):
                    parts.append(f"{r['invariant_rows_equal']}/{r['invariant_rows_checked']} = alone")
                if parts:  # the right-most label to the left of its point, inside the axes
                    last = r is sel[-1] and len(sel) > 1
                    ax1.annotate("\n".join(parts), (r["concurrency"], r["tokens_per_s"]),
                                 xytext=(-4 if last else 4, -4), textcoords="offset points", fontsize=7, color=INVARIANT, va="top",
                                 ha="right" if last else "left")
    new = f", {first.get('max_tokens')} new tokens per request" if first.get("max_tokens") else ""
    ax1.set(xscale="log", yscale="log", xlabel="concurrency (requests in flight)",
            ylabel="output tokens / s (higher is better)",
            title=f"Serving throughput ({model}{new})" + _suffix(results))
    ax2.set(xscale="log", yscale="log", xlabel="concurrency (requests in flight)",
            ylabel="time per output token, ms (lower is better)",
            title="Time per output token (TPOT)" + _suffix(results))
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        ax.margins(x=0.15)
        _log_ticks(ax, [r["concurrency"] for r in rows])
    return _finish(fig, results, out / "engine.png")


SERVER_LINES = (("invariant", "invariant-infer serve (invariant kernels)", INVARIANT, "o-"),
                ("stock", "invariant-infer serve --kernels stock", STOCK, "s--"))


def server(results: dict, out: Path) -> str | None:
    rows = results.get("server") or []
    if not rows:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    first = rows[0]
    model = f"{_row_preset(first)}{first['layers']} layers, hidden {first['hidden']}"
    for mode, label, color, style in SERVER_LINES:
        sel = sorted((r for r in rows if r["mode"] == mode and r.get("tokens_per_s")), key=lambda r: r["concurrency"])
        if not sel:
            continue
        xs = [r["concurrency"] for r in sel]
        ax1.plot(xs, [r["tokens_per_s"] for r in sel], style, color=color, label=label)
        ax2.plot(xs, [r["p99_ms"] for r in sel], style, color=color, label=label)
        if mode == "invariant":
            for r in sel:
                parts = [f"{r['invariant_to_stock']:.2f}× stock"] if r.get("invariant_to_stock") else []
                if r.get("invariant_rows_checked"):
                    parts.append(f"{r['invariant_rows_equal']}/{r['invariant_rows_checked']} = alone")
                if parts:
                    last = r is sel[-1] and len(sel) > 1
                    ax1.annotate("\n".join(parts), (r["concurrency"], r["tokens_per_s"]),
                                 xytext=(-4 if last else 4, -4), textcoords="offset points", fontsize=7,
                                 color=INVARIANT, va="top", ha="right" if last else "left")
        for r in sel:
            if r.get("errors"):
                ax2.annotate(f"{r['errors']} errors", (r["concurrency"], r["p99_ms"]), xytext=(4, 4),
                             textcoords="offset points", fontsize=7, color=color)
    new = f", {first.get('max_tokens')} new tokens per request" if first.get("max_tokens") else ""
    ax1.set(xscale="log", yscale="log", xlabel="concurrency (client threads, closed loop)",
            ylabel="output tokens / s (higher is better)",
            title=f"HTTP server throughput ({model}{new})" + _suffix(results))
    ax2.set(xscale="log", yscale="log", xlabel="concurrency (client threads, closed loop)",
            ylabel="p99 request latency, ms (lower is better)",
            title=f"HTTP server p99 latency ({model})" + _suffix(results))
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        ax.margins(x=0.15)
        _log_ticks(ax, [r["concurrency"] for r in rows])
    return _finish(fig, results, out / "server.png")


def train(results: dict, out: Path) -> str | None:
    rows = results.get("train") or []
    if not rows:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    first = rows[0]
    model = f"{_row_preset(first)}{first['layers']} layers, hidden {first['hidden']}, {first['dtype']}"
    labels = [f"{r['layout']}\nB={r['batch']}×{r['seq']}" for r in rows]
    _grouped_bars(ax1, labels, [r.get("stock_tokens_per_s") for r in rows],
                  [r.get("invariant_tokens_per_s") for r in rows], "training tokens / s (higher is better)",
                  f"Forward + backward ({model})\n(label = invariant/stock tokens/s)" + _suffix(results))
    xs = range(len(rows))
    width = 0.38
    for offset, mode, color in ((-width / 2, "stock", STOCK), (width / 2, "invariant", INVARIANT)):
        diffs = [r.get(f"{mode}_logprob_max_abs_diff") for r in rows]
        ax2.bar([x + offset for x in xs], [d or 0 for d in diffs], width, color=color, label=mode)
        for x, d in zip(xs, diffs):
            text = "not run" if d is None else (f"{d:.3g}" if d else "0 (bitwise)")
            ax2.annotate(text, (x + offset, d or 0), xytext=(0, 3), textcoords="offset points", ha="center",
                         fontsize=7, color=color, rotation=90 if d == 0 else 0, va="bottom")
    ax2.set_xticks(list(xs), labels)
    top = max((r.get(f"{m}_logprob_max_abs_diff") or 0 for r in rows for m in ("stock", "invariant")), default=0)
    ax2.set(ylabel="max |Δ logprob| (sample 0, batch vs alone)", ylim=(0, 1.5 * top if top else 1),
            title="Trainer logprob mismatch: one sample in the training batch vs alone")
    ax2.grid(True, axis="y", alpha=0.3)
    ax2.legend(fontsize=8)
    return _finish(fig, results, out / "train.png")


MOE_LINES = {"invariant": (INVARIANT, "o-"), "invariant_fp8": ("#8c564b", "D-"), "eager": (STOCK, "s--"), "batched_mm": ("#2ca02c", "^--"),
             "grouped_mm": ("#9467bd", "v--")}


def moe(results: dict, out: Path) -> str | None:
    rows = [r for r in results.get("moe") or [] if r.get("tokens_per_s")]
    if not rows:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    first = rows[0]
    layer = (f"hidden {first['hidden']}, {first['experts']} experts, top-{first['top_k']}, "
             f"intermediate {first['intermediate']}, {first['dtype']}")
    impls = list(dict.fromkeys(r["implementation"] for r in rows))
    width = 0.8 / len(impls)
    counts = sorted({r["tokens"] for r in rows})
    for i, impl in enumerate(impls):
        color, style = MOE_LINES.get(impl, ("gray", "x:"))
        sel = sorted((r for r in rows if r["implementation"] == impl), key=lambda r: r["tokens"])
        label = impl.replace("_", " ") if impl.startswith("invariant") else f"stock {impl}"
        ax1.plot([r["tokens"] for r in sel], [r["tokens_per_s"] for r in sel], style, color=color, label=label)
        for r in sel:
            if r.get("invariant_time_ratio"):
                ax1.annotate(f"{1 / r['invariant_time_ratio']:.2g}×", (r["tokens"], r["tokens_per_s"]),
                             xytext=(4, -4), textcoords="offset points", fontsize=7, color=color, va="top")
        xs = [counts.index(r["tokens"]) + (i - (len(impls) - 1) / 2) * width for r in sel]
        diffs = [r.get("alone_max_abs_diff") or 0 for r in sel]
        ax2.bar(xs, diffs, width, color=color, label=label)
        for x, r in zip(xs, sel):
            text = "0 (bitwise)" if r.get("alone_bitwise_equal") else f"{r.get('alone_max_abs_diff'):.3g}"
            ax2.annotate(text, (x, r.get("alone_max_abs_diff") or 0), xytext=(0, 3), textcoords="offset points",
                         ha="center", va="bottom", fontsize=7, color=color, rotation=90)
    ax1.set(xscale="log", yscale="log", xlabel="tokens in the batch", ylabel="tokens / s (higher is better)",
            title=f"One MoE layer ({layer})\n(label = invariant/stock tokens/s)" + _suffix(results))
    ax1.grid(True, which="both", alpha=0.3)
    ax1.margins(x=0.15)
    _log_ticks(ax1, counts)
    top = max((r.get("alone_max_abs_diff") or 0 for r in rows), default=0)
    ax2.set_xticks(range(len(counts)), [str(c) for c in counts])
    ax2.set(xlabel="tokens in the batch", ylabel="max |Δ output|, tokens alone vs in the batch",
            ylim=(0, 1.6 * top if top else 1), title="A token alone vs inside the batch")
    ax2.grid(True, axis="y", alpha=0.3)
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
    return _finish(fig, results, out / "moe.png")


def make_plots(results: dict, out: Path) -> list:
    made = []
    for fn in (overhead_vs_m, throughput_vs_batch, divergence, kernels, engine, server, train, moe):
        try:
            name = fn(results, out)
        except Exception as exc:  # a plot must never lose the numbers
            print(f"plot {fn.__name__} failed: {exc}")
            name = None
        if name:
            made.append(name)
    return made
