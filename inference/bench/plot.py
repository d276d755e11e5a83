"""The benchmark's plot (OUTPUT/speedup.png): speedup over vanilla with its 95% interval and per-prompt points, and
tau, per method."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure


def plot(results: dict, path: Path) -> None:
    """Draw on a Figure of its own (no pyplot: no global backend or figure state) and save it as PNG to `path`."""
    names = list(results["methods"])
    speedup = [results["methods"][n]["speedup"] or 0.0 for n in names]
    tau = [results["methods"][n]["tau"] for n in names]
    x = range(len(names))
    width = 0.38
    fig = Figure(figsize=(max(5.0, 1.6 * len(names) + 2), 4))
    ax = fig.subplots()
    spreads = [results["methods"][n]["speedup_spread"] for n in names]
    ci = [p["ci95"] or [s, s] for p, s in zip(spreads, speedup)]
    errors = [[max(s - lo, 0.0) for s, (lo, _) in zip(speedup, ci)],
              [max(hi - s, 0.0) for s, (_, hi) in zip(speedup, ci)]]
    bars_s = ax.bar([i - width / 2 for i in x], speedup, width, yerr=errors, capsize=3,
                    label="speedup vs vanilla (tokens/s), 95% CI")
    for i, p in zip(x, spreads):
        points = [v for v in p["per_prompt"] if v is not None]
        offsets = [width * (0.6 * (j + 0.5) / len(points) - 0.3) for j in range(len(points))]
        ax.scatter([i - width / 2 + o for o in offsets], points, s=6, color="black", zorder=3,
                   label="per-prompt speedup" if i == 0 else None)
    bars_t = ax.bar([i + width / 2 for i in x], [t or 0.0 for t in tau], width, label="tau (tokens / target forward)")
    for bar, value, (_, hi), p in zip(bars_s, speedup, ci, spreads):  # the label above the interval and the points
        top = max([value, hi] + [v for v in p["per_prompt"] if v is not None])
        ax.annotate(f"{value:.2f}x", (bar.get_x() + bar.get_width() / 2, top), ha="center", va="bottom", fontsize=8)
    for bar, value in zip(bars_t, tau):
        ax.annotate("n/a" if value is None else f"{value:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks(list(x), names, rotation=15, ha="right")
    st = results["settings"]
    ax.set_title(f"{Path(st['target']['name']).name}, {st['device']} {st['dtype']}, {st['num_prompts_used']} prompts "
                 f"x {st['max_new_tokens']} tokens", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
