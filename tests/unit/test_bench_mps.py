"""bench/bench_mps.py without a GPU: the environment and grant each tenant of each mode gets, the
MPS daemon's start and stop, the barrier, the table, and a whole run over stand-ins for what only a
GPU machine has (nvidia-smi, nvidia-cuda-mps-control and the PyTorch tenant, written below). The
tenant itself (bench/mps_worker.py) runs only on the GPU machine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vgpu.hookabi.grant import read_grant
from vgpu.hookabi.layout import SHARING_MPS, SHARING_TIMESLICE

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_mps  # noqa: E402
import mps_procs  # noqa: E402
import mps_table  # noqa: E402

UUID = "GPU-11111111-2222-3333-4444-555555555555"

NVIDIA_SMI = f"""#!/bin/sh
echo "{UUID}, Fake H100 80GB HBM3, 580.00, 81559"
"""

# The control daemon as the bench uses it: -d forks a daemon that writes its pid file, listens on
# <pipe>/control and logs to <log>/control.log; without -d, each stdin line goes to it and its
# answer to stdout. A "client PID" line registers an MPS client (the stand-in tenant sends it).
MPS_CONTROL = r"""#!/usr/bin/env python3
import os, socket, sys
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
logdir = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
def log(text):
    with open(os.path.join(logdir, "control.log"), "a") as f:
        f.write(text + "\n")
if "-d" not in sys.argv:
    for line in sys.stdin:
        s = socket.socket(socket.AF_UNIX)
        s.connect(os.path.join(pipe, "control"))
        s.sendall(line.encode())
        s.shutdown(socket.SHUT_WR)
        sys.stdout.write(s.makefile().read())
    sys.exit(0)
if os.fork():
    sys.exit(0)
os.setsid()
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
srv = socket.socket(socket.AF_UNIX)
srv.bind(os.path.join(pipe, "control"))
srv.listen(16)
with open(os.path.join(pipe, "nvidia-cuda-mps-control.pid"), "w") as f:
    f.write(f"{os.getpid()}\n")
log(f"started pid {os.getpid()} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}")
if os.environ.get("FAKE_PIDS"):
    with open(os.environ["FAKE_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\n")
clients = []
while True:
    conn, _ = srv.accept()
    words = conn.makefile().readline().split()
    answer = ""
    if words[:1] == ["client"]:
        clients.append(words[1])
    elif words[:1] == ["get_server_list"]:
        answer = f"{os.getpid()}\n" if clients else ""
    elif words[:1] == ["get_client_list"]:
        answer = "".join(c + "\n" for c in clients)
    elif words[:1] == ["quit"]:
        log("quit")
        if os.environ.get("FAKE_IGNORE_QUIT"):
            conn.close()
            continue
        conn.close()
        os.unlink(os.path.join(pipe, "control"))
        sys.exit(0)
    try:
        conn.sendall(answer.encode())
    except OSError:  # a client that said its line and left
        pass
    conn.close()
"""

# The tenant without PyTorch: answers as bench/mps_worker.py does. Like the hook, it takes the MPS
# pipe from an MPS grant; it becomes a client of whatever daemon the pipe leads to. Each process
# writes what it was given (its environment, each go) to $FAKE_OUT/<pid>.json.
WORKER = r"""
import json, os, socket, sys, time
from vgpu.hookabi.grant import read_grant
keep = ("CUDA_", "LD_PRELOAD", "VGPU_")
out = {"env": {k: v for k, v in os.environ.items() if k.startswith(keep)}, "go": []}
def save():
    with open(os.path.join(os.environ["FAKE_OUT"], f"{os.getpid()}.json"), "w") as f:
        json.dump(out, f)
def say(m):
    print(json.dumps(m), flush=True)
grant = read_grant(os.environ["VGPU_GRANT_FILE"]) if os.environ.get("VGPU_GRANT_FILE") else None
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/nonexistent")
if grant and grant.sharing == 1:
    pipe = grant.mps_pipe
try:
    s = socket.socket(socket.AF_UNIX)
    s.connect(os.path.join(pipe, "control"))
    s.sendall(f"client {os.getpid()}\n".encode())
    s.close()
except OSError:
    pass
save()
say({"hello": True, "pid": os.getpid(), "device": "Fake", "torch": "none",
     "mps_env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS_")}})
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd.get("cmd") == "run":
        fail = os.environ.get("FAKE_FAIL_ON")
        if fail and fail in os.environ.get("VGPU_GRANT_FILE", ""):
            print("the stand-in fails here, as asked", file=sys.stderr, flush=True)
            say({"error": "run: RuntimeError: asked to fail"})
            sys.exit(1)
        say({"ready": True})
        go = json.loads(sys.stdin.readline())
        out["go"].append(go["go"])
        save()
        end = go["go"] + int((cmd["warmup"] + cmd["seconds"] + cmd["tail"]) * 1e9)
        time.sleep(max(0.0, (end - time.monotonic_ns()) / 1e9))
        rate = 100.0 if not (grant or "CUDA_MPS_PIPE_DIRECTORY" in os.environ) else 60.0
        say({"rate": rate, "steps": 10, "tokens": 10, "gpu_s": cmd["seconds"]})
    elif cmd.get("cmd") == "probe":
        mib = cmd["ask_mib"]
        pinned = os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "")
        if grant:
            mib = (grant.limits[0] >> 20) - 640
        elif pinned.startswith("0="):
            mib = int(pinned[2:-1]) - 512
        say({"got_mib": mib})
    else:
        break
