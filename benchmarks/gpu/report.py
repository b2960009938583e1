#!/usr/bin/env python3
"""Prints the table that ends benchmarks/gpu/check.sh: fusedp's Cuda train step (ms and images/s) beside
every PyTorch mode that was measured (eager, eager in a CUDA graph, torch.compile, max-autotune; TF32
and bf16 autocast), fusedp's ratio to the fastest PyTorch mode of each precision, and the issues'
targets, each said met or not. Also writes it as Markdown (for benchmarks/RESULTS.md).

    report.py --fusedp fusedp.txt --torch-dir torch/ --header header.txt --markdown results.md
"""
import argparse
import glob
import json
import os
import re

ORDER = [("lenet", 128), ("cifar", 128), ("mlp64", 1 << 14), ("mlp64", 1 << 18), ("mlp128", 1 << 14),
         ("mlp128", 1 << 18), ("resnet18", 256)]
# PyTorch's columns, in this order when present (others, e.g. torch-compile-reduce-overhead, after).
TORCH_ORDER = ["torch-eager", "torch-graph", "torch-compile", "torch-autotune", "torch-eager-bf16",
               "torch-graph-bf16", "torch-compile-bf16", "torch-autotune-bf16"]


# The runs that turn one of fusedp's defaults off to measure what it gives (check.sh's variant runs): listed
# in the table, never counted as fusedp's result in the ratios and targets.
ABLATIONS = ("-unfused", "-separate-update", "-no-pdl", "-serial", "-split-kernel", "-split-gemm", "-wide")


def ablation(impl):
    return any(a in impl for a in ABLATIONS)


def fastest(theirs, net, batch, bf16):
    """The highest images/s of PyTorch's modes at one precision for (net, batch), and its impl."""
    best = None
    for (impl, n, b), r in theirs.items():
        if n == net and b == batch and impl.endswith("-bf16") == bf16:
            if best is None or r["images_per_s"] > best[1]:
                best = (impl, r["images_per_s"])
    return best


# The issues' targets (benchmarks/RESULTS.md; never asserted in a test): (net, batch, text, check),
# check(fusedp result, PyTorch results of that (net, batch)) -> True, False, or None when not measured.
def _ms_at_most(limit):
    return lambda f, t: f["ms"] <= limit if f else None


def _x_of(impl, want):
    return lambda f, t: (f["images_per_s"] / t[impl]["images_per_s"] >= want) if f and impl in t else None


def _x_fastest(want, bf16=False):
    # "The fastest PyTorch mode" only where its strongest mode (max-autotune with CUDA graphs) was
    # measured: against the modes that happened to warm up in time the ratio could read met when it is not.
    strongest = "torch-autotune-bf16" if bf16 else "torch-autotune"

    def check(f, t):
        same = [r["images_per_s"] for i, r in t.items() if i.endswith("-bf16") == bf16]
        return f["images_per_s"] / max(same) >= want if f and same and strongest in t else None
    return check


# Each checks fusedp's faster TF32 build, except those marked bf16, which check its BF16 runs.
TARGETS = [
    ("lenet", 128, ">= 2x eager (issue 3)", _x_of("torch-eager", 2.0)),
    ("lenet", 128, ">= 1.1x compile (issue 3)", _x_of("torch-compile", 1.1)),
    ("lenet", 128, "<= 0.12 ms (issue 17)", _ms_at_most(0.12)),
    ("cifar", 128, ">= 2x eager (issue 3)", _x_of("torch-eager", 2.0)),
    ("cifar", 128, "<= 0.60 ms TF32 (issue 14)", _ms_at_most(0.60)),
    ("cifar", 128, "<= 0.40 ms TF32 (issue 17)", _ms_at_most(0.40)),
    ("cifar", 128, ">= 1.5x fastest PyTorch TF32 mode (issue 17)", _x_fastest(1.5)),
    ("cifar", 128, "<= 0.30 ms BF16 (issue 17)", _ms_at_most(0.30), "bf16"),
    ("cifar", 128, ">= 1.5x fastest PyTorch bf16 mode (issue 17)", _x_fastest(1.5, bf16=True), "bf16"),
    ("mlp64", 1 << 14, ">= 7x eager (issue 14)", _x_of("torch-eager", 7.0)),
    ("mlp128", 1 << 18, "<= 1.3 ms (issue 14)", _ms_at_most(1.3)),
]


def read_fusedp(path):
    """{impl: {(net, batch): result}} for each fusedp build that ran (fusedp: the WMMA mainloop;
    fusedp-mma: the layers' GEMMs on the tensor-core one; fusedp-unfused: without the fused gradient
    boundaries; fusedp-separate-update: the optimizer as its own pass; fusedp-no-pdl: without programmatic
    dependent launch; fusedp-serial: backward's weight gradients in order on one stream; fusedp-split-kernel:
    split-K parts added up by a second kernel; fusedp-split-gemm: by the GEMM's last block whatever their
    size; fusedp-mma-wide: BF16 stage outputs in fp32 elements), and the FAILED/NOTE lines."""
    out, notes = {}, []
    if not path or not os.path.exists(path):
        return out, ["fusedp: no results (the benchmark did not run)"]
    for line in open(path):
        m = re.match(r"RESULT impl=(fusedp\S*) net=(\S+) batch=(\d+) precision=(\S+) median_ms=(\S+) "
                     r"images_per_s=(\S+) graphs=(\d)", line)
        if m:
            extra = dict(re.findall(r"(host_ms|queued_ms)=(\S+)", line))
            out.setdefault(m.group(1), {})[(m.group(2), int(m.group(3)))] = {
                "images_per_s": float(m.group(6)), "ms": float(m.group(5)), "graphs": m.group(7) == "1",
                "precision": m.group(4), "host_ms": float(extra["host_ms"]) if "host_ms" in extra else None,
                "queued_ms": float(extra["queued_ms"]) if "queued_ms" in extra else None}
        elif line.startswith(("FAILED", "NOTE")):
            notes.append(line.strip())
    return out, notes


