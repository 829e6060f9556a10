"""bench_mps.py's markdown: the records it emits (JSON lines, one a figure) into the tables it prints.

Records: {"kind": "header"} once; per tenant process {"kind": "tenant", "mode", "lift", "tenant",
"pid", "mps_client", "mps_env"}; per run and tenant {"kind": "run", "workload", "rate", "unit",
"share"}; per tenant after its mode's runs {"kind": "probe", "asked_mib", "got_mib"}; and
{"kind": "error", "workload", "error"} where a group stopped.
"""

from __future__ import annotations

from typing import Any

Record = dict[str, Any]


def _find(records: list[Record], kind: str, **match: Any) -> list[Record]:
    return [r for r in records if r["kind"] == kind and all(r.get(k) == v for k, v in match.items())]


def _describe(label: str, describe: dict[str, str]) -> str:
    kind, _, n = label.partition("-")
    return describe.get(kind, label).format(n=n)


def _pair(records: list[Record], kind: str, key: str, fmt: str, **match: Any) -> str:
    """'A / B' of one figure of a group, or why not."""
    found = {r["tenant"]: r.get(key) for r in _find(records, kind, **match)}
    if not found:
        errors = _find(records, "error", mode=match.get("mode"), lift=match.get("lift"))
        return "error" if errors else "-"
    return " / ".join("-" if found.get(t) is None else fmt.format(found[t]) for t in sorted(found))


def _client(records: list[Record], mode: str, lift: str | None) -> str:
    tenants = sorted(_find(records, "tenant", mode=mode, lift=lift), key=lambda r: r["tenant"])
    if not tenants or tenants[0].get("mps_client") is None:
        return "-"
    return " / ".join("yes" if t["mps_client"] else "no" for t in tenants)


def _mps_env(records: list[Record], mode: str, lift: str) -> str:
    """Tenant A's CUDA_MPS_* as its C library had them after cuInit (the hook sets them there)."""
    tenants = {t["tenant"]: t.get("mps_env") or {} for t in _find(records, "tenant", mode=mode, lift=lift)}
    a, b = tenants.get("A"), tenants.get("B", {})
    if a is None or _client(records, mode, lift) == "-":
        return "-"
    pipe = a.get("CUDA_MPS_PIPE_DIRECTORY", "")
    where = "unset" if not pipe else "B's" if pipe == b.get("CUDA_MPS_PIPE_DIRECTORY") else "another"
    threads = a.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") or "unset"
    pinned = a.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") or "unset"
    return f"threads {threads}, pinned {pinned}, pipe {where}"


def _shares(records: list[Record], mode: str, workload: str, lift: str | None = None) -> dict[str, float]:
    found = _find(records, "run", mode=mode, lift=lift, workload=workload)
    return {r["tenant"]: r["share"] for r in found if r.get("share") is not None}


def goals(records: list[Record], labels: list[str]) -> list[str]:
    """Issue 39's goals as it words them, each met or not by this run's figures (absent: not run)."""
    out: list[str] = []

    def check(what: str, ok: bool | None) -> None:
        out.append(f"- {what}: {'not run' if ok is None else 'met' if ok else 'MISSED'}")

    def each(mode: str, workload: str, floor: float, lift: str | None = None) -> bool | None:
        shares = _shares(records, mode, workload, lift)
        return min(shares.values()) >= floor if len(shares) == 2 else None

    serving = [label for label in labels if label.startswith("serve-")]
    check("ours-mps prefill: each tenant >= 0.65 of a dedicated card", each("ours-mps", "prefill", 0.65))
    check("ours-mps decode: each >= 0.95", each("ours-mps", "decode", 0.95))
    # low concurrency: the fewest in flight when 8 or fewer; high: the most when 32 or more (a run
    # of serve-32 alone is not checked against the low goal)
    inflight = {label: int(label.split("-", 1)[1]) for label in serving}
    low = min(serving, key=inflight.__getitem__, default=None)
    high = max(serving, key=inflight.__getitem__, default=None)
    if low is not None and inflight[low] <= 8:
        check(f"ours-mps {low}: each >= 0.70 of dedicated tokens/s", each("ours-mps", low, 0.70))
    if high is not None and inflight[high] >= 32:
        check(f"ours-mps {high}: each >= 0.90", each("ours-mps", high, 0.90))
    driver = _shares(records, "driver", "prefill")
    floor = min(driver.values()) if len(driver) == 2 else None
    check(
        "caps prefill: each keeps at least what the driver's time-slicing gives",
        None if floor is None else each("caps", "prefill", floor - 0.01),
    )
    lifted = _shares(
        records,
        "ours-mps",
        next((r["workload"] for r in _find(records, "run", lift="ours-mps")), ""),
        "ours-mps",
    )
    probe = {r["tenant"]: r for r in _find(records, "probe", lift="ours-mps")}
    held = None
    if len(lifted) == 2 and len(probe) == 2:
        held = lifted["A"] <= lifted["B"] * 1.1 and probe["A"]["got_mib"] < probe["A"]["asked_mib"]
    check("ours-mps: the lifting tenant gets no more threads or memory than its grant", held)
    return out


