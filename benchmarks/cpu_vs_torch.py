#!/usr/bin/env python3
"""Side by side on the CPU: fusedp's train_step_bench and the same network trained by PyTorch (same
batch, threads, SGD with momentum, cross-entropy), alternating runs so both see the same machine
state. PyTorch runs in each of its CPU modes: eager (NCHW float32), channels_last (NHWC float32,
oneDNN's layout), bf16 (channels_last under bfloat16 autocast: oneDNN on AMX or AVX-512 BF16 where the
CPU has them) and compile (torch.compile of the channels_last float32 model; its compile time is not
counted). Prints each median, the ratios, and the table last.

The peer is a current PyTorch from PyPI (MKL, oneDNN), not Debian's 1.13: unless --python names an
interpreter, the script runs itself in a virtual environment that it creates on first use
(~/.cache/fusedp-bench/torch-venv, `pip install torch`, a download of several GB).

    python3 benchmarks/cpu_vs_torch.py --bench build/dev/benchmarks/train_step_bench --net lenet
"""
import argparse
import os
import shutil
import platform
import re
import statistics
import subprocess
import sys
import time


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def torch_net(name):
    import torch.nn as nn
    if name == "resnet18":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "torch"))
        from cross_check import CifarResNet  # torchvision's ResNet-18 in the CIFAR form, its names
        return CifarResNet([64, 128, 256, 512], [2, 2, 2, 2]), (3, 32, 32)
    if name == "lenet":
        return nn.Sequential(nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 3), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 60),
                             nn.ReLU(), nn.Linear(60, 10)), (1, 28, 28)
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(8192, 1024), nn.ReLU(), nn.Linear(1024, 10)), (3, 32, 32)


def torch_ms(net_name, batch, threads, steps, warmup, mode="eager"):
    """Median ms of a train step in one of PyTorch's CPU modes: eager (NCHW float32), channels_last
    (NHWC float32, oneDNN's preferred layout), bf16 (channels_last under bfloat16 autocast: AMX where
    the CPU has it), compile (torch.compile of the channels_last float32 model)."""
    import contextlib
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    net, shape = torch_net(net_name)
    x = torch.rand(batch, *shape) * 2 - 1
    if mode in ("channels_last", "bf16", "compile") and len(shape) == 3:
        net = net.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    if mode == "compile":
        net = torch.compile(net)  # compiled during the warm-up steps, which are not timed
    loss_fn = torch.nn.CrossEntropyLoss()
    y = torch.arange(batch) % 10
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode == "bf16" else contextlib.nullcontext
    times = []
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        float(loss)
        t1 = time.perf_counter()
        if s >= warmup:
            times.append((t1 - t0) * 1e3)
    return statistics.median(times)


def fusedp_ms(bench, net_name, batch, threads, steps, warmup, precision):
    out = subprocess.run([bench, "--net", net_name, "--batch", str(batch), "--threads", str(threads),
                          "--steps", str(steps), "--warmup", str(warmup)] +
                         (["--precision", precision] if precision != "fp32" else []), check=True,
                         capture_output=True, text=True).stdout
    m = re.search(r"([0-9.]+) ms/step", out)
    if not m:
        sys.exit(f"cpu_vs_torch: unexpected output from {bench}: {out!r}")
    return float(m.group(1))


VENV = os.path.join(os.path.expanduser("~"), ".cache", "fusedp-bench", "torch-venv")


def reexec_with_current_torch(python):
    """Runs this script again under an interpreter with a current PyTorch: `python` when given, else the
    virtual environment VENV, created (and torch installed from PyPI) on first use."""
    if python is None:
        python = os.path.join(VENV, "bin", "python")
        if not os.path.exists(python):
            print(f"cpu_vs_torch: creating {VENV} and installing torch from PyPI (first use only)", flush=True)
            subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
            subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "torch", "numpy"],
                           check=True)
    if not shutil.which(python) and not os.path.exists(python):
        sys.exit(f"cpu_vs_torch: --python {python}: no such interpreter")
    args = [python, os.path.abspath(__file__)] + [a for a in sys.argv[1:]] + ["--in-venv"]
    os.execv(python, args)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", required=True, help="path of the train_step_bench binary")
    p.add_argument("--net", choices=["lenet", "cifar", "resnet18"], default="lenet")
    p.add_argument("--modes", default="eager,channels_last,bf16,compile",
                   help="PyTorch modes, comma-separated: eager,channels_last,bf16,compile")
    p.add_argument("--precision", default="fp32",
                   help="fusedp precisions, comma-separated: fp32,bf16 (bf16 needs a CPU with AVX-512 BF16 or AMX)")
    p.add_argument("--python", help="an interpreter with a current PyTorch (default: the script's own venv)")
    p.add_argument("--in-venv", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="timed steps per run (default: 200 lenet, 15 cifar)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    a = p.parse_args()
    if not a.in_venv:
        reexec_with_current_torch(a.python)
    import torch
    steps = a.steps or {"lenet": 200, "cifar": 15, "resnet18": 5}[a.net]
    warmup = max(2, steps // 10)
    modes = [m for m in a.modes.split(",") if m]
    precisions = [q for q in a.precision.split(",") if q]
    ours, theirs = {q: [] for q in precisions}, {m: [] for m in modes}
    load_before = os.getloadavg()[0]
    for r in range(a.rounds):
        for q in precisions:
            ours[q].append(fusedp_ms(a.bench, a.net, a.batch, a.threads, steps, warmup, q))
        for m in modes:
            theirs[m].append(torch_ms(a.net, a.batch, a.threads, steps, warmup, m))
        print(f"round {r + 1}: " + ", ".join([f"fusedp {q} {ours[q][-1]:.3f}" for q in precisions] +
                                             [f"{m} {theirs[m][-1]:.3f}" for m in modes]) + " ms", flush=True)
    # Both sides share the machine; a load average above the core count means other processes took
    # part of it (PyTorch's OpenMP threads spin at every barrier and suffer most from that).
    print(f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} CPUs")
    print(f"CPU: {cpu_model()}, {a.threads} threads; PyTorch {torch.__version__}; {a.net}, batch {a.batch}; "
          f"median of {a.rounds} rounds, each the median of {steps} steps")
    print(f"{'':24} {'ms/step':>10} {'images/s':>10} {'vs fusedp ' + precisions[0]:>16}")
    base = statistics.median(ours[precisions[0]])
    rows = [(f"fusedp {q}", statistics.median(ours[q])) for q in precisions]
    rows += [(f"pytorch {m}", statistics.median(theirs[m])) for m in modes]
    for name, t in rows:
        print(f"{name:24} {t:10.3f} {a.batch / t * 1e3:10.0f} {t / base:15.2f}x")
    fp32 = [statistics.median(theirs[m]) for m in modes if m != "bf16"]
    for q in precisions:
        same = fp32 if q == "fp32" else [statistics.median(theirs[m]) for m in modes if m == "bf16"]
        if same:
            # Paired within each round too: the machine's speed drifts between rounds, and a ratio of
            # two medians can pair a fast round of one side with a slow round of the other.
            group = [m for m in modes if (m != "bf16") == (q == "fp32")]
            paired = statistics.median(min(theirs[m][r] for m in group) / ours[q][r] for r in range(a.rounds))
            print(f"fusedp {q}: the fastest PyTorch {'float32' if q == 'fp32' else 'bf16'} mode takes "
                  f"{min(same) / statistics.median(ours[q]):.2f}x its time (median of the rounds' own ratios: "
                  f"{paired:.2f}x)")


if __name__ == "__main__":
    main()