def read_torch(directory):
    out = {}
    if not directory:
        return out
    for f in glob.glob(os.path.join(directory, "*.json")):
        try:
            r = json.load(open(f))
        except (OSError, ValueError):
            continue
        out[(r["impl"], r["net"], int(r["batch"]))] = r
    return out


def fmt(v):
    return f"{v:,.0f}" if v is not None else "-"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fusedp")
    p.add_argument("--torch-dir")
    p.add_argument("--header", help="file whose lines (date, GPU, commit, ...) head the table")
    p.add_argument("--markdown", help="also write the table here as Markdown")
    a = p.parse_args()
    builds, notes = read_fusedp(a.fusedp)
    mine = sorted(builds, key=lambda i: (i != "fusedp", i)) or ["fusedp"]
    # The ratios and targets take each configuration's faster fusedp build (named in the ratio; the WMMA
    # or the tensor-core layers, not an ablation), at each precision: TF32 against PyTorch's TF32 modes,
    # BF16 (impl ...-bf16) against its bf16 autocast ones.
    ours, ours_bf16 = {}, {}
    for impl in mine:
        if ablation(impl):
            continue
        for key, r in builds.get(impl, {}).items():
            best = ours_bf16 if r["precision"] == "bf16" else ours
            if key not in best or r["images_per_s"] > best[key]["images_per_s"]:
                best[key] = dict(r, impl=impl)
    theirs = read_torch(a.torch_dir)
    header = open(a.header).read().strip().splitlines() if a.header and os.path.exists(a.header) else []

    present = {impl for impl, _, _ in theirs}
    impls = [i for i in TORCH_ORDER if i in present] + sorted(present - set(TORCH_ORDER))
    cols = (["net", "batch"] + [c for i in mine for c in (f"{i} ms", f"{i} img/s")] +
            [i.replace("torch-", "") + " img/s" for i in impls] + ["x fastest tf32", "x fastest bf16"])
    rows = []
    for key in ORDER:
        net, batch = key
        f = ours.get(key)
        row = [net, str(batch)]
        for impl in mine:
            r = builds.get(impl, {}).get(key)
            row += [f"{r['ms']:.3f}" if r else "-", fmt(r["images_per_s"] if r else None)]
        row += [fmt(theirs.get((i, net, batch), {}).get("images_per_s")) for i in impls]
        for bf16 in (False, True):
            best = fastest(theirs, net, batch, bf16)
            # fusedp's BF16 run against PyTorch's bf16 modes where it ran, else its TF32 build.
            mine_here = ours_bf16.get(key, f) if bf16 else f
            who = f"{mine_here['impl']} / " if mine_here and len(mine) > 1 else ""
            row.append(f"{mine_here['images_per_s'] / best[1]:.2f} ({who}{best[0].replace('torch-', '')})"
                       if mine_here and best else "-")
        rows.append(row)

    verdicts = []
    for net, batch, text, check, *precision in TARGETS:
        t = {i: r for (i, n, b), r in theirs.items() if n == net and b == batch}
        ok = check((ours_bf16 if precision == ["bf16"] else ours).get((net, batch)), t)
        verdicts.append(f"{net} {batch}: {text}: " + ("met" if ok else "not met" if ok is not None else "not measured"))

    widths = [max(len(cols[i]), *(len(r[i]) for r in rows)) for i in range(len(cols))]
    lines = header + [""]
    lines.append("  ".join(cols[i].ljust(widths[i]) for i in range(len(cols))))
    for r in rows:
        lines.append("  ".join(r[i].ljust(widths[i]) for i in range(len(cols))))
    lines += ["", "targets (fusedp's faster build, ablations not counted, in TF32 unless the target says BF16 or bf16):"] + [
        "  " + v for v in verdicts]
    graphs = {k: v["graphs"] for k, v in ours.items()}
    if graphs and not all(graphs.values()):
        lines.append("note: some fusedp runs did not replay a CUDA graph: " +
                     ", ".join(f"{k[0]}/{k[1]}" for k, g in graphs.items() if not g))
    # Whether the step time measures the GPU or the host that submits it (train_step_gpu's host_ms and
    # queued_ms): the default build's lines.
    pace = [f"  {net} {batch}: step {r['ms']:.3f} ms as submitted, host {r['host_ms']:.3f} ms to submit it, "
            f"GPU {r['queued_ms']:.3f} ms when queued"
            for (net, batch), r in sorted(builds.get("fusedp", {}).items())
            if r.get("host_ms") is not None and r.get("queued_ms") is not None]
    if pace:
        lines += ["", "host or GPU (fusedp):"] + pace
    lines += notes
    print("\n".join(lines))
    if a.markdown:
        with open(a.markdown, "w") as md:
            md.write("\n".join(header) + "\n\n")
            md.write("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
            for r in rows:
                md.write("| " + " | ".join(r) + " |\n")
            md.write("\nTargets (fusedp's faster build, ablations not counted, in TF32 unless the target says BF16 or "
                     "bf16):\n\n" +
                     "".join(f"- {v}\n" for v in verdicts))
            if pace:
                md.write("\nHost or GPU (fusedp):\n\n" + "".join(f"- {p.strip()}\n" for p in pace))
            for n in notes:
                md.write(f"\n{n}\n")


if __name__ == "__main__":
    main()
