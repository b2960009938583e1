#!/usr/bin/python3
"""Checks fusedp's weights files against PyTorch, both ways.

    checkpoint_torch.py CHECKPOINT_DUMP --net lenet|cifar|resnet18 [--tol T] [--keep DIR]

1. fusedp -> PyTorch: checkpoint_dump (tests/torch/checkpoint_dump.cpp) trains 2 steps and saves the
   weights with fusedp::train::save_weights. This script reads the safetensors file with the few lines
   of struct + json below (and, where the `safetensors` package is importable, with it too, which must
   agree), loads it with load_state_dict(strict=True) into the equivalent nn.Sequential, and
   reproduces fusedp's logits on fusedp's input.
2. PyTorch -> fusedp: a torch model trained 3 SGD steps from torch.manual_seed is saved as safetensors
   (by the writer below, and by the `safetensors` package where present); checkpoint_dump loads it with
   fusedp::train::load_weights and its logits must match torch's.
3. A torch file of another network (wrong shapes) must be refused by fusedp with exit code 1 and a
   message naming the file and the tensor.
4. (resnet18) A torch file without one BatchNorm running statistic is refused, naming the tensor.

resnet18 is torchvision's ResNet-18 in its CIFAR form (cross_check.CifarResNet, torchvision's names):
its BatchNorm buffers (running_mean, running_var, num_batches_tracked) travel with the weights, and the
logits compared are evaluation-mode logits, which use them.

Logits are compared by the norm-relative error ||fusedp - torch|| / ||torch|| <= tol (1e-5: the
same float32 math, summed in another order). Exit status: 0 pass, 1 mismatch or failure, 2 bad
arguments, 77 when PyTorch cannot be imported (ctest: skipped).
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

SKIP = 77

try:
    import numpy as np
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"checkpoint_torch.py: SKIPPED: cannot import PyTorch/NumPy with {sys.executable} ({e}); "
          "install Debian's python3-torch to run the torch checks", file=sys.stderr)
    sys.exit(SKIP)

try:  # optional: the reference implementation, to check the format against it
    import safetensors.torch as st
except ImportError:
    st = None


def build(net):
    """The module equal to fusedp's network; state_dict keys are fusedp's tensor names."""
    if net == "resnet18":
        from cross_check import CifarResNet  # beside this script
        return CifarResNet([64, 128, 256, 512], [2, 2, 2, 2])
    if net == "lenet":
        return nn.Sequential(
            nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 60), nn.ReLU(), nn.Linear(60, 10))
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(128 * 8 * 8, 1024), nn.ReLU(), nn.Linear(1024, 10))


INPUT_SHAPE = {"lenet": (1, 28, 28), "cifar": (3, 32, 32), "resnet18": (3, 32, 32)}


def read_safetensors(path):
    """Tensors and metadata of a safetensors file: 8-byte little-endian header length, JSON, data."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, entry in header.items():
        assert entry["dtype"] in ("F32", "I64"), f"{path}: {name} has dtype {entry['dtype']}"
        begin, end = entry["data_offsets"]
        values = np.frombuffer(data[8 + n + begin:8 + n + end],
                               dtype="<f4" if entry["dtype"] == "F32" else "<i8").copy()
        tensors[name] = torch.from_numpy(values).reshape(entry["shape"])
    return tensors, metadata


