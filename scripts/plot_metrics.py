#!/usr/bin/python3
"""Plots the metrics of fusedp training runs (the JSON lines of --metrics) as a PNG.

    plot_metrics.py RUN.jsonl [MORE.jsonl ...] [-o OUT.png] [--title TEXT] [--log]

One curve per file and quantity: train and test loss against the epoch on the left, test accuracy on
the right (left out when no file has it, as for regression). Each file is one run, labelled by its
name; lines without an "epoch" are skipped, and so are null values (a NaN loss). The output defaults
to the first file's name with .png. Needs matplotlib (Debian: apt-get install python3-matplotlib);
renders with the Agg backend, so no display is needed.

Exit status: 0 on success, 1 on a missing or malformed file (the message names the file and line).
"""

import argparse
import json
import os
import sys


def fail(message):
    print(f"plot_metrics.py: error: {message}", file=sys.stderr)
    sys.exit(1)


def read_run(path):
    """The epochs and each quantity's values of one metrics file, in file order."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        fail(f"{path}: cannot read the metrics file: {e.strerror}")
    series = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            fail(f"{path}:{number}: not a JSON object: {e.msg}")
        if not isinstance(record, dict):
            fail(f"{path}:{number}: not a JSON object")
        epoch = record.get("epoch")
        if not isinstance(epoch, (int, float)) or isinstance(epoch, bool):
            continue
        for key, value in record.items():
            if key != "epoch" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, []).append((epoch, float(value)))
    if not any(k in series for k in ("train_loss", "test_loss")):
        fail(f"{path}: no epoch lines with train_loss or test_loss")
    return series


def main():
    parser = argparse.ArgumentParser(description="Plot fusedp metrics (JSON lines) as loss and accuracy curves.")
    parser.add_argument("files", nargs="+", help="metrics files written with --metrics")
    parser.add_argument("-o", "--output", help="PNG to write (default: the first file with .png)")
    parser.add_argument("--title", help="title above the plots")
    parser.add_argument("--log", action="store_true", help="logarithmic loss axis")
    args = parser.parse_args()

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        fail(f"cannot import matplotlib ({e}); install it: apt-get install python3-matplotlib")

    runs = [(path, read_run(path)) for path in args.files]
    output = args.output or os.path.splitext(args.files[0])[0] + ".png"
    with_accuracy = any("test_accuracy" in series for _, series in runs)

    columns = 2 if with_accuracy else 1
    fig, axes = plt.subplots(1, columns, figsize=(6.4 * columns, 4.4), squeeze=False)
    loss_ax = axes[0][0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (path, series) in enumerate(runs):
        color = colors[i % len(colors)]
        name = os.path.basename(path) if len(runs) > 1 else ""
        for key, style, label in (("train_loss", "--", "train loss"), ("test_loss", "-", "test loss")):
            if key in series:
                epochs, values = zip(*series[key])
                loss_ax.plot(epochs, values, style, marker="o", markersize=3, color=color,
                             label=f"{name} {label}".strip())
        if with_accuracy and "test_accuracy" in series:
            epochs, values = zip(*series["test_accuracy"])
            axes[0][1].plot(epochs, [100 * v for v in values], "-", marker="o", markersize=3, color=color,
                            label=f"{name} test accuracy".strip())
    loss_ax.set_xlabel("epoch")
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("loss")
    if args.log:
        loss_ax.set_yscale("log")
    loss_ax.grid(True, alpha=0.3)
    loss_ax.legend()
    if with_accuracy:
        acc_ax = axes[0][1]
        acc_ax.set_xlabel("epoch")
        acc_ax.set_ylabel("accuracy (%)")
        acc_ax.set_title("test accuracy")
        acc_ax.grid(True, alpha=0.3)
        acc_ax.legend()
    for ax in axes[0]:
        ax.xaxis.get_major_locator().set_params(integer=True)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    try:
        fig.savefig(output, dpi=100)
    except OSError as e:
        fail(f"{output}: cannot write the PNG: {e.strerror}")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