"""


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with the stand-ins, first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("nvidia-smi", NVIDIA_SMI), ("nvidia-cuda-mps-control", MPS_CONTROL)):
        (bin_dir / name).write_text(text.replace("/usr/bin/env python3", sys.executable))
        (bin_dir / name).chmod(0o755)
    (bin_dir / "worker.py").write_text(WORKER)
    (tmp_path / "out").mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_OUT", str(tmp_path / "out"))
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "daemon-pids"))
    return bin_dir


def ctx(tmp_path: Path) -> bench_mps.Ctx:
    base = bench_mps.base_env(
        {"PATH": os.environ["PATH"], "CUDA_MPS_PIPE_DIRECTORY": "/x", "LD_PRELOAD": "y"}
    )
    hook = tmp_path / "libvgpu.so"
    return bench_mps.Ctx(tmp_path / "run", UUID, hook, 50, 6144, "nvidia-cuda-mps-control", base)


def mps_keys(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(("CUDA_MPS_", "CUDA_DEVICE_SM", "CUDA_DEVICE_MEM"))}


def test_each_mode_gives_its_tenants_the_environment_and_grant_the_issue_names(tmp_path: Path) -> None:
    c = ctx(tmp_path)
    pipe = tmp_path / "pipe"
    driver = bench_mps.tenant_env(c, "driver", tmp_path / "d", None)
    assert "LD_PRELOAD" not in driver and not mps_keys(driver)  # the caller's own were dropped
    assert driver["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"

    caps = bench_mps.tenant_env(c, "caps", tmp_path / "c", None)
    assert caps["LD_PRELOAD"] == str(c.hook) and not mps_keys(caps)
    grant = read_grant(caps["VGPU_GRANT_FILE"])
    assert grant.uuids == (UUID,) and grant.limits == (6144 << 20,) and grant.sm_limits == (50,)
    assert grant.sharing == SHARING_TIMESLICE and grant.region_path == str(tmp_path / "c" / "vgpu.region")

    mps = bench_mps.tenant_env(c, "mps", tmp_path / "m", pipe)
    assert "LD_PRELOAD" not in mps and "VGPU_GRANT_FILE" not in mps
    assert mps_keys(mps) == {
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=6144M",
    }

    ours = bench_mps.tenant_env(c, "ours-mps", tmp_path / "o", pipe)
    assert not mps_keys(ours)  # the hook sets them from the grant
    grant = read_grant(ours["VGPU_GRANT_FILE"])
    assert grant.sharing == SHARING_MPS and grant.mps_pipe == str(pipe)
    assert grant.sm_limits == (50,) and grant.limits == (6144 << 20,)


def test_a_lifting_tenant_changes_its_environment_and_nothing_it_cannot(tmp_path: Path) -> None:
    c = ctx(tmp_path)
    pipe = tmp_path / "pipe"
    lift = bench_mps.LIFTS
    honest = read_grant(bench_mps.tenant_env(c, "caps", tmp_path / "B", None)["VGPU_GRANT_FILE"])
    caps = bench_mps.tenant_env(c, "caps", tmp_path / "A", None, lift["caps"])
    assert caps["CUDA_DEVICE_SM_LIMIT"] == "100" and caps["CUDA_DEVICE_MEMORY_LIMIT"] == "64g"
    assert read_grant(caps["VGPU_GRANT_FILE"]).limits == honest.limits  # the grant is the node's to write

    threads = bench_mps.tenant_env(c, "mps", tmp_path / "t", pipe, lift["mps-threads"])
    assert threads["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert (
        threads["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe) and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in threads
    )
    other = bench_mps.tenant_env(c, "mps", tmp_path / "x", pipe, lift["mps-otherdev"])
    assert other["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "1=6144M" and other["CUDA_MPS_PIPE_DIRECTORY"] == str(
        pipe
    )
    assert not mps_keys(bench_mps.tenant_env(c, "mps", tmp_path / "l", pipe, lift["mps-leave"]))

    ours = bench_mps.tenant_env(c, "ours-mps", tmp_path / "o", pipe, lift["ours-mps"])
    assert ours["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert ours["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "1=65536M"  # a device it cannot see
    elsewhere = Path(ours["CUDA_MPS_PIPE_DIRECTORY"])
    assert elsewhere.is_dir() and elsewhere != pipe and not (elsewhere / "control").exists()
    assert read_grant(ours["VGPU_GRANT_FILE"]).mps_pipe == str(pipe)


def test_the_daemon_starts_for_the_card_serves_its_clients_and_quits(tmp_path: Path, tools: Path) -> None:
    c = ctx(tmp_path)
    env = bench_mps.daemon_env(c, tmp_path / "mps")
    assert env["CUDA_VISIBLE_DEVICES"] == UUID and env["CUDA_MPS_PIPE_DIRECTORY"] == str(
        tmp_path / "mps" / "pipe"
    )
    daemon = mps_procs.start_daemon("nvidia-cuda-mps-control", env)
    try:
        assert daemon.pid > 0 and mps_procs.alive(daemon.pid)
        assert (daemon.pipe / "control").exists()
        assert f"CUDA_VISIBLE_DEVICES={UUID}" in (tmp_path / "mps" / "log" / "control.log").read_text()
        assert mps_procs.mps_clients(daemon) == set()
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(daemon.pipe / "control"))
            s.sendall(b"client 4242\n")
        time.sleep(0.1)
        assert mps_procs.mps_clients(daemon) == {4242}
    finally:
        mps_procs.stop_daemon(daemon)
    assert not mps_procs.alive(daemon.pid) and not (daemon.pipe / "control").exists()
    assert "quit" in (tmp_path / "mps" / "log" / "control.log").read_text()


def test_a_daemon_that_does_not_quit_is_killed_and_a_missing_binary_is_named(
    tmp_path: Path, tools: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_IGNORE_QUIT", "1")
    c = ctx(tmp_path)
    c.base["FAKE_IGNORE_QUIT"] = "1"
    daemon = mps_procs.start_daemon("nvidia-cuda-mps-control", bench_mps.daemon_env(c, tmp_path / "mps"))
    mps_procs.stop_daemon(daemon, grace=0.5)
    deadline = time.monotonic() + 5
    while mps_procs.alive(daemon.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not mps_procs.alive(daemon.pid)
    with pytest.raises(mps_procs.BenchError, match="--mps-control"):
        mps_procs.start_daemon(str(tmp_path / "nowhere"), bench_mps.daemon_env(c, tmp_path / "other"))


def test_bad_options_are_refused_naming_the_option() -> None:
    for argv, option in (
        (["--modes", "driver,timeslice"], "--modes"),
        (["--lifts", "everything"], "--lifts"),
        (["--inflight", "1,x"], "--inflight"),
        (["--inflight", "0"], "--inflight"),
        (["--cores", "0"], "--cores"),
        (["--workloads", "train"], "--workloads"),
    ):
        with pytest.raises(SystemExit, match=option):
            bench_mps.parse(argv)
    args = bench_mps.parse(["--modes", "driver,mps", "--inflight", "2,16"])
    assert args.lifts == ["mps-threads", "mps-otherdev", "mps-leave"]  # a lift runs only where its mode does
    assert [label for label, _ in bench_mps.workloads(args.inflight, args.workloads)] == [
        "prefill", "decode", "serve-2", "serve-16"
    ]  # fmt: skip


def test_each_workload_fits_well_within_a_tenants_memory_limit() -> None:
    limit = bench_mps.parse([]).limit_mib << 20
    for label, spec in bench_mps.workloads([1, 8, 32], ["prefill", "decode", "serve"]):
        d, layers = spec["d"], spec["layers"]
        weights = 2 * (layers * 12 * d * d + spec["vocab"] * d)
        length = {"prefill": 0, "decode": 2 * spec.get("context", 0)}.get(
            spec["kind"], spec.get("prompt", 0) + spec.get("generate", 0)
        )
        cache = 2 * 2 * layers * spec["batch"] * length * d
        assert weights + cache < limit // 3, label
        if spec["kind"] == "serve":
            assert spec["warm_steps"] == spec["generate"]  # one whole request's cycle before the barrier


def records_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_bench(
    tmp_path: Path, tools: Path, *extra: str
) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    (tmp_path / "libvgpu.so").write_bytes(b"")
    out = tmp_path / "bench.jsonl"
    argv = [sys.executable, str(ROOT / "bench" / "bench_mps.py"), "--seconds", "0.05", "--warmup", "0.02",
            "--tail", "0.01", "--hook", str(tmp_path / "libvgpu.so"), "--worker", str(tools / "worker.py"),
            "--json", str(out), *extra]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    return done, records_of(out)


def no_process_left(tmp_path: Path, records: list[dict]) -> None:
    pids = [r["pid"] for r in records if r["kind"] == "tenant"]
    daemons = [int(p) for p in (tmp_path / "daemon-pids").read_text().split()]
    deadline = time.monotonic() + 5
    while any(mps_procs.alive(p) for p in pids + daemons) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids + daemons if mps_procs.alive(p)]


def test_a_whole_run_measures_every_mode_together_and_leaves_nothing_behind(
    tmp_path: Path, tools: Path
) -> None:
    done, records = run_bench(tmp_path, tools)
    runs = [r for r in records if r["kind"] == "run"]
    labels = ["prefill", "decode", "serve-1", "serve-8", "serve-32"]
    for mode in ("alone", *bench_mps.MODES):
        got = {(r["workload"], r["tenant"]) for r in runs if r["mode"] == mode and r["lift"] is None}
        assert got == {(w, t) for w in labels for t in ("A" if mode == "alone" else "AB")}, mode
    share = {(r["mode"], r["lift"], r["tenant"]): r["share"] for r in runs if r["workload"] == "prefill"}
    assert share[("driver", None, "A")] == 1.0 and share[("ours-mps", None, "B")] == 0.6
    assert {r["lift"] for r in runs if r["lift"]} == set(bench_mps.LIFTS)
    assert not [r for r in records if r["kind"] == "error"]

    # the barrier: the tenants of each run were handed one start instant
    tenants = {r["pid"]: r for r in records if r["kind"] == "tenant"}
    seen = {pid: json.loads((tmp_path / "out" / f"{pid}.json").read_text()) for pid in tenants}
    by_group: dict[tuple, list[list[int]]] = {}
    for pid, t in tenants.items():
        by_group.setdefault((t["mode"], t["lift"]), []).append(seen[pid]["go"])
    for group, gos in by_group.items():
        assert all(g == gos[0] for g in gos) and len(set(gos[0])) == len(gos[0]), group

    # what each process of ours-mps was given: the hook's grant, no MPS variable; and it became a client
    ours = [pid for pid, t in tenants.items() if t["mode"] == "ours-mps" and t["lift"] is None]
    assert ours and all(not mps_keys(seen[p]["env"]) and "VGPU_GRANT_FILE" in seen[p]["env"] for p in ours)
    assert all(tenants[p]["mps_client"] for p in ours)
    leave = [t for t in tenants.values() if t["lift"] == "mps-leave"]
    assert {t["tenant"]: t["mps_client"] for t in leave} == {"A": False, "B": True}

    table = done.stdout
    assert "| workload | alone | driver | caps | mps | ours-mps |" in table
    assert "| serve, 32 in flight (24 layers, prompt 128, 128 out), tokens/s | 100.0 tokens/s |" in table
    assert (
        "| memory: MiB got of 7168 asked | 7168 | 7168 / 7168 | 5504 / 5504 | 5632 / 5632 | 5504 / 5504 |"
        in table
    )
    assert "| an MPS client | - | - | - | yes / yes | yes / yes |" in table
    assert (
        "| mps-leave | every CUDA_MPS_* unset (leaves MPS) | 1.00 / 0.60 (prefill) | 7168 / 5632 | no / yes |"
        in table
    )
    no_process_left(tmp_path, records)


def test_a_tenant_that_fails_is_reported_and_the_other_modes_still_run(
    tmp_path: Path, tools: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_FAIL_ON", "/caps/")
    done, records = run_bench(tmp_path, tools, "--workloads", "prefill", "--lifts", "none")
    errors = [r for r in records if r["kind"] == "error"]
    assert [(e["mode"], e["workload"]) for e in errors] == [("caps", "prefill")]
    assert "asked to fail" in errors[0]["error"] and "the stand-in fails here" in errors[0]["error"]
    assert {r["mode"] for r in records if r["kind"] == "run"} == {"alone", "driver", "mps", "ours-mps"}
    assert "| driver | caps |" in done.stdout and "| 1.00 / 1.00 | error |" in done.stdout
    assert "Errors:\n- caps prefill: tenant A: run: RuntimeError: asked to fail" in done.stdout
    no_process_left(tmp_path, records)


def test_the_table_shows_lifts_in_order_with_what_the_tenant_had_after_cuinit() -> None:
    tag = {"mode": "ours-mps", "lift": "ours-mps"}
    pipe = {"CUDA_MPS_PIPE_DIRECTORY": "/p", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
    run = {"kind": "run", "workload": "prefill", "unit": "steps"}
    records = [
        {"kind": "header", "device": "H200 (driver 580)", "seconds": 5, "warmup": 1.5, "cores": 50,
         "limit_mib": 6144},
        run | {"mode": "alone", "lift": None, "tenant": "A", "rate": 40.0, "share": None},
        run | tag | {"tenant": "A", "rate": 26.0, "share": 0.65},
        run | tag | {"tenant": "B", "rate": 26.4, "share": 0.66},
        {"kind": "tenant", **tag, "tenant": "A", "mps_client": True,
         "mps_env": pipe | {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=6144M"}},
        {"kind": "tenant", **tag, "tenant": "B", "mps_client": True, "mps_env": pipe},
        {"kind": "probe", **tag, "tenant": "A", "asked_mib": 7168, "got_mib": 5376},
    ]  # fmt: skip
    table = mps_table.render(
        records, ["prefill"], ["ours-mps"], bench_mps.DESCRIBE, {"ours-mps": "all of it"}
    )
    assert "bench_mps on H200 (driver 580)" in table
    assert "| prefill (12 layers, d 1024, 8 x 256 tokens), steps/s | 40.0 steps/s | - |" in table
    assert (
        "| ours-mps | all of it | 0.65 / 0.66 (prefill) | 5376 | yes / yes "
        "| threads 50, pinned 0=6144M, pipe B's |" in table
    )
    assert "Errors" not in table


def test_the_issues_goals_are_judged_on_each_tenant_and_say_what_did_not_run() -> None:
    def pair(mode: str, workload: str, a: float, b: float, lift: str | None = None) -> list[dict]:
        return [
            {"kind": "run", "mode": mode, "lift": lift, "workload": workload, "tenant": t, "share": s}
            for t, s in (("A", a), ("B", b))
        ]

    records = (
        pair("ours-mps", "prefill", 0.66, 0.65)
        + pair("ours-mps", "decode", 0.97, 0.94)  # one tenant under the floor misses it
        + pair("driver", "prefill", 0.57, 0.56)
        + pair("caps", "prefill", 0.56, 0.58)
        + pair("ours-mps", "prefill", 0.52, 0.50, lift="ours-mps")
        + [
            {
                "kind": "probe",
                "mode": "ours-mps",
                "lift": "ours-mps",
                "tenant": t,
                "asked_mib": 7168,
                "got_mib": 5376,
            }
            for t in "AB"
        ]
    )
    lines = mps_table.goals(records, ["prefill", "decode", "serve-1", "serve-32"])
    assert lines == [
        "- ours-mps prefill: each tenant >= 0.65 of a dedicated card: met",
        "- ours-mps decode: each >= 0.95: MISSED",
        "- ours-mps serve-1: each >= 0.70 of dedicated tokens/s: not run",
        "- ours-mps serve-32: each >= 0.90: not run",
        "- caps prefill: each keeps at least what the driver's time-slicing gives: met",
        "- ours-mps: the lifting tenant gets no more threads or memory than its grant: met",
    ]
    records[-2]["got_mib"] = 7168  # the lifting tenant took all it asked: its limit did not hold
    assert mps_table.goals(records, ["prefill"])[-1].endswith(": MISSED")


def test_sigterm_mid_run_stops_the_daemon_ends_the_tenants_and_prints_what_was_measured(
    tmp_path: Path, tools: Path
) -> None:
    (tmp_path / "libvgpu.so").write_bytes(b"")
    out = tmp_path / "bench.jsonl"
    argv = [sys.executable, str(ROOT / "bench" / "bench_mps.py"), "--modes", "mps", "--workloads", "prefill",
            "--lifts", "none", "--seconds", "3", "--warmup", "0", "--tail", "0",
            "--worker", str(tools / "worker.py"), "--json", str(out)]  # fmt: skip
    bench = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # past the alone run, into the mps group's
            if (
                out.exists()
                and '"mode": "mps", "lift": null, "kind": "tenant", "tenant": "B"' in out.read_text()
            ):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the mps tenants never started")
    finally:
        bench.terminate()
        stdout, stderr = bench.communicate(timeout=60)
    assert bench.returncode == 143, stderr[-2000:]
    assert "| workload | alone | mps |" in stdout and "100.0 steps/s" in stdout
    no_process_left(tmp_path, records_of(out))


def test_a_run_of_one_serving_row_is_checked_only_against_its_own_concurrency_goal() -> None:
    high_only = mps_table.goals([], ["serve-32"])
    assert [line for line in high_only if "serve" in line] == ["- ours-mps serve-32: each >= 0.90: not run"]
    low_only = mps_table.goals([], ["serve-1"])
    assert [line for line in low_only if "serve" in line] == [
        "- ours-mps serve-1: each >= 0.70 of dedicated tokens/s: not run"
    ]
