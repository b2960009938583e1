#!/usr/bin/env python3
"""tests benchmarks/gpu/report.py, the table and verdicts that end benchmarks/gpu/check.sh, on made-up
runs: the ratios and targets count fusedp's default builds (WMMA or tensor-core layers, TF32 and BF16)
and never an ablation run (unfused, wide, separate-update, ...), even a faster one; every run is still
in the table; the Markdown file says the same.

    gpu_report.py <path of report.py>
"""
import os
import subprocess
import sys
import tempfile

FUSEDP = """\
RESULT impl=fusedp net=cifar batch=128 precision=tf32 median_ms=0.4500 images_per_s=284444 graphs=1 loss=2.30 host_ms=0.030 queued_ms=0.440
RESULT impl=fusedp-mma net=cifar batch=128 precision=tf32 median_ms=0.4200 images_per_s=304762 graphs=1 loss=2.30 host_ms=0.030 queued_ms=0.410
RESULT impl=fusedp-unfused net=cifar batch=128 precision=tf32 median_ms=0.3500 images_per_s=365714 graphs=1 loss=2.30 host_ms=0.030 queued_ms=0.340
RESULT impl=fusedp-mma-bf16 net=cifar batch=128 precision=bf16 median_ms=0.3100 images_per_s=412903 graphs=1 loss=2.30 host_ms=0.030 queued_ms=0.300
RESULT impl=fusedp-mma-wide-bf16 net=cifar batch=128 precision=bf16 median_ms=0.2500 images_per_s=512000 graphs=1 loss=2.30 host_ms=0.030 queued_ms=0.240
RESULT impl=fusedp net=lenet batch=128 precision=tf32 median_ms=0.1100 images_per_s=1163636 graphs=1 loss=2.30 host_ms=0.030 queued_ms=0.100
RESULT impl=fusedp-no-pdl net=lenet batch=128 precision=tf32 median_ms=0.1300 images_per_s=984615 graphs=1 loss=2.30 host_ms=0.030 queued_ms=0.120
"""
TORCH = {"torch-eager": 100000, "torch-autotune": 250000, "torch-autotune-bf16": 300000}


def main():
    report = sys.argv[1]
    failures = []

    def expect(what, ok):
        if not ok:
            failures.append(what)

    def run(torch):
        """report.py's table and Markdown for FUSEDP beside PyTorch's `torch` results (impl: images/s)."""
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "fusedp.txt"), "w") as f:
                f.write(FUSEDP)
            os.mkdir(os.path.join(d, "torch"))
            for impl, ips in torch.items():
                with open(os.path.join(d, "torch", impl + ".json"), "w") as f:
                    f.write('{"impl": "%s", "net": "cifar", "batch": 128, "images_per_s": %d}' % (impl, ips))
            md = os.path.join(d, "results.md")
            out = subprocess.run([sys.executable, report, "--fusedp", os.path.join(d, "fusedp.txt"), "--torch-dir",
                                  os.path.join(d, "torch"), "--markdown", md], capture_output=True, text=True)
            expect("report.py exits 0 (%d: %s)" % (out.returncode, out.stderr.strip()), out.returncode == 0)
            return out.stdout, open(md).read() if os.path.exists(md) else ""

    # Without max-autotune (cold at the time limit, or failed), "the fastest PyTorch mode" is not known:
    # against eager alone the ratios would read 3.05 and 4.13, met.
    for where, t in zip(("table", "markdown"), run({"torch-eager": 100000, "torch-eager-bf16": 100000})):
        expect(where + ": no autotune: the TF32 ratio target is not measured",
               ">= 1.5x fastest PyTorch TF32 mode (issue 17): not measured" in t)
        expect(where + ": no autotune: the bf16 ratio target is not measured",
               ">= 1.5x fastest PyTorch bf16 mode (issue 17): not measured" in t)
    text, markdown = run(TORCH)
    for where, t in (("table", text), ("markdown", markdown)):
        # The faster default TF32 build is fusedp-mma (0.42 ms): not the unfused run's 0.35 ms.
        expect(where + ": the TF32 0.40 ms target is not met by an ablation",
               "<= 0.40 ms TF32 (issue 17): not met" in t)
        expect(where + ": the TF32 0.60 ms target is met", "<= 0.60 ms TF32 (issue 14): met" in t)
        # BF16: fusedp-mma-bf16's 0.31 ms, not the wide run's 0.25 ms.
        expect(where + ": the BF16 0.30 ms target is not met by an ablation",
               "<= 0.30 ms BF16 (issue 17): not met" in t)
        # 412,903 / 300,000 = 1.38 against bf16 max-autotune; 304,762 / 250,000 = 1.22 in TF32.
        expect(where + ": the bf16 ratio is the default BF16 build's", "1.38 (fusedp-mma-bf16 / autotune-bf16)" in t)
        expect(where + ": the tf32 ratio is the default TF32 build's", "1.22 (fusedp-mma / autotune)" in t)
        expect(where + ": LeNet's 0.12 ms target is met by the default build", "<= 0.12 ms (issue 17): met" in t)
        expect(where + ": with autotune measured, the TF32 ratio target is judged",
               ">= 1.5x fastest PyTorch TF32 mode (issue 17): not met" in t)
        # Every run stays in the table.
        for impl in ("fusedp-unfused", "fusedp-mma-wide-bf16", "fusedp-no-pdl"):
            expect(where + ": " + impl + " has its columns", impl + " ms" in t)
    if failures:
        print("gpu_report: FAILED:\n  " + "\n  ".join(failures))
        print(text)
        return 1
    print("gpu_report: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
