"""libvgpu's compute limit over the stub driver's simulated GPU timeline: 1 ms kernels, the share
of wall time the stub's device was busy, and the region's counters as the node monitor reads them.

Shares are measured over 0.5-2 s of work; bounds hold on a loaded 2-core machine (a late wake-up
only lowers the share a little: the bucket keeps the time it was owed, up to its burst)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hook_harness import Built, Result, build, env, parse, run

MODES = ["link", "dlsym", "procaddr", "procaddr_ptds"]
PATHS = ["kernel", "kernel_ptsz", "ex", "ex_ptsz", "coop", "coop_ptsz", "graph", "graph_ptsz"]
BASE_PATHS = ["kernel", "ex", "coop", "graph"]  # through cuGetProcAddress the flags pick _ptsz


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


def limited(built: Built, region: Path, **extra: str) -> dict[str, str]:
    return env(built, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(region), **extra)


# The launch-path tests below ask whether a path is gated at all (ungated, a 30 % container runs
# at 80 % and more), over 0.6 s: a loaded CI machine's late wake-ups have cost such a short run
# 0.215. Their floor is therefore lower than the accuracy tests' (1.5 s, within 6 points below).
GATED_30 = (0.18, 0.36)


def share(r: Result, key: str = "share") -> float:
    assert r.returncode == 0, r.stderr
    return float(r.values[key])


def _shares_of_two(built: Built, environ: dict[str, str], *argv: str) -> list[float]:
    """Two t_sm processes with ``argv`` under one region at once: the share each measured."""
    procs = [
        subprocess.Popen(
            [built.prog("t_sm"), *argv],
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    shares = []
    for p in procs:
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        shares.append(float(parse(out)[0]["share"]))
    return shares


@pytest.mark.parametrize("limit", [25, 50, 75])
def test_the_busy_share_holds_to_the_limit_and_the_region_counts_it(
    built: Built, tmp_path: Path, limit: int
) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT=str(limit))
    r = run(built, "t_sm", "link", "rate", "kernel", "1.5", environ=environ)
    assert limit / 100 - 0.06 <= share(r) <= limit / 100 + 0.04, r.values
    # the hook measured what the stub's device did, within timing-event noise
    assert abs(r.int("region_busy_ns") - r.int("busy_ns")) <= 0.05 * r.int("busy_ns")
    # launches waited for the rest of the time, give or take the kernels' own run time
    assert r.int("throttled_ns") >= (1 - limit / 100 - 0.15) * r.int("wall_ns")
    assert r.int("last_launch_ns") >= r.int("start_ns")


def test_without_a_limit_nothing_waits_and_nothing_is_debited(built: Built, tmp_path: Path) -> None:
    r = run(built, "t_sm", "link", "rate", "kernel", "1", environ=limited(built, tmp_path / "region"))
    assert share(r) >= 0.8
    assert r.int("throttled_ns") == 0 and r.int("region_busy_ns") == 0 and r.int("tokens") == 0
    # the monitor still sees the container launching
    assert r.int("last_launch_ns") >= r.int("start_ns")


@pytest.mark.parametrize(
    ("mode", "path"),
    [(m, p) for m in ["link", "dlsym"] for p in PATHS]
    + [(m, p) for m in ["procaddr", "procaddr_ptds"] for p in BASE_PATHS],
)
def test_every_launch_path_goes_through_the_gate(built: Built, tmp_path: Path, mode: str, path: str) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="30")
    r = run(built, "t_sm", mode, "rate", path, "0.6", "created", environ=environ)
    assert GATED_30[0] <= share(r) <= GATED_30[1], r.values
    assert r.int("region_busy_ns") > 0


@pytest.mark.parametrize("stream", ["legacy", "ptds", "created"])
@pytest.mark.parametrize("mode", ["link", "procaddr_ptds"])
def test_default_per_thread_and_created_streams_are_all_measured(
    built: Built, tmp_path: Path, stream: str, mode: str
) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="30")
    r = run(built, "t_sm", mode, "rate", "kernel", "0.6", stream, environ=environ)
    assert GATED_30[0] <= share(r) <= GATED_30[1], r.values


def test_threads_on_their_own_streams_share_one_limit(built: Built, tmp_path: Path) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="50")
    r = run(built, "t_sm", "link", "rate", "kernel", "1.5", "created", "4", environ=environ)
    assert 0.44 <= share(r) <= 0.54, r.values


def test_two_processes_of_one_container_get_the_limit_together(built: Built, tmp_path: Path) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="50")
    shares = _shares_of_two(built, environ, "link", "rate", "kernel", "2")
    assert 0.42 <= sum(shares) <= 0.56, shares
    assert min(shares) >= 0.12  # neither process is starved


def test_a_private_region_still_holds_the_limit(built: Built) -> None:
    r = run(built, "t_sm", "link", "rate", "kernel", "0.8", environ=env(built, CUDA_DEVICE_SM_LIMIT="40"))
    assert 0.32 <= share(r) <= 0.46, r.values


def test_a_live_resize_takes_effect_on_the_next_launches(built: Built, tmp_path: Path) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="25")
    r = run(
        built, "t_sm", "link", "phases", "kernel", "1.2:limit=25,1.2:limit=75,1.2:limit=25", environ=environ
    )
    assert 0.19 <= share(r, "step0_share") <= 0.29, r.values
    assert 0.62 <= share(r, "step1_share") <= 0.79, r.values  # a loaded machine lowers it a little
    assert 0.19 <= share(r, "step2_share") <= 0.29, r.values


YIELD_STEPS = "0.4,0.6:flags=1+fresh=1,0.4:flags=0,0.6:flags=1+fresh=1,0.3:fresh=0,1.2"


def test_a_normal_priority_container_yields_while_the_monitor_says_so(built: Built, tmp_path: Path) -> None:
    environ = limited(built, tmp_path / "region", CUDA_TASK_PRIORITY="1")
    r = run(built, "t_sm", "link", "phases", "kernel", YIELD_STEPS, environ=environ)
    assert r.int("step0_launches") > 200
    assert r.int("step1_launches") <= 2  # held (a launch already past the gate may finish)
    assert r.int("step2_launches") > 200  # the flag cleared: it resumes
    assert r.int("step3_launches") <= 2
    assert r.int("step4_launches") <= 2  # the monitor went quiet, but less than a second ago
    # arbiter_ns older than a second: the flag is ignored, a dead monitor freezes nobody
    assert r.int("step5_launches") > 150
    assert r.int("throttled_ns") >= 1_200_000_000


# guarded (a high-priority container is on the card), then not, then guarded and told to yield
QUEUE_STEPS = "0.5:flags=4+fresh=1,0.3:flags=0,0.4:flags=5+fresh=1"


def test_beside_a_high_priority_container_the_queue_stays_short_so_a_yield_holds_at_once(
    built: Built, tmp_path: Path
) -> None:
    environ = limited(built, tmp_path / "region", CUDA_TASK_PRIORITY="1")
    r = run(built, "t_sm", "link", "queue", "kernel", QUEUE_STEPS, environ=environ)
    # a loop that never syncs, of 1 ms kernels: guarded, a few ms queued, and the card kept busy
    assert float(r.values["step0_max_queue_ms"]) <= 12.0, r.values  # 8 ms and a kernel in flight
    # (0.76 seen on the loaded 2-core CI machine; a guard that starved the card reads about 0.5)
    assert share(r, "step0_share") >= 0.7, r.values
    # unguarded, the same loop queues as deep as the program lets it (two seconds here)
    assert float(r.values["step1_max_queue_ms"]) >= 500.0, r.values
    assert r.int("step2_launches") <= 2  # told to yield: launches wait


def test_a_high_priority_container_never_yields_and_keeps_launching_while_its_work_runs(
    built: Built, tmp_path: Path
) -> None:
    # guarded, a priority-0 loop keeps tens of ms queued (40 ms: it launches as its work runs, so
    # the monitor's activity window sees it busy), never the seconds a sync would then sit on
    environ = limited(built, tmp_path / "region", CUDA_TASK_PRIORITY="0")
    r = run(built, "t_sm", "link", "queue", "kernel", "0.6:flags=5+fresh=1", environ=environ)
    assert 30.0 <= float(r.values["step0_max_queue_ms"]) <= 50.0, r.values
    assert share(r, "step0_share") >= 0.9, r.values
    assert r.int("throttled_ns") == 0  # the yield flag is not for it


def test_a_high_priority_container_never_yields(built: Built, tmp_path: Path) -> None:
    environ = limited(built, tmp_path / "region", CUDA_TASK_PRIORITY="0")
    r = run(built, "t_sm", "link", "phases", "kernel", YIELD_STEPS, environ=environ)
    for step in range(6):  # the program's own pace (well above what a held one gets), whatever the flags
        assert share(r, f"step{step}_share") >= 0.6, r.values
    assert r.int("throttled_ns") == 0


def test_elastic_runs_free_while_alone_and_holds_the_cap_otherwise(built: Built, tmp_path: Path) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="25", CUDA_SM_POLICY="elastic")
    r = run(
        built,
        "t_sm",
        "link",
        "phases",
        "kernel",
        "1:flags=2+fresh=1,1.2:flags=0,0.8:flags=2",
        environ=environ,
    )
    assert share(r, "step0_share") >= 0.6, r.values  # far past the 25 % cap
    assert 0.19 <= share(r, "step1_share") <= 0.30, r.values  # back to the cap, no debt from the free run
    assert share(r, "step2_share") >= 0.6, r.values


def test_the_cap_policy_ignores_alone(built: Built, tmp_path: Path) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="25")
    r = run(built, "t_sm", "link", "phases", "kernel", "1.2:flags=2+fresh=1", environ=environ)
    assert 0.19 <= share(r, "step0_share") <= 0.30, r.values


def test_a_capturing_stream_is_forwarded_untouched_and_the_capture_stays_valid(
    built: Built, tmp_path: Path
) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="10")
    r = run(built, "t_sm", "link", "capture", environ=environ)
    assert r.returncode == 0, r.stderr
    assert r.int("captured") == 2000
    assert float(r.values["capture_ms"]) < 500  # 2 s of kernels at 10 % would wait 20 s
    assert r.int("throttled_ns") == 0 and r.int("region_busy_ns") == 0
    # another stream, launched while the capture is open, is limited, and the limiter's own event
    # calls (relaxed capture mode) neither land in the capture nor invalidate it
    assert 0.05 <= share(r, "other_share") <= 0.16, r.values
    assert r.int("events_on_capturing") == 0 and r.int("violations") == 0


def test_failing_timing_events_leave_launches_working_and_the_limit_comes_back(
    built: Built, tmp_path: Path
) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="30", VGPU_LOG_LEVEL="info")
    r = run(built, "t_sm", "link", "events_fail", environ=environ)
    assert r.returncode == 0, r.stderr
    assert r.int("failing_launches") > 0  # unmeasured, not refused
    assert "a timing event failed (CUDA error 709)" in r.stderr
    assert r.stderr.count("a timing event failed") == 1  # logged once
    assert 0.22 <= share(r, "after_share") <= 0.38, r.values


def test_a_forked_child_launches_on_under_the_limit(built: Built, tmp_path: Path) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="30")
    r = run(built, "t_sm", "link", "fork", environ=environ)
    assert r.returncode == 0 and r.int("child_status") == 0, r.stderr
    assert 0.2 <= share(r, "child_share") <= 0.38, r.values


def test_a_driver_that_hands_out_internal_addresses_is_still_limited(built: Built, tmp_path: Path) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="30", STUB_CUDA_PROC_TRAMPOLINES="1")
    r = run(built, "t_sm", "procaddr_ptds", "rate", "kernel", "0.6", environ=environ)
    assert 0.22 <= share(r) <= 0.36, r.values


@pytest.mark.parametrize("kernel_us", ["20", "5000"])
def test_short_and_long_kernels_are_held_to_the_limit_too(
    built: Built, tmp_path: Path, kernel_us: str
) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="30", TEST_KERNEL_US=kernel_us)
    r = run(built, "t_sm", "link", "rate", "kernel", "1.5", environ=environ)
    assert 0.22 <= share(r) <= 0.36, r.values


# Kernels shorter than 10 µs take the sampled path: one launch in 32 (at random) is measured and
# stands for the thread's launches since its last measured one; the rest are charged a prediction
# against an allowance the process takes from the bucket in chunks (docs/hook.md).
SHORT = {"TEST_KERNEL_US": "4"}


@pytest.mark.parametrize("limit", [15, 25])
def test_short_kernels_are_sampled_and_still_held_to_the_limit(
    built: Built, tmp_path: Path, limit: int
) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT=str(limit), **SHORT)
    r = run(built, "t_sm", "link", "rate", "kernel", "1.5", environ=environ)
    # (unlimited, this loop keeps the stub's device 40-45 % busy on the 2-core VM)
    assert limit / 100 - 0.08 <= share(r) <= limit / 100 + 0.04, r.values
    # the samples' measure, extrapolated, is the stub's busy time within a few per cent; an idle
    # stream's launch latency (the documented over-count) makes it read a little high, never low:
    # with CI's three workers on two cores that latency grows (1.108 once, 2026-12-05)
    assert 0.97 * r.int("busy_ns") <= r.int("region_busy_ns") <= 1.15 * r.int("busy_ns"), r.values


def test_short_kernels_of_two_processes_of_two_threads_share_one_limit(built: Built, tmp_path: Path) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="30", **SHORT)
    shares = _shares_of_two(built, environ, "link", "rate", "kernel", "2", "created", "2")
    assert 0.22 <= sum(shares) <= 0.34, shares
    assert min(shares) >= 0.07, shares


def test_short_kernels_follow_a_live_resize(built: Built, tmp_path: Path) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="25", **SHORT)
    steps = "1.2:limit=25,1.2:limit=10,1.2:limit=25"
    r = run(built, "t_sm", "link", "phases", "kernel", steps, environ=environ)
    assert 0.17 <= share(r, "step0_share") <= 0.29, r.values
    assert 0.06 <= share(r, "step1_share") <= 0.13, r.values
    assert 0.17 <= share(r, "step2_share") <= 0.29, r.values


def test_kernels_that_turn_long_after_short_ones_are_held_at_once(built: Built, tmp_path: Path) -> None:
    # the sampled path's predictions were of 4 µs kernels; the first measured 1 ms one settles the
    # launches before it and takes the device back to measuring every launch
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="25", **SHORT)
    steps = "1,1.5:kernel_us=1000,1.5:kernel_us=4"
    r = run(built, "t_sm", "link", "phases", "kernel", steps, environ=environ)
    assert 0.17 <= share(r, "step0_share") <= 0.29, r.values
    assert 0.19 <= share(r, "step1_share") <= 0.30, r.values
    assert 0.17 <= share(r, "step2_share") <= 0.29, r.values


def test_short_kernels_beside_a_capture_neither_land_in_it_nor_break_it(built: Built, tmp_path: Path) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="10", **SHORT)
    r = run(built, "t_sm", "link", "capture", environ=environ)
    assert r.returncode == 0, r.stderr
    assert r.int("captured") == 2000
    assert r.int("throttled_ns") == 0 and r.int("region_busy_ns") == 0
    assert 0.05 <= share(r, "other_share") <= 0.16, r.values
    assert r.int("events_on_capturing") == 0 and r.int("violations") == 0


def test_short_kernels_of_a_forked_child_are_held_too(built: Built, tmp_path: Path) -> None:
    environ = limited(built, tmp_path / "region", CUDA_DEVICE_SM_LIMIT="30", **SHORT)
    r = run(built, "t_sm", "link", "fork", environ=environ)
    assert r.returncode == 0 and r.int("child_status") == 0, r.stderr
    assert 0.2 <= share(r, "child_share") <= 0.38, r.values


def test_a_launch_bound_loop_is_never_charged_more_than_the_wall_time_it_took(
    built: Built, tmp_path: Path
) -> None:
    # A driver's launch and event record take the host µs (here 2.4 and 1), and on an idle stream a
    # sample's start event runs at once while its kernel (0.3 µs) only comes when the host has
    # submitted it: the sample measured the host's calls, about 1.5 times the wall time of a launch
    # back to back, and standing for 32 launches it made a 99 % cap hold a loop that keeps the
    # device 11 % busy (an empty kernel on an H100: 4.89 µs a launch under the cap, 2.60 bare).
    # b_launch: 3 x (1000 + 100000) launches back to back, nothing else in its loop.
    environ = limited(
        built,
        tmp_path / "region",
        CUDA_DEVICE_SM_LIMIT="99",
        STUB_CUDA_KERNEL_US="0.3",
        STUB_CUDA_LAUNCH_US="2.4",
        STUB_CUDA_RECORD_US="1",
    )
    proc = subprocess.run(
        [str(built.lib.parent / "b_launch"), "100000", "3"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    values = dict(line.split("=", 1) for line in proc.stdout.split())
    launches, per_launch = 3 * 101000, float(values["launch_ns"])
    wall = launches * per_launch
    assert int(values["busy_ns"]) <= 1.05 * wall, values
    assert int(values["throttled_ns"]) <= 0.02 * wall, values
