#!/usr/bin/env python3
"""Per-kernel times of one fusedp training step, from Nsight Compute's CSV.

benchmarks/gpu/check.sh runs, where ncu exists,

    ncu --metrics gpu__time_duration.sum --csv --page raw --print-kernel-base function \\
        train_step_gpu --net lenet --batch 128 --steps 3 --warmup 2 > ncu_lenet.csv

and this prints the kernels of the last whole step (each step begins with set_value_kernel, which
writes the step's optimizer numbers before the graph runs), each kernel's time, their sum, and the
median step time train_step_gpu measured without the profiler when given (--step-ms): the difference
is what the step spends between kernels (launch latency, ramps and tails), what programmatic
dependent launch and fewer launches can take away (issue 17).
"""
import argparse
import csv
import sys

UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}


def read(path):
    rows = list(csv.reader(line for line in open(path, errors="replace") if line.startswith('"')))
    if not rows:
        return []
    head = rows[0]
    try:
        name_col, time_col = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
    except ValueError:
        return []
    scale, out = 1e-3, []
    for r in rows[1:]:
        if len(r) <= max(name_col, time_col):
            continue
        if not r[0].strip():  # the units row
            scale = UNITS.get(r[time_col].strip(), scale)
            continue
        try:
            out.append((r[name_col], float(r[time_col].replace(",", "")) * scale))
        except ValueError:
            continue
    return out


def last_step(kernels):
    starts = [i for i, (name, _) in enumerate(kernels) if name.startswith("set_value_kernel")]
    return kernels[starts[-1] + 1:] if starts else kernels


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--net", default="?")
    p.add_argument("--step-ms", type=float, help="the step's median time without the profiler")
    a = p.parse_args()
    kernels = read(a.csv)
    if not kernels:
        print(f"kernel times {a.net}: no kernels in {a.csv} (did ncu run? see the file)")
        return 1
    step = last_step(kernels)
    total = sum(t for _, t in step)
    for name, t in step:
        print(f"  {t:9.2f} us  {name[:100]}")
    line = f"kernel times {a.net}: {len(step)} kernels, {total:.1f} us of kernel time per step"
    if a.step_ms:
        gap = a.step_ms * 1e3 - total
        line += f"; step {a.step_ms * 1e3:.1f} us, so {gap:.1f} us between kernels ({gap / max(len(step), 1):.1f} per kernel)"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
