"""One tenant of bench/bench_mps.py: a transformer decoder with random fp16 weights on the GPU.

Run by bench_mps.py (never by hand), with the environment of its mode. It reads one JSON command
a line on stdin and answers one JSON line on stdout (everything else it says goes to stderr):

  start          {"hello": true, "pid", "device", "torch", "mps_env"}: CUDA is up; mps_env is
                 the CUDA_MPS_* variables as the C library sees them after cuInit (the hook sets
                 them there under an MPS grant, where Python's os.environ would not show it)
  {"cmd": "run", "workload": {...}, "warmup": s, "seconds": s, "tail": s}
                 builds the workload and warms it up, answers {"ready": true}, then waits for
                 {"go": t0} (CLOCK_MONOTONIC ns, the same t0 for every tenant of the run: the
                 barrier), runs from t0, measures from t0 + warmup for `seconds` by CUDA events
                 (GPU time between the window's first and last step), keeps running `tail` more so
                 that the other tenant's window never sees it stopped, answers {"rate", "steps",
                 "tokens", "gpu_s"}, and frees the workload's memory
  {"cmd": "probe", "ask_mib": n}
                 allocates 256 MiB chunks until n MiB or the first refusal, frees them, and
                 answers {"got_mib"}: what a tenant can take beyond its model
  {"cmd": "quit"} or end of input: exits

Workloads (the sizes come in the command; bench_mps.WORKLOADS has them):
  prefill  one forward over batch x tokens (busy kernels);
  decode   batch sequences one token a step against a KV cache cycling over [context, 2 context)
           positions (launch-bound);
  serve    `batch` requests in flight, batched: a prefill of `prompt` tokens for each, then
           `generate` - 1 decode steps, then new requests; counts generated tokens.
No CUDA graphs, no host synchronisation between steps (the next token's argmax stays on the GPU).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import time
from typing import Any

MPS_VARS = (
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
)
CHUNK_MIB = 256


def say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def listen() -> dict[str, Any]:
    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else {"cmd": "quit"}


def libc_env() -> dict[str, str]:
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    libc.getenv.argtypes = [ctypes.c_char_p]
    return {name: (libc.getenv(name.encode()) or b"").decode() for name in MPS_VARS}


def build(torch: Any, spec: dict[str, Any]) -> Any:
    """The workload's step function: each call enqueues one step and returns the tokens it yields."""
    nn, fn = torch.nn, torch.nn.functional
    d, heads, vocab = spec["d"], spec["heads"], spec["vocab"]
    kw: dict[str, Any] = {"device": "cuda", "dtype": torch.float16}

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d, **kw), nn.LayerNorm(d, **kw)
            self.qkv, self.out = nn.Linear(d, 3 * d, **kw), nn.Linear(d, d, **kw)
            self.up, self.down = nn.Linear(d, 4 * d, **kw), nn.Linear(4 * d, d, **kw)

        def forward(self, x: Any, cache: Any = None, start: int = 0) -> Any:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            if cache is not None:  # write this step's keys and values, attend over the cache so far
                kc, vc = cache
                kc[:, :, start : start + t] = k
                vc[:, :, start : start + t] = v
                k, v = kc[:, :, : start + t], vc[:, :, : start + t]
            # t > 1 only from position 0 (a prefill), where causal masking is the usual one
            a = fn.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
            x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(fn.gelu(self.up(self.ln2(x))))

    emb = nn.Embedding(vocab, d, **kw)
    layers = [Layer() for _ in range(spec["layers"])]
    norm = nn.LayerNorm(d, **kw)

    def forward(ids: Any, caches: Any = None, start: int = 0) -> Any:
        x = emb(ids)
        for i, layer in enumerate(layers):
            x = layer(x, caches[i] if caches is not None else None, start)
        return (norm(x[:, -1]) @ emb.weight.t()).argmax(-1)  # the next token, left on the GPU

    def caches(batch: int, length: int) -> list[tuple[Any, Any]]:
        shape = (batch, heads, length, d // heads)
        return [(torch.randn(shape, **kw), torch.randn(shape, **kw)) for _ in layers]

    batch = spec["batch"]
    if spec["kind"] == "prefill":
        ids = torch.randint(vocab, (batch, spec["tokens"]), device="cuda")

        def prefill() -> int:
            forward(ids)
            return batch * spec["tokens"]

        return prefill
    if spec["kind"] == "decode":
        ctx = spec["context"]
        kv = caches(batch, 2 * ctx)
        state = {"pos": ctx, "tok": torch.randint(vocab, (batch,), device="cuda")}

        def decode() -> int:
            state["tok"] = forward(state["tok"][:, None], kv, state["pos"])
            state["pos"] = ctx if state["pos"] + 1 == 2 * ctx else state["pos"] + 1
            return batch

        return decode
    prompt, generate = spec["prompt"], spec["generate"]
    kv = caches(batch, prompt + generate)
    prompts = torch.randint(vocab, (batch, prompt), device="cuda")
    serving = {"pos": 0, "tok": prompts[:, 0]}

    def serve() -> int:  # one iteration of the server: the batch's prefill or one decode step
        pos = serving["pos"]
        if pos == 0:
            serving["tok"] = forward(prompts, kv, 0)
            serving["pos"] = prompt
        else:
            serving["tok"] = forward(serving["tok"][:, None], kv, pos)
            serving["pos"] = 0 if pos + 1 == prompt + generate - 1 else pos + 1
        return batch

    return serve


def run(torch: Any, cmd: dict[str, Any]) -> None:
    step = build(torch, cmd["workload"])
    for _ in range(cmd["workload"]["warm_steps"]):  # kernels loaded, cuBLAS's workspace taken
        step()
    torch.cuda.synchronize()
    say({"ready": True})
    go = listen()
    if "go" not in go:
        raise SystemExit(0)  # the bench gave up on this run (the other tenant failed)
    t0 = int(go["go"])
    start_at = t0 + int(cmd["warmup"] * 1e9)
    end_at = start_at + int(cmd["seconds"] * 1e9)
    stop_at = end_at + int(cmd["tail"] * 1e9)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while time.monotonic_ns() < t0:
        time.sleep(0.0005)
    steps = tokens = 0
    started = ended = False
    while True:
        now = time.monotonic_ns()
        if not started and now >= start_at:
            begin.record()
            started = True
        if started and not ended and now >= end_at:
            end.record()
            ended = True
        if now >= stop_at:
            break
        produced = step()
        if started and not ended:
            steps += 1
            tokens += produced
    torch.cuda.synchronize()
    gpu_s = begin.elapsed_time(end) / 1000.0
    unit = cmd["workload"]["unit"]
    done = tokens if unit == "tokens" else steps
    say({"rate": done / gpu_s if gpu_s > 0 else 0.0, "steps": steps, "tokens": tokens, "gpu_s": gpu_s})


def probe(torch: Any, ask_mib: int) -> int:
    held = []
    try:
        while len(held) * CHUNK_MIB < ask_mib:
            held.append(torch.empty(CHUNK_MIB << 20, dtype=torch.uint8, device="cuda"))
    except RuntimeError as err:  # torch.OutOfMemoryError, or the driver's own out-of-memory error
        if "out of memory" not in str(err).lower():
            raise
    got = len(held) * CHUNK_MIB
    del held
    torch.cuda.empty_cache()
    return got


def main() -> int:
    try:
        import torch

        torch.zeros(1, device="cuda")  # cuInit, and under MPS the connection to the daemon
        say(
            {
                "hello": True,
                "pid": os.getpid(),
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "mps_env": libc_env(),
            }
        )
    except Exception as err:  # the bench reports it beside the mode
        say({"error": f"CUDA did not start: {type(err).__name__}: {err}"})
        return 1
    with torch.no_grad():
        while True:
            cmd = listen()
            try:
                if cmd["cmd"] == "run":
                    run(torch, cmd)
                    gc.collect()  # the workload's tensors went with its closures
                    torch.cuda.empty_cache()
                elif cmd["cmd"] == "probe":
                    say({"got_mib": probe(torch, int(cmd["ask_mib"]))})
                else:
                    return 0
            except Exception as err:  # the bench reports it beside the row
                say({"error": f"{cmd.get('cmd')}: {type(err).__name__}: {err}"})
                return 1


if __name__ == "__main__":
    sys.exit(main())
