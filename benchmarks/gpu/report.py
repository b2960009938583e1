#!/usr/bin/env python3
"""Prints the table that ends benchmarks/gpu/check.sh: images/s of fusedp's Cuda train step, PyTorch
eager and torch.compile for each network and batch, the ratios, and the targets of issue 3. Also writes
it as Markdown (for benchmarks/RESULTS.md).

    report.py --fusedp fusedp.txt --torch-dir torch/ --header header.txt --markdown results.md
"""
import argparse
import glob
import json
import os
import re

# (net, batch): (fusedp / eager, fusedp / compile) the issue asks for; None: no target
TARGETS = {
    ("lenet", 128): (2.0, 1.1),
    ("cifar", 128): (2.0, 1.1),
    ("mlp64", 1 << 14): (5.0, None),
    ("mlp128", 1 << 14): (5.0, None),
}
ORDER = [("lenet", 128), ("cifar", 128), ("mlp64", 1 << 14), ("mlp64", 1 << 18), ("mlp128", 1 << 14),
         ("mlp128", 1 << 18)]


def read_fusedp(path):
    out, notes = {}, []
    if not path or not os.path.exists(path):
        return out, ["fusedp: no results (the benchmark did not run)"]
    for line in open(path):
        m = re.match(r"RESULT impl=fusedp net=(\S+) batch=(\d+) precision=(\S+) median_ms=(\S+) images_per_s=(\S+) "
                     r"graphs=(\d)", line)
        if m:
            out[(m.group(1), int(m.group(2)))] = {"images_per_s": float(m.group(5)), "ms": float(m.group(4)),
                                                  "graphs": m.group(6) == "1", "precision": m.group(3)}
        elif line.startswith(("FAILED", "NOTE")):
            notes.append(line.strip())
    return out, notes


def read_torch(directory):
    out = {}
    for f in glob.glob(os.path.join(directory or "", "*.json")):
        try:
            r = json.load(open(f))
        except (OSError, ValueError):
            continue
        out[(r["impl"], r["net"], int(r["batch"]))] = r
    return out


def fmt(v):
    return f"{v:,.0f}" if v is not None else "-"


def ratio(a, b):
    return a / b if a is not None and b else None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fusedp")
    p.add_argument("--torch-dir")
    p.add_argument("--header", help="file whose lines (date, GPU, commit, ...) head the table")
    p.add_argument("--markdown", help="also write the table here as Markdown")
    a = p.parse_args()
    ours, notes = read_fusedp(a.fusedp)
    theirs = read_torch(a.torch_dir)
    header = open(a.header).read().strip().splitlines() if a.header and os.path.exists(a.header) else []

    cols = ["net", "batch", "fusedp img/s", "eager img/s", "compile img/s", "x eager", "x compile", "target"]
    rows = []
    for key in ORDER:
        net, batch = key
        f = ours.get(key, {}).get("images_per_s")
        e = theirs.get(("torch-eager", net, batch), {}).get("images_per_s")
        c = theirs.get(("torch-compile", net, batch), {}).get("images_per_s")
        re_, rc = ratio(f, e), ratio(f, c)
        target = TARGETS.get(key)
        verdict = "-"
        if target:
            want_e, want_c = target
            parts = []
            if want_e:
                parts.append(f">={want_e}x eager " + ("met" if re_ and re_ >= want_e else "NOT met" if re_ else "?"))
            if want_c:
                parts.append(f">={want_c}x compile " + ("met" if rc and rc >= want_c else "NOT met" if rc else "?"))
            verdict = ", ".join(parts)
        rows.append([net, str(batch), fmt(f), fmt(e), fmt(c), f"{re_:.2f}" if re_ else "-",
                     f"{rc:.2f}" if rc else "-", verdict])

    widths = [max(len(cols[i]), *(len(r[i]) for r in rows)) for i in range(len(cols))]
    lines = header + [""]
    lines.append("  ".join(cols[i].ljust(widths[i]) for i in range(len(cols))))
    for r in rows:
        lines.append("  ".join(r[i].ljust(widths[i]) for i in range(len(cols))))
    graphs = {k: v["graphs"] for k, v in ours.items()}
    if graphs and not all(graphs.values()):
        lines.append("note: some fusedp runs did not replay a CUDA graph: " +
                     ", ".join(f"{k[0]}/{k[1]}" for k, g in graphs.items() if not g))
    lines += notes
    print("\n".join(lines))
    if a.markdown:
        with open(a.markdown, "w") as md:
            md.write("\n".join(header) + "\n\n")
            md.write("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
            for r in rows:
                md.write("| " + " | ".join(r) + " |\n")
            for n in notes:
                md.write(f"\n{n}\n")


if __name__ == "__main__":
    main()
