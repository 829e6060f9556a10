"""A decode workload on the GPU, and the media-engine figures NVML gives its process: what the
node monitor's ``vgpu_container_*_utilization_ratio`` series are made of (docs/monitoring.md,
"Lines of defence and media engines"). Needs an NVIDIA GPU; not part of ``make bench``.

Workloads (``--workload``; ``auto`` takes the first that can run here):

- ``jpeg``: ``torchvision.io.decode_jpeg`` on ``cuda`` (nvJPEG), a batch of 1080p JPEGs in a loop.
  nvJPEG picks its backend itself: where it runs CUDA kernels rather than the NVJPG engines, the
  work shows as SM time, ``jpg`` 0;
- ``nvdec``: ffmpeg decoding an H.264 clip through the driver's decode library (libnvcuvid, ffmpeg's
  ``-hwaccel cuda``); the clip is made first on the CPU (libx264, else MPEG-2).

The workload runs in a child process; this one reads the card's per-process samples every
``--every`` seconds, raw from NVML (``nvmlDeviceGetProcessesUtilizationInfo``, else
``nvmlDeviceGetProcessUtilization``) and through the node's own reader
(``vgpu.node.nvml.NvmlDiscovery.processes``: the figures the monitor exports), and prints
them for the child's PID, then the mean and peak of each engine.

    python bench/codec_util.py [--workload auto|jpeg|nvdec] [--seconds 20] [--device 0]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JPEG_CHILD = """
import sys, time, torch, torchvision
from torchvision.io import decode_jpeg, encode_jpeg
img = (torch.rand(3, 1080, 1920) * 255).to(torch.uint8)
data = [encode_jpeg(img, quality=90)] * 16
end = time.monotonic() + float(sys.argv[1])
n = 0
device = "cuda:" + sys.argv[2]
try:
    decode_jpeg(data[:2], device=device)  # a batch (torchvision 0.19+: nvjpegDecodeBatched)
    batch = True
except (TypeError, RuntimeError):
    batch = False  # older torchvision: one image a call
while time.monotonic() < end:
    out = decode_jpeg(data, device=device) if batch else [decode_jpeg(d, device=device) for d in data]
    torch.cuda.synchronize()
    n += len(out)
