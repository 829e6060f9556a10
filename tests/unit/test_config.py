"""Scheduler settings: precedence flag > environment > file > defaults, and errors naming the source."""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpu.core.config import SchedulerConfig, load_config
from vgpu.core.errors import ConfigError


def test_defaults_apply_when_nothing_is_given() -> None:
    cfg = load_config(env={})
    assert cfg == SchedulerConfig()
    assert (cfg.default_mem, cfg.default_cores, cfg.node_policy, cfg.gpu_policy) == (
        0,
        0,
        "binpack",
        "spread",
    )


def test_a_flag_beats_the_environment_which_beats_the_file(tmp_path: Path) -> None:
    f = tmp_path / "cfg.yaml"
    f.write_text("defaultMem: 1000\ndefaultCores: 10\nnodePolicy: spread\n")
    from_file = load_config(env={}, file=f)
    assert (from_file.default_mem, from_file.default_cores, from_file.node_policy) == (1000, 10, "spread")
    env = {"VGPU_DEFAULT_MEM": "2000", "VGPU_DEFAULT_CORES": "20"}
    from_env = load_config(env=env, file=f)
    assert (from_env.default_mem, from_env.default_cores, from_env.node_policy) == (2000, 20, "spread")
    flags = {"default_mem": 3000, "default_cores": None}
    from_flags = load_config(flags=flags, env=env, file=f)
    assert (from_flags.default_mem, from_flags.default_cores) == (3000, 20)


def test_a_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"VGPU_DEFAULT_MEM": "lots"})
    assert "VGPU_DEFAULT_MEM" in str(info.value)


def test_an_out_of_range_flag_names_the_flag() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(flags={"default_cores": 150}, env={})
    assert "--default-cores" in str(info.value) and "defaultCores" in str(info.value)


def test_an_unknown_policy_in_a_file_names_the_file_and_key(tmp_path: Path) -> None:
    f = tmp_path / "cfg.yaml"
    f.write_text("gpuPolicy: random\n")
    with pytest.raises(ConfigError) as info:
        load_config(env={}, file=f)
    assert str(f) in str(info.value) and "gpuPolicy" in str(info.value)


def test_an_unknown_key_in_a_file_is_rejected(tmp_path: Path) -> None:
    f = tmp_path / "cfg.yaml"
    f.write_text("defaultMemory: 5\n")
    with pytest.raises(ConfigError) as info:
        load_config(env={}, file=f)
    assert info.value.field == "defaultMemory"


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, file=tmp_path / "nope.yaml")
    assert isinstance(info.value.__cause__, OSError)


def test_reject_unsatisfiable_is_a_boolean_from_flag_environment_or_file(tmp_path: Path) -> None:
    assert load_config(env={}).reject_unsatisfiable is False
    f = tmp_path / "cfg.yaml"
    f.write_text("rejectUnsatisfiable: true\n")
    assert load_config(env={}, file=f).reject_unsatisfiable is True
    assert load_config(env={"VGPU_REJECT_UNSATISFIABLE": "false"}, file=f).reject_unsatisfiable is False
    assert load_config(flags={"reject_unsatisfiable": "True"}, env={}).reject_unsatisfiable is True
    with pytest.raises(ConfigError) as info:
        load_config(flags={"reject_unsatisfiable": "maybe"}, env={})
    assert "--reject-unsatisfiable" in str(info.value) and "true or false" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(env={"VGPU_REJECT_UNSATISFIABLE": "2"})
    assert "VGPU_REJECT_UNSATISFIABLE" in str(info.value)


def test_each_setting_is_either_a_scheduling_or_a_process_setting() -> None:
    import dataclasses

    from vgpu.core.config import ProcessSettings, SchedulingSettings

    every = {f.name for f in dataclasses.fields(SchedulerConfig)}
    scheduling = {f.name for f in dataclasses.fields(SchedulingSettings)}
    process = {f.name for f in dataclasses.fields(ProcessSettings)}
    assert scheduling.isdisjoint(process) and scheduling | process == every
    cfg = load_config({"node_policy": "spread", "listen": "127.0.0.1:1"}, env={})
    assert cfg.scheduling.node_policy == "spread" and cfg.process.listen == "127.0.0.1:1"
