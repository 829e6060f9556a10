"""GPU work loops for the limiter's GPU tests, run as a child process (`python gpu_loops.py KIND`).

KIND is one of
  matmul  bf16 8192x8192 matrix products (about 1.5 ms each on an H200): compute-bound;
  small   in-place adds over 16 Mi floats (tens of microseconds each): many short kernels that
          still keep the card's queue full;
  tiny    in-place adds over one float: launch-bound, for the hook's per-launch cost;
  mixed   one bf16 2048x2048 matrix product then 16 one-float adds: long and launch-bound kernels
          in one stream, as a model's step mixes them.

The loop runs for --seconds and prints, every --window seconds, one JSON line with the window's
CLOCK_MONOTONIC end time (the same clock the hook and the monitor use) and its iterations per
second, synchronizing the device at each window's end so a window counts only finished work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["matmul", "small", "tiny", "mixed"])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--window", type=float, default=0.5)
    parser.add_argument("--wait-stdin", action="store_true", help="start the loop after a line on stdin")
    args = parser.parse_args()

    import torch

    dev = torch.device("cuda")
    if args.kind == "matmul":
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        c = torch.empty(8192, 8192, device=dev, dtype=torch.bfloat16)

        def step() -> None:
            torch.matmul(a, b, out=c)

        per_sync = 8
    elif args.kind == "mixed":
        a = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
        c = torch.empty(2048, 2048, device=dev, dtype=torch.bfloat16)
        x = torch.zeros(1, device=dev, dtype=torch.float32)

        def step() -> None:
            torch.matmul(a, a, out=c)
            for _ in range(16):
                x.add_(1.0)

        per_sync = 32
    else:
        x = torch.zeros(16 << 20 if args.kind == "small" else 1, device=dev, dtype=torch.float32)

        def step() -> None:
            x.add_(1.0)

        per_sync = 64 if args.kind == "small" else 256
    for _ in range(3 * per_sync):  # warm-up: kernels loaded, cuBLAS workspace taken
        step()
    torch.cuda.synchronize()
    print(json.dumps({"ready": True}), flush=True)
    if args.wait_stdin:
        sys.stdin.readline()
    start = time.monotonic()
    window_start, done = start, 0
    while True:
        for _ in range(per_sync):
            step()
        done += per_sync
        now = time.monotonic()
        if now - window_start >= args.window:
            torch.cuda.synchronize()
            now = time.monotonic()
            rate = done / (now - window_start)
            print(json.dumps({"t": time.clock_gettime_ns(time.CLOCK_MONOTONIC), "rate": rate}), flush=True)
            window_start, done = now, 0
            if now - start >= args.seconds:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