def write_safetensors(path, tensors, metadata=None):
    """The inverse of read_safetensors, laid out as the reference writer does (header padded to 8).
    Integer tensors (BatchNorm's num_batches_tracked) stay I64, as PyTorch holds them."""
    header = {"__metadata__": metadata} if metadata else {}
    blobs, offset = [], 0
    for name, t in tensors.items():
        integer = t.dtype == torch.int64
        blob = t.detach().contiguous().numpy().astype("<i8" if integer else "<f4").tobytes()
        header[name] = {"dtype": "I64" if integer else "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_f32(path, shape):
    return torch.from_numpy(np.fromfile(path, dtype="<f4")).reshape(shape)


def rel_err(a, b):
    a = a.double().flatten()
    b = b.double().flatten()
    if a.shape != b.shape:
        return float("inf")
    norm = torch.linalg.norm(b).item()
    diff = torch.linalg.norm(a - b).item()
    return 0.0 if diff == 0 else diff / norm if norm > 0 else float("inf")


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dump", help="path of the checkpoint_dump program")
    parser.add_argument("--net", choices=["lenet", "cifar", "resnet18"], required=True)
    parser.add_argument("--tol", type=float, default=1e-5)
    parser.add_argument("--keep", help="write the files here and keep them (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        return check(args, args.keep)
    with tempfile.TemporaryDirectory(prefix="fusedp_ckpt_torch_") as d:
        return check(args, d)


def check(args, d):
    failures = []

    def report(what, err):
        ok = err <= args.tol
        print(f"  {what:<58} rel err {err:.2e}  {'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append(what)

    # 1. fusedp -> PyTorch
    rc, out = run([args.dump, "export", "--net", args.net, "--out", d, "--seed", "7", "--batch", "4"])
    if rc != 0:
        print(f"checkpoint_dump export failed ({rc}):\n{out}", file=sys.stderr)
        return 1
    weights = os.path.join(d, "fusedp.safetensors")
    tensors, metadata = read_safetensors(weights)
    print(f"{args.net}: {weights}: {len(tensors)} tensors, metadata {metadata}")
    for key in ("fusedp.version", "fusedp.fingerprint", "fusedp.crc32"):
        if key not in metadata:
            failures.append(f"metadata lacks {key}")
    if st is not None:
        reference = st.load_file(weights)
        same = reference.keys() == tensors.keys() and all(torch.equal(reference[k], tensors[k]) for k in tensors)
        print(f"  safetensors package reads the same tensors: {same}")
        if not same:
            failures.append("safetensors package disagrees with the struct reader")
    else:
        print("  (the safetensors package is not installed; the struct reader alone checks the layout)")
    model = build(args.net)
    model.load_state_dict(tensors, strict=True)
    model.eval()
    x = read_f32(os.path.join(d, "input.f32"), (-1,) + INPUT_SHAPE[args.net])
    fusedp_logits = read_f32(os.path.join(d, "logits.f32"), (x.shape[0], 10))
    with torch.no_grad():
        report("fusedp weights in torch: logits", rel_err(model(x), fusedp_logits))

    # 2. PyTorch -> fusedp: weights trained by torch
    torch.manual_seed(3)
    tmodel = build(args.net)
    opt = torch.optim.SGD(tmodel.parameters(), lr=0.05, momentum=0.9)
    data = torch.rand((8,) + INPUT_SHAPE[args.net]) * 2 - 1
    labels = torch.randint(0, 10, (8,))
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(tmodel(data), labels).backward()
        opt.step()
    tmodel.eval()
    with torch.no_grad():
        torch_logits = tmodel(x)
    files = [("torch weights (struct writer) in fusedp: logits", os.path.join(d, "torch.safetensors"))]
    write_safetensors(files[0][1], tmodel.state_dict())
    if st is not None:
        files.append(("torch weights (safetensors package) in fusedp: logits", os.path.join(d, "torch_st.safetensors")))
        st.save_file({k: v.contiguous() for k, v in tmodel.state_dict().items()}, files[1][1], metadata={"format": "pt"})
    for what, path in files:
        out_path = path + ".logits.f32"
        rc, out = run([args.dump, "import", "--net", args.net, "--weights", path,
                       "--input", os.path.join(d, "input.f32"), "--out", out_path])
        if rc != 0:
            print(f"checkpoint_dump import failed ({rc}):\n{out}", file=sys.stderr)
            failures.append(what)
            continue
        report(what, rel_err(read_f32(out_path, (x.shape[0], 10)), torch_logits))

    # 3. A torch file of the other network: fusedp refuses it, naming the file and the tensor.
    other = build("cifar" if args.net == "lenet" else "lenet")
    wrong = os.path.join(d, "other_net.safetensors")
    write_safetensors(wrong, other.state_dict())
    rc, out = run([args.dump, "import", "--net", args.net, "--weights", wrong,
                   "--input", os.path.join(d, "input.f32"), "--out", os.path.join(d, "unused.f32")])
    expected = f"{wrong}: has no tensor 'conv1.weight'" if args.net == "resnet18" else \
        f"{wrong}: tensor '0.weight' has shape"
    ok = rc == 1 and expected in out
    print(f"  another network's weights refused: {'ok' if ok else 'NO'} ({out.strip()})")
    if not ok:
        failures.append("another network's weights were not refused clearly")

    # 4. A running statistic missing from an otherwise complete file.
    if args.net == "resnet18":
        partial = {k: v for k, v in tmodel.state_dict().items() if k != "layer3.1.bn2.running_var"}
        path = os.path.join(d, "no_running_var.safetensors")
        write_safetensors(path, partial)
        rc, out = run([args.dump, "import", "--net", args.net, "--weights", path,
                       "--input", os.path.join(d, "input.f32"), "--out", os.path.join(d, "unused.f32")])
        ok = rc == 1 and f"{path}: has no tensor 'layer3.1.bn2.running_var'" in out
        print(f"  a missing running statistic refused: {'ok' if ok else 'NO'} ({out.strip()})")
        if not ok:
            failures.append("a weights file without a running statistic was not refused clearly")

    if failures:
        print(f"FAILED: {', '.join(failures)}", file=sys.stderr)
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
