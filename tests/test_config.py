"""Deployment config: YAML files, dotted overrides, and errors that name the bad key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from splitserve.config import DEFAULT_CONFIG, ConfigError, load_config
from splitserve.engine.config import EngineConfig

REPO = Path(__file__).resolve().parent.parent


def test_default_is_local_yaml_with_one_prefill_and_one_decode_worker() -> None:
    config = load_config()
    assert DEFAULT_CONFIG == REPO / "configs" / "local.yaml"
    assert config.model == "smollm2-135m-instruct"
    assert config.server.host == "127.0.0.1" and config.server.port == 8000
    assert config.server.api_keys == ()
    assert config.disaggregated
    roles = {name: (p.role, p.replicas, p.device) for name, p in config.pools.items()}
    assert roles == {"prefill": ("prefill", 1, "cpu"), "decode": ("decode", 1, "cpu")}
    assert sum(p.num_cpus for p in config.pools.values()) <= 2
    assert (config.transfer.backend, config.transfer.fault_send_delay_s) == ("auto", 0.0)
    engine = config.engine_config("decode")
    assert (engine.model, engine.device, engine.max_model_len) == (config.model, "cpu", 2048)


def test_colocated_yaml_loads() -> None:
    config = load_config(REPO / "configs" / "colocated.yaml")
    assert [p.role for p in config.pools.values()] == ["both"]
    assert not config.disaggregated


def test_gpu_1p1d_places_each_pool_on_its_labelled_nodes_with_one_gpu() -> None:
    config = load_config(REPO / "configs" / "gpu-1p1d.yaml")
    assert config.transfer.backend == "nccl"
    assert config.pools["prefill"].bundle() == {"CPU": 2.0, "GPU": 1.0, "prefill_node": 0.001}
    assert config.pools["decode"].bundle() == {"CPU": 2.0, "GPU": 1.0, "decode_node": 0.001}


def test_the_prefill_decode_ratio_is_two_numbers() -> None:
    config = load_config(None, ["pools.prefill.replicas=3", "pools.decode.replicas=2"])
    assert [config.pools[n].replicas for n in ("prefill", "decode")] == [3, 2]


def test_dotted_overrides_parse_values_as_yaml() -> None:
    config = load_config(
        None,
        [
            "server.port=9000",
            "server.api_keys=[a, b]",
            "pools.decode.replicas=2",
            "pools.decode.engine.max_num_seqs=8",
            "pools.prefill.num_cpus=0.25",
            "ray.address=auto",
        ],
    )
    assert config.server.port == 9000
    assert config.server.api_keys == ("a", "b")
    assert config.pools["decode"].replicas == 2
    assert config.engine_config("decode").max_num_seqs == 8
    assert config.engine_config("prefill").max_num_seqs == 64
    assert config.pools["prefill"].num_cpus == 0.25
    assert config.ray.address == "auto"


def test_pool_engine_overrides_reach_the_engine_config_of_that_pool_only() -> None:
    config = load_config(
        None,
        [
            "pools.decode.engine.cuda_graph_max_batch=8",
            "pools.decode.engine.overlap_scheduling=false",
            "pools.prefill.engine.overlap_scheduling=null",
        ],
    )
    decode, prefill = config.engine_config("decode"), config.engine_config("prefill")
    assert (decode.cuda_graph_max_batch, decode.overlap_scheduling) == (8, False)
    assert (prefill.cuda_graph_max_batch, prefill.overlap_scheduling) == (512, None)


def test_a_pool_engine_takes_every_engine_config_field_but_those_set_elsewhere(
    tmp_path: Path,
) -> None:
    """model and device come from the deployment and the pool; speculative and
    expert_parallel_size from the pool's own ``speculative`` and ``expert_parallel``."""
    settable = {
        f.name: getattr(EngineConfig(), f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name not in ("model", "device", "speculative", "expert_parallel_size")
    }
    assert {"cuda_graph_max_batch", "overlap_scheduling", "seed"} <= set(settable)
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"model": "m", "pools": {"w": {"engine": settable}}}))
    config = load_config(path, ["pools.w.device=cuda"])
    assert config.engine_config("w") == EngineConfig(model="m", device="cuda")
    assert config.pools["w"].engine == config.engine_config("w")


def test_each_pool_engine_runs_the_deployment_model_on_the_pool_device() -> None:
    config = load_config(REPO / "configs" / "gpu-1p1d.yaml", ["model=shape:smollm2-135m"])
    engines = {name: config.engine_config(name) for name in config.pools}
    assert {n: (e.model, e.device, e.dtype) for n, e in engines.items()} == {
        "prefill": ("shape:smollm2-135m", "cuda", "bfloat16"),
        "decode": ("shape:smollm2-135m", "cuda", "bfloat16"),
    }


