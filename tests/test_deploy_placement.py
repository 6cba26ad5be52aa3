"""Placement across nodes: a Ray cluster of several raylets on this machine, labelled with
the `prefill` and `decode` custom resources; the launcher puts each pool on its own nodes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from splitserve.config import load_config
from splitserve.services.launch.deployment import Deployment

pytestmark = pytest.mark.slow
NODE_MEMORY = 80 << 20


@pytest.fixture
def cluster() -> Iterator[tuple[Cluster, dict[str, str]]]:
    """A head without pool labels, one prefill node and one decode node; kind -> node id."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": NODE_MEMORY},
    )
    nodes = {"head": cluster.head_node.node_id}
    try:
        for kind in ("prefill", "decode"):
            node = cluster.add_node(
                num_cpus=1, resources={kind: 1}, object_store_memory=NODE_MEMORY
            )
            nodes[kind] = node.node_id
        cluster.wait_for_nodes()
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def actor_node(actor: Any) -> str:
    node_id: str = ray._private.state.state.actor_table(actor._actor_id.hex())["Address"]["NodeID"]
    return node_id


def test_prefill_actors_land_on_prefill_nodes_and_decode_actors_on_decode_nodes(
    cluster: tuple[Cluster, dict[str, str]],
) -> None:
    ray_cluster, nodes = cluster
    engine = "{kv_cache_bytes: 8388608, max_model_len: 128, max_num_seqs: 4}"
    config = load_config(
        None,
        [
            "model=shape:smollm2-135m",
            f"ray.address={ray_cluster.address}",
            "server.internal_host=node",
            "pools.prefill.resources={prefill: 0.5}",
            "pools.decode.resources={decode: 0.5}",
            "pools.prefill.replicas=2",
            "pools.decode.replicas=2",
            "pools.prefill.num_cpus=0.1",
            "pools.decode.num_cpus=0.1",
            f"pools.prefill.engine={engine}",
            f"pools.decode.engine={engine}",
        ],
    )
    deployment = Deployment(config)
    try:
        deployment.start_ray()
        deployment.start_workers()
        placed = {
            worker_id: actor_node(replica.actor)
            for worker_id, replica in deployment.replicas.items()
        }
        assert placed == {
            "prefill-0": nodes["prefill"],
            "prefill-1": nodes["prefill"],
            "decode-0": nodes["decode"],
            "decode-1": nodes["decode"],
        }
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        for info in deployment.workers:
            host = addresses[placed[info["worker_id"]]]
            assert info["request_addr"].startswith(f"tcp://{host}:")
        assert sorted(w["worker_id"] for w in deployment.workers) == sorted(placed)
        deployment.remove_replica("decode-1")
        deployment.add_replicas("decode", 1)
        assert actor_node(deployment.replicas["decode-2"].actor) == nodes["decode"]
    finally:
        deployment.stop()