print(f"jpeg: decoded {n} images of 1920x1080 (torchvision {torchvision.__version__})", flush=True)
"""


def no_gpu(why: str) -> int:
    print(f"codec_util: {why}; run it on a machine with an NVIDIA GPU and its driver", file=sys.stderr)
    return 2


def jpeg_ready() -> str | None:
    """Why the jpeg workload cannot run here (None: it can)."""
    probe = "import torch, torchvision.io; assert torch.cuda.is_available(), 'no CUDA device for torch'"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["torch missing"])[-1]


def nvdec_clip(folder: Path, seconds: int) -> Path | None:
    """An H.264 (else MPEG-2) clip made on the CPU; None without ffmpeg or an encoder."""
    if shutil.which("ffmpeg") is None:
        return None
    for codec, name in (("libx264", "clip.mp4"), ("mpeg2video", "clip.mpg")):
        clip = folder / name
        made = subprocess.run(
            ["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", "testsrc2=size=1920x1080:rate=30"]
            + ["-t", str(min(seconds, 10)), "-c:v", codec, "-pix_fmt", "yuv420p", str(clip)],
            capture_output=True,
        )
        if made.returncode == 0:
            return clip
    return None


def start(workload: str, seconds: int, device: int, folder: Path) -> subprocess.Popen[bytes] | str:
    if workload == "jpeg":
        why = jpeg_ready()
        if why is not None:
            return f"the jpeg workload needs torch and torchvision with CUDA ({why})"
        return subprocess.Popen([sys.executable, "-c", JPEG_CHILD, str(seconds), str(device)])
    clip = nvdec_clip(folder, seconds)
    if clip is None:
        return "the nvdec workload needs ffmpeg with an H.264 or MPEG-2 encoder to make its clip"
    return subprocess.Popen(
        ["ffmpeg", "-v", "error", "-hwaccel", "cuda", "-hwaccel_device", str(device)]
        + ["-hwaccel_output_format", "cuda", "-stream_loop", "-1", "-i", str(clip)]
        + ["-t", str(seconds), "-f", "null", "-"]
    )


def raw_samples(nv: object, handle: object, since: int) -> list[object]:
    try:
        return list(nv.nvmlDeviceGetProcessesUtilizationInfo(handle, since))  # type: ignore[attr-defined]
    except Exception:
        try:
            return list(nv.nvmlDeviceGetProcessUtilization(handle, since))  # type: ignore[attr-defined]
        except Exception:
            return []  # NOT_FOUND: no sample since


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("auto", "jpeg", "nvdec"), default="auto")
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--every", type=float, default=1.0)
    args = parser.parse_args()
    try:
        import pynvml as nv
    except ImportError:
        return no_gpu("pynvml is not installed (pip install nvidia-ml-py)")
    try:
        nv.nvmlInit()
    except nv.NVMLError as err:
        return no_gpu(f"NVML cannot start ({err})")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's vgpu, installed or not
    from vgpu.node.nvml import NvmlDiscovery

    handle = nv.nvmlDeviceGetHandleByIndex(args.device)
    name = nv.nvmlDeviceGetName(handle)
    uuid = nv.nvmlDeviceGetUUID(handle)
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    print(f"card {args.device}: {name} {uuid}, driver {nv.nvmlSystemGetDriverVersion()}")
    for engine, call in (
        ("NVDEC", "nvmlDeviceGetDecoderUtilization"),
        ("NVENC", "nvmlDeviceGetEncoderUtilization"),
    ):
        try:
            print(f"  {engine} utilization now (whole card): {getattr(nv, call)(handle)[0]} %")
        except nv.NVMLError as err:
            print(f"  {engine}: {err}")
    discovery = NvmlDiscovery()
    with tempfile.TemporaryDirectory() as tmp:
        child: subprocess.Popen[bytes] | str = "no workload can run here"
        for workload in ("jpeg", "nvdec") if args.workload == "auto" else (args.workload,):
            child = start(workload, args.seconds, args.device, Path(tmp))
            if not isinstance(child, str):
                print(f"workload {workload}: PID {child.pid} for {args.seconds} s")
                break
            print(f"workload {workload}: {child}", file=sys.stderr)
        if isinstance(child, str):
            return 2
        since = int(time.time() * 1e6)
        seen: dict[str, list[int]] = {"sm": [], "dec": [], "enc": [], "jpg": [], "ofa": []}
        print("  t(s)  raw: sm dec enc jpg ofa   | vgpu NvmlDiscovery: dec enc jpg ofa")
        started = time.monotonic()
        while child.poll() is None:
            time.sleep(args.every)
            mine = [s for s in raw_samples(nv, handle, since) if int(s.pid) == child.pid]  # type: ignore[attr-defined]
            since = max([since, *(int(s.timeStamp) for s in mine)])  # type: ignore[attr-defined]
            row = {k: max((int(getattr(s, f"{k}Util", 0)) for s in mine), default=0) for k in seen}
            for k, v in row.items():
                seen[k].append(v)
            ours = next((p.codec for p in discovery.processes(uuid) or [] if p.pid == child.pid), None)
            told = "-" if ours is None else f"{ours.dec} {ours.enc} {ours.jpg} {ours.ofa}"
            raw = " ".join(f"{row[k]:3d}" for k in seen)
            print(f"  {time.monotonic() - started:4.1f}  {raw}   | {told}", flush=True)
        print(f"workload ended with {child.returncode}")
    for k, values in seen.items():
        busy = [v for v in values if v]
        mean = sum(values) / len(values) if values else 0.0
        print(
            f"{k}: mean {mean:.1f} %, peak {max(values, default=0)} %, "
            f"{len(busy)}/{len(values)} reads above 0"
        )
    discovery.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