def test_override_can_add_a_pool_with_defaults() -> None:
    config = load_config(REPO / "configs" / "colocated.yaml", ["pools.extra.replicas=3"])
    assert config.pools["extra"].replicas == 3 and config.pools["extra"].role == "both"


def test_a_vision_pool_joins_prefill_and_decode_pools() -> None:
    config = load_config(REPO / "configs" / "vision-tiny.yaml")
    assert sorted(p.role for p in config.pools.values()) == ["decode", "prefill", "vision"]
    assert config.images.allowed_hosts == ()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("server.prot=1", "unknown key server.prot"),
        ("server.port=abc", "server.port must be int, got 'abc'"),
        ("server.port=70000", "server.port must be in [0, 65535]"),
        ("server.max_n=true", "server.max_n must be int, got True"),
        ("pools.decode.role=encoder", "role 'encoder' is not supported"),
        ("pools.decode.role=vision", "exactly one prefill pool and one decode pool"),
        ("images.max_pixels=0", "images.max_pixels must be at least 1"),
        ("pools.decode.role=prefill", "exactly one prefill pool and one decode pool"),
        ("pools.extra.role=both", "exactly one prefill pool and one decode pool"),
        ("transfer.backend=mpi", "transfer.backend 'mpi' is not one of"),
        ("transfer.timeout_s=0", "transfer.timeout_s must be positive"),
        ("pools.decode.resources={gpu_node: -1}", "resources must be non-negative"),
        ("pools.decode.replicas=0", "replicas must be at least 1"),
        ("pools.decode.engine.block_size=3", "pools.decode.engine: block_size"),
        (
            "pools.decode.engine.overlap_scheduling=maybe",
            "pools.decode.engine.overlap_scheduling must be bool, got 'maybe'",
        ),
        (
            "pools.decode.engine.cuda_graph_max_batch=1.5",
            "pools.decode.engine.cuda_graph_max_batch must be int, got 1.5",
        ),
        (
            "pools.decode.engine.num_kv_blocks=abc",
            "pools.decode.engine.num_kv_blocks must be int, got 'abc'",
        ),
        ("pools.decode.engine.speed=1", "unknown key pools.decode.engine.speed"),
        (
            "pools.decode.engine.model=other",
            "pools.decode.engine.model cannot be set: it is the deployment's `model`",
        ),
        (
            "pools.prefill.engine.device=cuda",
            "pools.prefill.engine.device cannot be set: it is the pool's `device`",
        ),
        ("server.port.x=1", "server.port is not a mapping"),
        ("noequals", "is not of the form dotted.key=value"),
    ],
)
def test_bad_values_are_errors_naming_the_path(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


def test_unreadable_and_invalid_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping at the top level"):
        load_config(bad)


def test_expert_parallel_is_the_pools_and_runs_decode_and_colocated_pools_only() -> None:
    config = load_config(None, ["pools.decode.expert_parallel=4"])
    assert config.pools["decode"].expert_parallel == 4
    assert config.engine_config("decode").expert_parallel_size == 4
    assert config.engine_config("prefill").expert_parallel_size == 1
    with pytest.raises(ConfigError, match="expert_parallel groups run decode and colocated"):
        load_config(None, ["pools.prefill.expert_parallel=2"])
    with pytest.raises(ConfigError, match="expert_parallel must be at least 1"):
        load_config(None, ["pools.decode.expert_parallel=0"])
    with pytest.raises(ConfigError, match="it is the pool's `expert_parallel`"):
        load_config(None, ["pools.decode.engine.expert_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"pool name 'dec\.ode'"):  # ranks: <pool>-<i>.<rank>
        load_config(None, ["pools={dec.ode: {role: both}}"])


def test_expert_load_dir_needs_the_load_recorded() -> None:
    with pytest.raises(ValueError, match="expert_load_dir needs record_expert_load"):
        EngineConfig(model="m", expert_load_dir="/tmp/load")
    assert EngineConfig(model="m", record_expert_load=True, expert_load_dir="d").expert_load_dir


def test_a_served_pool_recording_the_expert_load_must_say_where_it_goes() -> None:
    with pytest.raises(ConfigError, match="a served record_expert_load needs"):
        load_config(overrides=["pools.decode.engine.record_expert_load=true"])
    config = load_config(
        overrides=[
            "pools.decode.engine.record_expert_load=true",
            "pools.decode.engine.expert_load_dir=/tmp/load",
        ]
    )
    assert config.pools["decode"].engine.expert_load_dir == "/tmp/load"
