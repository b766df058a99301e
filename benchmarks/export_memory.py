"""Peak memory of zerocc.export_full_state_dict: about one tensor, not the model.

    python benchmarks/export_memory.py [--layers 6 --width 4096]

Saves a checkpoint of a stack of square Linear layers (6 x 4096^2 fp32 = 403 MB),
then exports it in a fresh process and reports that process's peak resident
memory (sampled every 2 ms) above its baseline (after imports), next to the model's size and its
largest tensor.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

import zerocc

CHILD = """
import os, sys, threading, time, zerocc
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
baseline, peak, done = rss(), [0], []
def sample():
    while not done:
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
sampler = threading.Thread(target=sample)
sampler.start()
info = zerocc.export_full_state_dict(sys.argv[1], sys.argv[2])
done.append(1)
sampler.join()
print(baseline, max(peak[0], rss()), info["bytes"], info["largest_tensor_bytes"])
"""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=4096)
    args = parser.parse_args()
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
    with tempfile.TemporaryDirectory() as folder:
        zerocc.save_checkpoint(step, os.path.join(folder, "ckpt"))   # before any step: the model as built
        del step, model
        out = subprocess.run([sys.executable, "-c", CHILD, os.path.join(folder, "ckpt"),
                              os.path.join(folder, "model.safetensors")], capture_output=True, text=True, check=True)
        baseline, peak, total, largest = map(int, out.stdout.split())
    mb = 1 / 2**20
    print(f"model {total * mb:.0f} MB, largest tensor {largest * mb:.0f} MB: export peak RSS grew "
          f"{(peak - baseline) * mb:.0f} MB ({(peak - baseline) / largest:.2f} x the largest tensor, "
          f"{(peak - baseline) / total:.2f} x the model)")


if __name__ == "__main__":
    main()
