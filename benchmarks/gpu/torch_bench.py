#!/usr/bin/env python3
"""The PyTorch side of benchmarks/gpu/check.sh: one network, one batch size, one mode and precision, the
same train step as fusedp's (forward, loss, backward, SGD with momentum 0.9, lr 0.01; data on the
device; no loss read per step). Timing: CUDA events around each step on the current stream, warm-up
first, median of the timed steps.

Modes, PyTorch's strongest included:
  eager      the step as written
  graph      the eager step captured whole in one CUDA graph (torch.cuda.graph: forward, loss, backward
             and the optimizer, static input and target), replayed each step
  compile    torch.compile(model) in --compile-mode (default "default")
  autotune   torch.compile(model, mode="max-autotune"): Triton templates chosen by timing, CUDA graphs
Precisions: tf32 (fp32 storage, TF32 allowed for matmuls and convolutions, as fusedp's default) and bf16
(the same under torch.autocast(dtype=torch.bfloat16): bf16 matmuls and convolutions, fp32 weights).

To overlap torch.compile's compilation with the nvcc build, the script can prepare and warm up, then
wait for a "go" file before timing (so nothing else uses the GPU or the CPU while it measures):

    torch_bench.py --net lenet --batch 128 --mode autotune --precision bf16 --ready R --go G --out result.json

--device cpu runs the eager and compile modes on the CPU (bf16 autocast there too): a dry run of the
script where no GPU is.
"""
import argparse
import json
import os
import statistics
import sys
import time


def build(net, batch, device):
    import torch
    import torch.nn as nn
    g = torch.Generator(device="cpu").manual_seed(1)
    if net == "lenet":
        model = nn.Sequential(nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 3), nn.ReLU(),
                              nn.MaxPool2d(2), nn.Flatten(), nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 60),
                              nn.ReLU(), nn.Linear(60, 10))
        x = torch.rand(batch, 1, 28, 28, generator=g) * 2 - 1
        y = torch.arange(batch) % 10
        loss = nn.CrossEntropyLoss()
    elif net == "cifar":
        model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                              nn.Linear(8192, 1024), nn.ReLU(), nn.Linear(1024, 10))
        x = torch.rand(batch, 3, 32, 32, generator=g) * 2 - 1
        y = torch.arange(batch) % 10
        loss = nn.CrossEntropyLoss()
    elif net == "resnet18":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "torch"))
        from cross_check import CifarResNet  # torchvision's ResNet-18, CIFAR form
        model = CifarResNet([64, 128, 256, 512], [2, 2, 2, 2])
        x = torch.rand(batch, 3, 32, 32, generator=g) * 2 - 1
        y = torch.arange(batch) % 10
        loss = nn.CrossEntropyLoss()
    elif net in ("mlp64", "mlp128"):
        w = 64 if net == "mlp64" else 128
        layers = []
        for _ in range(5):
            layers += [nn.Linear(w, w), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(w, w))
        x = torch.rand(batch, w, generator=g) * 2 - 1
        y = torch.rand(batch, w, generator=g)
        loss = nn.MSELoss()
    else:
        sys.exit(f"torch_bench: unknown net {net}")
    return model.to(device), x.to(device), y.to(device), loss


def wait_for(path, timeout):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"torch_bench: gave up waiting for {path}")
        time.sleep(0.05)


def impl_name(mode, precision, compile_mode):
    """The name report.py files a result under: torch-<mode>[-<compile mode>][-bf16]."""
    name = "torch-" + mode
    if mode == "compile" and compile_mode != "default":
        name += "-" + compile_mode
    return name + ("-bf16" if precision == "bf16" else "")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--net", required=True, choices=["lenet", "cifar", "mlp64", "mlp128", "resnet18"])
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--mode", choices=["eager", "graph", "compile", "autotune"], default="eager")
    p.add_argument("--precision", choices=["tf32", "bf16"], default="tf32")
    p.add_argument("--compile-mode", default="default", help="torch.compile mode of --mode compile")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--ready", help="file to create when warmed up")
    p.add_argument("--go", help="file to wait for before timing")
    p.add_argument("--wait", type=float, default=900, help="seconds to wait for --go")
    p.add_argument("--out", help="JSON result file (default: print)")
    a = p.parse_args()
    if a.steps < 1:
        sys.exit("torch_bench: --steps must be at least 1")

    import contextlib
    import torch
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("torch_bench: torch.cuda is not available")
    if not cuda and a.mode in ("graph", "autotune"):
        sys.exit(f"torch_bench: --mode {a.mode} needs --device cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model, x, y, loss_fn = build(a.net, a.batch, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if a.mode == "compile":
        forward = torch.compile(model, mode=a.compile_mode)
    elif a.mode == "autotune":
        forward = torch.compile(model, mode="max-autotune")
    else:
        forward = model

    def autocast():
        if a.precision == "bf16":
            # a captured graph must not replay autocast's cached casts of the weights (they change)
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=a.mode != "graph")
        return contextlib.nullcontext()

    def forward_backward_update():
        with autocast():
            loss = loss_fn(forward(x), y)
        loss.backward()
        opt.step()
        return loss

    def eager_step():
        opt.zero_grad(set_to_none=True)
        return forward_backward_update()

    step = eager_step
    t0 = time.monotonic()
    if a.mode == "graph":
        # PyTorch's whole-network capture (its CUDA graphs notes): warm up on a side stream (the
        # momentum buffers and cuDNN's algorithms exist before capture), set the gradients to None so
        # backward allocates them from the graph's pool and writes rather than adds, capture forward,
        # backward and the update; each timed step is one replay.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(a.warmup, 3)):
                eager_step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            captured_loss = forward_backward_update()

        def step():
            graph.replay()
            return captured_loss

    for _ in range(max(a.warmup, 3)):  # the first calls compile (torch.compile) or pick algorithms (cudnn)
        step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    warm_s = time.monotonic() - t0
    if a.ready:
        open(a.ready, "w").close()
    if a.go:
        wait_for(a.go, a.wait)
        for _ in range(3):  # back from waiting: one more warm step set
            step()
        sync()

    if cuda:
        stream = torch.cuda.current_stream()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(a.steps)]
        stops = [torch.cuda.Event(enable_timing=True) for _ in range(a.steps)]
        for i in range(a.steps):
            starts[i].record(stream)
            loss = step()
            stops[i].record(stream)
        torch.cuda.synchronize()
        ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, stops))
    else:
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            loss = step()
            times.append((time.perf_counter() - t) * 1e3)
        ms = statistics.median(times)
    result = {"impl": impl_name(a.mode, a.precision, a.compile_mode), "net": a.net, "batch": a.batch,
              "mode": a.mode, "precision": a.precision, "device": a.device, "median_ms": ms,
              "images_per_s": a.batch / (ms * 1e-3), "loss": float(loss), "warmup_s": warm_s,
              "torch": torch.__version__, "compile_mode": a.compile_mode if a.mode == "compile" else
              ("max-autotune" if a.mode == "autotune" else None)}
    text = json.dumps(result)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