def render(
    records: list[Record],
    labels: list[str],
    modes: list[str],
    describe: dict[str, str],
    lifts: dict[str, str],
) -> str:
    """The tables: workloads x modes, the memory and MPS client rows, then the lifts (name: what A tries)."""
    head = next((r for r in records if r["kind"] == "header"), {})
    torch = next((r.get("torch") for r in records if r["kind"] == "tenant" and r.get("torch")), "?")
    lines = [
        f"bench_mps on {head.get('device', '?')}, PyTorch {torch}: each tenant's rate over the same workload "
        f"alone on the card (no hook), tenant A / tenant B; {head.get('seconds')} s windows after "
        f"{head.get('warmup')} s together; caps and MPS at {head.get('cores')} % of the SMs, "
        f"{head.get('limit_mib')} MiB each",
        "",
        "| workload | alone | " + " | ".join(modes) + " |",
        "| --- | --- |" + " --- |" * len(modes),
    ]
    for label in labels:
        alone = _find(records, "run", mode="alone", workload=label)
        first = f"{alone[0]['rate']:.1f} {alone[0]['unit']}/s" if alone else "-"
        cells = [_pair(records, "run", "share", "{:.2f}", mode=m, lift=None, workload=label) for m in modes]
        lines.append(f"| {_describe(label, describe)} | {first} | " + " | ".join(cells) + " |")
    asked = next((r["asked_mib"] for r in records if r["kind"] == "probe"), 0)
    probes = [_pair(records, "probe", "got_mib", "{}", mode=m, lift=None) for m in ("alone", *modes)]
    lines.append(f"| memory: MiB got of {asked} asked | " + " | ".join(probes) + " |")
    lines.append("| an MPS client | - | " + " | ".join(_client(records, m, None) for m in modes) + " |")
    ran = {r["lift"]: r["mode"] for r in records if r.get("lift")}
    if ran:
        lines += [
            "",
            "Lifting: tenant A tries to lift its limits, tenant B stays within them",
            "",
            "| lift | tenant A tries | A / B, share of alone | memory: MiB got, A / B | MPS client, A / B "
            "| A's CUDA_MPS_* after cuInit |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for lift, tries in lifts.items():
            if lift not in ran:
                continue
            mode = ran[lift]
            runs = _find(records, "run", lift=lift)
            workload = runs[0]["workload"] if runs else ""
            share = _pair(records, "run", "share", "{:.2f}", mode=mode, lift=lift)
            got = _pair(records, "probe", "got_mib", "{}", mode=mode, lift=lift)
            lines.append(
                f"| {lift} | {tries} | {share} ({workload}) | {got} | {_client(records, mode, lift)} "
                f"| {_mps_env(records, mode, lift)} |"
            )
    lines += ["", "Issue 39's goals:", *goals(records, labels)]
    errors = _find(records, "error")
    if errors:
        lines += ["", "Errors:"]
        lines += [
            f"- {e['mode']}{'/' + e['lift'] if e.get('lift') else ''} {e.get('workload') or ''}: "
            f"{e['error'][:600]}"
            for e in errors
        ]
    return "\n".join(lines)
