#!/usr/bin/env python3
"""Per-kernel times and DRAM bytes of one fusedp training step, from Nsight Compute's CSV.

benchmarks/gpu/check.sh runs, where ncu exists,

    ncu --clock-control none --cache-control none --csv --page raw --print-kernel-base function \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        train_step_gpu --net lenet --batch 128 --steps 3 --warmup 2 > ncu_lenet.csv

(the card's clocks left alone, the L2 left as the step leaves it) and this prints the kernels of the
last step (one loss kernel a step: the kernels between the last two loss kernels are a step's count):
each kernel's time and DRAM bytes, their sums, and
  - with --step-ms (the step's median from train_step_gpu without the profiler) the time between
    kernels: launch latency, ramps and tails, what programmatic dependent launch and fewer launches
    can take away;
  - with --floor-mb (the step's fused minimum, which train_step_gpu prints as floor_mb from the type:
    CostModel::step_traffic_floor, the arithmetic of benchmarks/RESULTS.md's session 21) the measured
    traffic as a multiple of it (issue 17's target: within 1.5x).
Writes that are still in L2 when a kernel ends reach DRAM later, outside any kernel's count, so the
write bytes can fall short of what the step writes.
"""
import argparse
import csv
import sys

UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}


BYTES = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def read(path):
    """[(kernel, us, bytes read, bytes written)] in launch order (bytes None where not measured)."""
    rows = list(csv.reader(line for line in open(path, errors="replace") if line.startswith('"')))
    if not rows:
        return []
    head = rows[0]
    try:
        name_col, time_col = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
    except ValueError:
        return []
    byte_cols = [head.index(m) if m in head else None for m in ("dram__bytes_read.sum", "dram__bytes_write.sum")]
    scale, byte_scale, out = 1e-3, [1.0, 1.0], []

    def number(text):
        return float(text.replace(",", ""))

    for r in rows[1:]:
        if len(r) <= max(name_col, time_col):
            continue
        if not r[0].strip():  # the units row
            scale = UNITS.get(r[time_col].strip(), scale)
            byte_scale = [BYTES.get(r[c].strip(), 1.0) if c is not None else 1.0 for c in byte_cols]
            continue
        try:
            t = number(r[time_col]) * scale
            b = [number(r[c]) * byte_scale[i] if c is not None and c < len(r) else None
                 for i, c in enumerate(byte_cols)]
        except ValueError:
            continue
        out.append((r[name_col], t, b[0], b[1]))
    return out


def last_step(kernels):
    """The kernels of the last step: as many as lie between the last two loss kernels (one a step), taken
    from the end (the program ends with the last step's backward)."""
    losses = [i for i, k in enumerate(kernels) if k[0].startswith(("loss_rows_kernel", "squared_error_kernel"))]
    if len(losses) >= 2:
        return kernels[-(losses[-1] - losses[-2]):]
    return kernels


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--net", default="?")
    p.add_argument("--step-ms", type=float, help="the step's median time without the profiler")
    p.add_argument("--floor-mb", type=float, help="the step's fused minimum DRAM traffic (train_step_gpu's floor_mb)")
    p.add_argument("--top", type=int, default=0,
                   help="list the N kernel functions with the most time in the step (their launches added up) "
                        "instead of every launch: for networks of hundreds of launches (ResNet-18)")
    a = p.parse_args()
    kernels = read(a.csv)
    if not kernels:
        print(f"kernel times {a.net}: no kernels in {a.csv} (did ncu run? see the file)")
        return 1
    step = last_step(kernels)
    if len(step) == len(kernels):
        print(f"kernel times {a.net}: NOTE: fewer than two loss kernels among the {len(kernels)} profiled, so the "
              "sums below cover every profiled kernel (several steps), not one step")
    total = sum(k[1] for k in step)
    measured = all(k[2] is not None and k[3] is not None for k in step)
    if not measured:
        print(f"kernel times {a.net}: NOTE: ncu gave no DRAM bytes for some kernels: no traffic figure")
    rows = [(name, t, r, w, 1) for name, t, r, w in step]
    if a.top:
        by_name = {}
        for name, t, r, w, _ in rows:
            s = by_name.setdefault(name, [0.0, 0.0, 0.0, 0])
            s[0] += t
            s[1] += r or 0.0
            s[2] += w or 0.0
            s[3] += 1
        rows = sorted(((n, v[0], v[1], v[2], v[3]) for n, v in by_name.items()), key=lambda x: -x[1])[:a.top]
    for name, t, r, w, n in rows:
        traffic = f"  {r / 1e6:8.2f} MB read {w / 1e6:8.2f} MB written" if measured else ""
        launches = f" x{n:<3d}" if a.top else ""
        print(f"  {t:9.2f} us{launches}{traffic}  {name[:90]}")
    line = f"kernel times {a.net}: {len(step)} kernels, {total:.1f} us of kernel time per step"
    if a.step_ms:
        gap = a.step_ms * 1e3 - total
        line += f"; step {a.step_ms * 1e3:.1f} us, so {gap:.1f} us between kernels ({gap / max(len(step), 1):.1f} per kernel)"
    print(line)
    if measured:
        read_mb, write_mb = sum(k[2] for k in step) / 1e6, sum(k[3] for k in step) / 1e6
        line = f"dram traffic {a.net}: {read_mb:.1f} MB read + {write_mb:.1f} MB written = {read_mb + write_mb:.1f} MB per step"
        if a.floor_mb:
            line += f", {(read_mb + write_mb) / a.floor_mb:.2f}x the fused minimum of {a.floor_mb:.1f} MB (target <= 1.5x)"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
