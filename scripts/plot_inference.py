"""Plot and tabulate the JSON results of benchmark_inference.py.

Run: python scripts/plot_inference.py RESULTS.json [MORE.json ...] --plot docs/inference.png
Prints a Markdown table (one row per run and mode, the ratios to eager beside the times)
and draws time between output tokens, time to first token and compile time per mode,
one group of bars per run (its rank count).
"""

from __future__ import annotations

import argparse
import json

MODE_NAMES = {"eager": "eager DTensor", "dtcompile": "dtcompile", "inductor": "torch.compile"}
COLORS = {"eager": "#8c8c8c", "dtcompile": "#1f77b4", "inductor": "#ff7f0e"}


def load(paths: list[str]) -> list[dict]:
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def run_label(run: dict) -> str:
    setup = run["setup"]
    ranks = setup["ranks"]
    return f"{ranks} {'rank' if ranks == 1 else 'ranks'} ({setup['device']})"


def markdown_table(runs: list[dict]) -> str:
    lines = [
        "| run | mode | TTFT ms | TBOT ms | TBOT eager/x | tokens/s | compile s | tokens = eager |",
        "|---|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for run in runs:
        results = run["results"]
        eager = results.get("eager")
        for mode, r in results.items():
            ratio = f"{eager['tbot_ms'] / r['tbot_ms']:.2f}x" if eager else ""
            lines.append(
                f"| {run_label(run)} | {MODE_NAMES.get(mode, mode)} | {r['ttft_ms']:.2f} | {r['tbot_ms']:.3f} | "
                f"{ratio} | {r['tokens_per_s']:.0f} | {r['compile_s']:.2f} | "
                f"{'yes' if r['tokens_equal_eager'] else 'no'} |"
            )
    return "\n".join(lines)


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("tbot_ms", "time between output tokens (ms)", False),
        ("ttft_ms", "time to first token (ms)", False),
        ("compile_s", "compile time (s, log scale)", True),
    )
    modes = [m for m in MODE_NAMES if any(m in run["results"] for run in runs)]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    width = 0.8 / len(modes)
    for axis, (key, title, log) in zip(axes, panels):
        for i, mode in enumerate(modes):
            xs, heights = [], []
            for j, run in enumerate(runs):
                if mode in run["results"] and not (key == "compile_s" and mode == "eager"):  # eager compiles nothing
                    xs.append(j + (i - (len(modes) - 1) / 2) * width)
                    heights.append(max(run["results"][mode][key], 1e-3))
            bars = axis.bar(xs, heights, width, label=MODE_NAMES[mode], color=COLORS[mode])
            axis.bar_label(bars, fmt="%.2f" if key != "compile_s" else "%.1f", fontsize=7, padding=1)
        axis.set_xticks(range(len(runs)), [run_label(run) for run in runs], fontsize=8)
        axis.set_title(title, fontsize=9)
        if log:
            axis.set_yscale("log")
        axis.margins(y=0.15)
    axes[0].legend(fontsize=8)
    setup = runs[0]["setup"]
    figure.suptitle(
        f"Hugging Face Llama, {setup['layers']} layers, hidden {setup['hidden_size']}, batch {setup['batch_size']}, "
        f"{setup['input_length']} tokens in, {setup['output_length']} out ({setup['kv_cache']} KV cache)",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="JSON files written by benchmark_inference.py --json")
    parser.add_argument("--plot", metavar="PNG", help="where to draw the bars")
    args = parser.parse_args(argv)
    runs = load(args.results)
    print(markdown_table(runs))
    if args.plot:
        plot(runs, args.plot)
        print(f"\nplot written to {args.plot}")


if __name__ == "__main__":
    main()
