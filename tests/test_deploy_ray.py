"""The `ray up` cluster files pass Ray's own cluster-config validation, as `ray up` runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from splitserve.config import load_config

REPO = Path(__file__).resolve().parent.parent
CLUSTER_FILES = sorted((REPO / "deploy" / "ray").glob("*.yaml"))


def read(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


def test_there_is_a_cloud_and_an_on_premises_cluster_file() -> None:
    providers = {read(p)["provider"]["type"] for p in CLUSTER_FILES}
    assert providers == {"aws", "local"}


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_cluster_file_passes_ray_validation(path: Path) -> None:
    validate_config(prepare_config(read(path)))


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_cluster_file_installs_splitserve_and_serves_its_config(path: Path) -> None:
    config = read(path)
    assert "python3 -m pip install -e ~/splitserve" in config["setup_commands"]
    serve = [c for c in config["head_start_ray_commands"] if "splitserve serve" in c]
    assert len(serve) == 1
    assert "--config ~/splitserve/configs/cluster-gpu.yaml --address auto" in serve[0]
    # Under a loop that starts it again whenever it exits with an error.
    assert serve[0].startswith("nohup bash -c 'until splitserve serve ")
    assert "; do " in serve[0] and "; done" in serve[0] and serve[0].endswith("&")


def test_cloud_file_has_prefill_and_decode_gpu_node_types_the_pools_ask_for() -> None:
    config = read(REPO / "deploy" / "ray" / "aws-gpu.yaml")
    deploy = load_config(REPO / "configs" / "cluster-gpu.yaml")
    types = config["available_node_types"]
    assert types["prefill_gpu"]["resources"] == {"GPU": 1, "prefill": 1}
    assert types["decode_gpu"]["resources"] == {"GPU": 1, "decode": 1}
    assert types["head"]["resources"] == {}
    assert deploy.pools["prefill"].bundle() == {"CPU": 2.0, "prefill": 1.0, "GPU": 1.0}
    assert deploy.pools["decode"].bundle() == {"CPU": 2.0, "decode": 1.0, "GPU": 1.0}
    assert deploy.ray.address == "auto"


def test_ray_validation_rejects_an_unknown_field() -> None:
    import jsonschema

    config = {**read(REPO / "deploy" / "ray" / "aws-gpu.yaml"), "prefill_nodes": 2}
    with pytest.raises(jsonschema.ValidationError, match="prefill_nodes"):
        validate_config(prepare_config(config))
