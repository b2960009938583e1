#!/usr/bin/env python3
"""Side by side on the CPU: fusedp's train_step_bench and the same network trained by PyTorch (same
batch, threads, SGD with momentum, cross-entropy, float32), alternating runs so both see the same
machine state. Prints each median and the ratio.

    python3 benchmarks/cpu_vs_torch.py --bench build/ci/benchmarks/train_step_bench --net lenet
"""
import argparse
import os
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
    the CPU has it; not float32, listed for reference)."""
    import contextlib
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    net, shape = torch_net(net_name)
    x = torch.rand(batch, *shape) * 2 - 1
    if mode in ("channels_last", "bf16") and len(shape) == 3:
        net = net.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
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


def fusedp_ms(bench, net_name, batch, threads, steps, warmup):
    out = subprocess.run([bench, "--net", net_name, "--batch", str(batch), "--threads", str(threads),
                          "--steps", str(steps), "--warmup", str(warmup)], check=True, capture_output=True,
                         text=True).stdout
    m = re.search(r"([0-9.]+) ms/step", out)
    if not m:
        sys.exit(f"cpu_vs_torch: unexpected output from {bench}: {out!r}")
    return float(m.group(1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", required=True, help="path of the train_step_bench binary")
    p.add_argument("--net", choices=["lenet", "cifar", "resnet18"], default="lenet")
    p.add_argument("--modes", default="eager", help="PyTorch modes, comma-separated: eager,channels_last,bf16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="timed steps per run (default: 200 lenet, 15 cifar)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    a = p.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("cpu_vs_torch: PyTorch is not importable (Debian: apt-get install python3-torch)")
    steps = a.steps or {"lenet": 200, "cifar": 15, "resnet18": 5}[a.net]
    warmup = max(2, steps // 10)
    modes = [m for m in a.modes.split(",") if m]
    ours, theirs = [], {m: [] for m in modes}
    load_before = os.getloadavg()[0]
    for _ in range(a.rounds):
        ours.append(fusedp_ms(a.bench, a.net, a.batch, a.threads, steps, warmup))
        for m in modes:
            theirs[m].append(torch_ms(a.net, a.batch, a.threads, steps, warmup, m))
    f = statistics.median(ours)
    print(f"CPU: {cpu_model()}, {a.threads} threads; PyTorch {torch.__version__}; {a.net}, batch {a.batch}")
    # Both sides share the machine; a load average above the core count means other processes took
    # part of it (PyTorch's OpenMP threads spin at every barrier and suffer most from that).
    print(f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} CPUs; "
          f"rounds: fusedp {' '.join(f'{x:.3f}' for x in ours)}")
    print(f"{'':22} {'ms/step':>10} {'images/s':>10} {'vs fusedp':>10}")
    print(f"{'fusedp (float32)':22} {f:10.3f} {a.batch / f * 1e3:10.0f}")
    for m in modes:
        t = statistics.median(theirs[m])
        print(f"{'pytorch ' + m:22} {t:10.3f} {a.batch / t * 1e3:10.0f} {t / f:9.2f}x")
    fp32 = [statistics.median(theirs[m]) for m in modes if m != "bf16"]
    if fp32:
        print(f"ratio (fastest PyTorch float32 time / fusedp time): {min(fp32) / f:.2f}x")


if __name__ == "__main__":
    main()
