"""A GPU workload for the NVML sampler's validation: holds about 2 GiB and runs bf16
matmuls for --seconds, then exits by itself. Prints "ready PID" once the memory is held."""

from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--gib", type=float, default=2.0)
    a = p.parse_args()
    held = torch.empty(int(a.gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    print(f"ready {os.getpid()}", flush=True)
    deadline = time.monotonic() + a.seconds
    while time.monotonic() < deadline:
        for _ in range(20):
            x = (x @ y) * 1e-4
        torch.cuda.synchronize()
    del held


if __name__ == "__main__":
    main()
