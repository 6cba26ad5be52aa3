"""Deployment config: YAML files, dotted overrides, and errors that name the bad key."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.config import DEFAULT_CONFIG, ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent


def test_default_is_local_yaml_with_one_colocated_worker() -> None:
    config = load_config()
    assert DEFAULT_CONFIG == REPO / "configs" / "local.yaml"
    assert config.model == "smollm2-135m-instruct"
    assert config.server.host == "127.0.0.1" and config.server.port == 8000
    assert config.server.api_keys == ()
    [(name, pool)] = config.pools.items()
    assert (pool.role, pool.replicas, pool.device) == ("both", 1, "cpu")
    engine = config.engine_config(name)
    assert (engine.model, engine.device, engine.max_model_len) == (config.model, "cpu", 2048)


def test_colocated_yaml_loads() -> None:
    config = load_config(REPO / "configs" / "colocated.yaml")
    assert [p.role for p in config.pools.values()] == ["both"]


def test_dotted_overrides_parse_values_as_yaml() -> None:
    config = load_config(
        None,
        [
            "server.port=9000",
            "server.api_keys=[a, b]",
            "pools.colocated.replicas=2",
            "pools.colocated.engine.max_num_seqs=8",
            "pools.colocated.num_cpus=0.5",
            "ray.address=auto",
        ],
    )
    assert config.server.port == 9000
    assert config.server.api_keys == ("a", "b")
    assert config.pools["colocated"].replicas == 2
    assert config.engine_config("colocated").max_num_seqs == 8
    assert config.pools["colocated"].num_cpus == 0.5
    assert config.ray.address == "auto"


def test_override_can_add_a_pool_with_defaults() -> None:
    config = load_config(None, ["pools.extra.replicas=3"])
    assert config.pools["extra"].replicas == 3 and config.pools["extra"].role == "both"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("server.prot=1", "unknown key server.prot"),
        ("server.port=abc", "server.port must be int, got 'abc'"),
        ("server.port=70000", "server.port must be in [0, 65535]"),
        ("server.max_n=true", "server.max_n must be int, got True"),
        ("pools.colocated.role=prefill", "role 'prefill' is not supported"),
        ("pools.colocated.replicas=0", "replicas must be at least 1"),
        ("pools.colocated.engine.block_size=3", "pools.colocated.engine: block_size"),
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
