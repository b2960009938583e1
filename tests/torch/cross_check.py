#!/usr/bin/python3
"""Cross-checks fusedp's Host space against PyTorch's CPU build.

    cross_check.py TORCH_DUMP --net lenet|cifar|resblock|resnet18 [--seed N] [--batch N] [--threads N] [--tol T] [--keep DIR]

Runs the torch_dump program (tests/torch/torch_dump.cpp), which builds the network in fusedp, draws a
batch, computes logits, the mean cross-entropy and every parameter gradient, then takes 3 SGD steps
(lr 0.05, momentum 0.9) on the same batch. This script builds the same nn.Sequential, loads fusedp's
initial weights and repeats all of it in float32 (the reference the tolerance applies to) and in
float64 (to show the float32 noise floor). Every tensor is compared by the norm-relative error
||fusedp - torch|| / ||torch||; the largest elementwise difference is reported beside it.

Exit status: 0 when everything is within tolerance, 1 on a mismatch or a failed dump, 2 on bad
arguments, 77 when PyTorch cannot be imported (ctest counts that as skipped).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

SKIP = 77

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"cross_check.py: SKIPPED: cannot import PyTorch with {sys.executable} ({e}); "
          "install Debian's python3-torch to run the torch cross-checks", file=sys.stderr)
    sys.exit(SKIP)
# The models below need only PyTorch (benchmarks/gpu/torch_bench.py imports CifarResNet on machines whose
# PyTorch wheel came without NumPy); the cross-checks need NumPy too, and main() skips without it.
try:
    import numpy as np
except ImportError as e:  # pragma: no cover - depends on the machine
    np = None
    NUMPY_MISSING = str(e)


class BasicBlock(nn.Module):
    """torchvision's BasicBlock, with its names (conv1, bn1, conv2, bn2, downsample)."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, 0, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class CifarResNet(nn.Module):
    """torchvision's ResNet with a 3x3 stride-1 stem and no max-pool (the CIFAR form)."""

    def __init__(self, widths, blocks, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        cin = widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks)):
            layers = []
            for b in range(n):
                layers.append(BasicBlock(cin, w, 2 if (i > 0 and b == 0) else 1))
                cin = w
            setattr(self, f"layer{i + 1}", nn.Sequential(*layers))
        self.stages = len(widths)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        for i in range(self.stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build(net):
    """The module that mirrors fusedp's network; its state_dict keys are fusedp's tensor names."""
    if net == "resnet18":
        return CifarResNet([64, 128, 256, 512], [2, 2, 2, 2])
    if net == "resblock":
        return CifarResNet([4, 8], [1, 1])
    if net == "lenet":
        return nn.Sequential(
            nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 60), nn.ReLU(), nn.Linear(60, 10))
    if net == "cifar":
        return nn.Sequential(
            nn.Conv2d(3, 64, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(128 * 8 * 8, 1024), nn.ReLU(), nn.Linear(1024, 10))
    raise ValueError(net)


def load(directory, entry, dtype):
    path = os.path.join(directory, entry["file"] if isinstance(entry, dict) else entry)
    data = np.fromfile(path, dtype=np.dtype(dtype).newbyteorder("<"))
    return data


def rel_err(a, b):
    """||a - b|| / ||b|| in float64 (0 when both are 0), and max |a - b|."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        return math.inf, math.inf
    diff = np.linalg.norm(a - b)
    norm = np.linalg.norm(b)
    if not np.all(np.isfinite(a)):
        return math.inf, math.inf
    rel = 0.0 if diff == 0 else (diff / norm if norm > 0 else math.inf)
    return float(rel), float(np.max(np.abs(a - b))) if a.size else 0.0


def run_torch(model, x, labels, dtype, lr, momentum, steps):
    """Logits, loss and gradients of the mean loss, then `steps` SGD steps: the losses and parameters."""
    model = model.to(dtype)
    x = x.to(dtype)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    model.zero_grad()
    loss = loss_fn(model(x), labels)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    # fusedp's predict() is evaluation mode (BatchNorm's running statistics; the same as training
    # for networks without BatchNorm).
    model.eval()
    with torch.no_grad():
        logits = model(x)
    model.train()
    out = {"logits": logits.detach().clone(), "loss": loss.item(), "grads": grads}
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(x), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["train_losses"] = losses
    out["after"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["buffers"] = {n: b.detach().clone().to(torch.float64) for n, b in model.named_buffers()}
    model.eval()
    with torch.no_grad():
        out["eval_logits"] = model(x).detach().clone()
    return out


def main():
    if np is None:
        print(f"cross_check.py: SKIPPED: cannot import NumPy with {sys.executable} ({NUMPY_MISSING})", file=sys.stderr)
        return SKIP
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump", help="path of the torch_dump executable")
    ap.add_argument("--net", required=True, choices=["lenet", "cifar", "resblock", "resnet18"])
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="fusedp Host threads (torch always uses 2)")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest norm-relative error allowed")
    ap.add_argument("--step-tol", type=float, default=1e-3,
                    help="largest norm-relative error allowed in each parameter's change over the SGD steps")
    ap.add_argument("--precision", choices=["f32", "f64"], default="f32",
                    help="fusedp's scalar type; f64 (resnet18) is held against torch float64 with --tol64")
    ap.add_argument("--tol64", type=float, default=1e-10,
                    help="with --precision f64: the largest norm-relative error against torch float64")
    ap.add_argument("--keep", help="write the dump here and keep it (default: a temporary folder)")
    args = ap.parse_args()

    torch.set_num_threads(2)
    if not os.access(args.dump, os.X_OK):
        print(f"cross_check.py: FAIL: {args.dump} is not an executable (build the torch_dump target)",
              file=sys.stderr)
        return 1

    with tempfile.TemporaryDirectory(prefix=f"fusedp_torch_{args.net}_") as tmp:
        out = args.keep or tmp
        cmd = [args.dump, "--net", args.net, "--out", out, "--seed", str(args.seed),
               "--batch", str(args.batch), "--threads", str(args.threads), "--steps", "3"]
        if args.precision == "f64":
            cmd += ["--precision", "f64"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        sys.stdout.write(r.stdout)
        if r.returncode != 0:
            sys.stderr.write(r.stderr)
            print(f"cross_check.py: FAIL: {' '.join(cmd)} exited with {r.returncode}", file=sys.stderr)
            return 1
        try:
            return compare(out, args)
        except (OSError, ValueError, KeyError) as e:
            print(f"cross_check.py: FAIL: the dump in {out} is incomplete or malformed: {e!r}", file=sys.stderr)
            return 1


def compare(out, args):
    with open(os.path.join(out, "manifest.json")) as f:
        m = json.load(f)
    batch = m["batch"]
    x = torch.from_numpy(load(out, m["input"], np.float32).reshape(m["input"]["dims"]).copy())
    labels = torch.from_numpy(load(out, m["labels"], np.int32).astype(np.int64))
    fdt = np.float64 if m.get("dtype") == "float64" else np.float32  # fusedp's tensors
    if fdt == np.float64:
        # Double on both sides: no float32 rounding, so no ReLU decision flips between the two
        # (a deep float32 network has pre-activations within 1e-5 of zero, and a flip there moves every
        # gradient below it by more than any float32 tolerance). Only torch float64 is the reference.
        args.tol = args.step_tol = args.tol64
    fd_logits = load(out, m["logits"], fdt).reshape(m["logits"]["dims"])
    lr, momentum, steps = m["sgd"]["lr"], m["sgd"]["momentum"], m["sgd"]["steps"]
    # The options were float32 in fusedp; torch keeps Python floats. Round them the same way.
    lr, momentum = float(np.float32(lr)), float(np.float32(momentum))

    problems = []
    model = build(args.net)
    state = model.state_dict()
    names = [p["name"] for p in m["params"]]
    buffer_names = [b["name"] for b in m.get("buffers", [])]
    if sorted(names + buffer_names) != sorted(state.keys()):
        problems.append(f"tensor names differ: fusedp {names + buffer_names}, torch {list(state.keys())}")
        print("\n".join(problems), file=sys.stderr)
        return 1
    fd_params, fd_grads, fd_after = {}, {}, {}
    init_ok = True
    for p in m["params"]:
        name, dims = p["name"], p["dims"]
        if list(state[name].shape) != dims:
            problems.append(f"{name}: fusedp dims {dims}, torch {list(state[name].shape)}")
            continue
        fd_params[name] = load(out, p["param"], fdt).reshape(dims)
        fd_grads[name] = load(out, p["grad"], fdt).reshape(dims)
        fd_after[name] = load(out, p["after"], fdt).reshape(dims)
        if p.get("constant"):  # BatchNorm: weight 1, bias 0, as PyTorch starts them
            want = state[name].numpy()
            if not np.array_equal(fd_params[name], want):
                problems.append(f"{name}: initial values differ from PyTorch's constant start")
                init_ok = False
            continue
        # PyTorch's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias alike.
        weight_dims = state[name.rsplit(".", 1)[0] + ".weight"].shape
        bound = 1.0 / math.sqrt(int(np.prod(weight_dims[1:])))
        peak = float(np.max(np.abs(fd_params[name])))
        if peak > bound * (1 + 1e-6) or (fd_params[name].size >= 100 and peak < 0.9 * bound):
            problems.append(f"{name}: initial values peak at {peak:.4g}, PyTorch's default init has bound {bound:.4g}")
            init_ok = False
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    initial = {n: torch.from_numpy(v.copy()) for n, v in fd_params.items()}
    m32, m64 = build(args.net), build(args.net).double()  # float64 weights stay unrounded
    m32.load_state_dict(initial, strict=False)  # buffers start as PyTorch's own (mean 0, var 1)
    m64.load_state_dict(initial, strict=False)
    ref32 = run_torch(m32, x, labels, torch.float32, lr, momentum, steps)
    ref64 = run_torch(m64, x, labels, torch.float64, lr, momentum, steps)

    rows = []  # (quantity, fusedp, torch32, torch64, initial parameters or None, is a scalar loss)

    def add(what, fd, t32, t64, start=None, scalar=False):
        rows.append((what, fd, t32, t64, start, scalar))

    add("logits", fd_logits, ref32["logits"].numpy(), ref64["logits"].numpy())
    add("loss", fdt(m["loss"]), np.float64(ref32["loss"]), np.float64(ref64["loss"]), scalar=True)
    for n in names:
        add(f"grad {n}", fd_grads[n], ref32["grads"][n].numpy(), ref64["grads"][n].numpy())
    fd_losses = m["train_losses"]
    if any(v is None for v in fd_losses) or len(fd_losses) != steps:
        problems.append(f"train losses from fusedp are {fd_losses}, expected {steps} finite values")
    else:
        for s in range(steps):
            add(f"sgd loss {s + 1}", np.float64(fd_losses[s]), np.float64(ref32["train_losses"][s]),
                np.float64(ref64["train_losses"][s]), scalar=True)
    for n in names:
        add(f"sgd {steps} {n}", fd_after[n], ref32["after"][n].numpy(), ref64["after"][n].numpy(), fd_params[n])
    for b in m.get("buffers", []):
        n = b["name"]
        fd = load(out, b["file"], fdt).reshape(b["dims"])
        add(f"buffer {n}", fd, ref32["buffers"][n].numpy(), ref64["buffers"][n].numpy())
    if "eval_logits" in m:
        add(f"eval logits {steps}", load(out, m["eval_logits"], fdt).reshape(m["eval_logits"]["dims"]),
            ref32["eval_logits"].numpy(), ref64["eval_logits"].numpy())

    print(f"\nfusedp Host vs PyTorch {torch.__version__} CPU: {args.net}, batch {batch}, seed {m['seed']}, "
          f"fusedp threads {m['threads']}, torch threads {torch.get_num_threads()}")
    print("rel = ||a - b|| / ||b|| (for a loss |a - b| / max(|b|, 1)); maxabs = max |a - b|;")
    print("fd = fusedp (float32), t32 = torch float32, t64 = torch float64 from the same float32 weights;")
    print("step32/step64 = rel of the change from the initial parameters over the SGD steps.")
    print(f"A quantity passes when rel(fd,t32) <= {args.tol:g}, or rel(fd,t64) <= {args.tol:g} (torch float32")
    print(f"itself is off); an SGD change passes when step32 or step64 <= {args.step_tol:g}.\n")
    header = (f"{'quantity':<20} {'rel(fd,t32)':>11} {'maxabs':>9} {'rel(t32,t64)':>12} {'rel(fd,t64)':>11} "
              f"{'step32':>9} {'step64':>9}  status")
    print(header)
    print("-" * len(header))
    worst = worst_floor = worst64 = 0.0
    for what, fd, t32, t64, start, scalar in rows:
        if scalar:
            fd, t32, t64 = float(fd), float(t32), float(t64)
            ok_fd = math.isfinite(fd)
            rel = abs(fd - t32) / max(abs(t32), 1.0) if ok_fd else math.inf
            maxabs = abs(fd - t32) if ok_fd else math.inf
            floor = abs(t32 - t64) / max(abs(t64), 1.0)
            rel64 = abs(fd - t64) / max(abs(t64), 1.0) if ok_fd else math.inf
        else:
            rel, maxabs = rel_err(fd, t32)
            floor, _ = rel_err(t32, t64)
            rel64, _ = rel_err(fd, t64)
        worst, worst_floor, worst64 = max(worst, rel), max(worst_floor, floor), max(worst64, rel64)
        if fdt == np.float64:
            status = "ok (t64)" if rel64 <= args.tol else "FAIL"
        else:
            status = "ok" if rel <= args.tol else ("ok (t64)" if rel64 <= args.tol else "FAIL")
        if status == "FAIL":
            problems.append(f"{what}: rel error {rel:.3e} > {args.tol:g} against torch float32 (max abs {maxabs:.3e}) "
                            f"and {rel64:.3e} against float64; torch float32 vs float64 is {floor:.3e}")
        step32 = step64 = ""
        if start is not None:
            moved = np.asarray(fd, np.float64) - start
            s32, _ = rel_err(moved, np.asarray(t32, np.float64) - start)
            s64, _ = rel_err(moved, np.asarray(t64, np.float64) - start)
            step32, step64 = f"{s32:9.2e}", f"{s64:9.2e}"
            if not (s64 <= args.step_tol or (fdt == np.float32 and s32 <= args.step_tol)):
                status = "FAIL"
                problems.append(f"{what}: the change over the SGD steps has rel error {s32:.3e} against torch "
                                f"float32 and {s64:.3e} against float64 (> {args.step_tol:g})")
        print(f"{what:<20} {rel:11.2e} {maxabs:9.2e} {floor:12.2e} {rel64:11.2e} {step32:>9} {step64:>9}  {status}")
    print(f"\nworst rel(fusedp, torch32) = {worst:.2e}; worst rel(fusedp, torch64) = {worst64:.2e}; "
          f"float32 noise floor (worst rel(torch32, torch64)) = {worst_floor:.2e}")
    print(f"initial values within PyTorch's default init bounds: {'yes' if init_ok else 'no'}")
    if problems:
        print(f"\ncross_check.py: FAIL ({args.net}): fusedp disagrees with PyTorch:", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        return 1
    print(f"cross_check.py: PASS ({args.net}): {len(rows)} quantities within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
