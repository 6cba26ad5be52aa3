"""Placement: across nodes, a Ray cluster of several raylets on this machine, labelled with
the `prefill` and `decode` custom resources, where the launcher puts each pool on its own
nodes; on one host, a private local Ray that offers the pools' labels itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from splitserve.config import load_config
from splitserve.services.launch.deployment import (
    Deployment,
    bundles_by_node,
    local_label_totals,
    wait_placed,
)

REPO = Path(__file__).resolve().parent.parent
NODE_MEMORY = 80 << 20
TINY_ENGINE = "{kv_cache_bytes: 8388608, max_model_len: 128, max_num_seqs: 4}"


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, dict[str, str]]]:
    """A head without pool labels, one prefill node and one decode node; kind -> node id.
    One cluster for the module (its start is most of a test's time): each test removes the
    workers it started, and the expert-parallel test, which adds a second decode node, runs
    after the test that expects one."""
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


def labelled_pools(address: str) -> list[str]:
    """Overrides: join the test cluster, each pool on its labelled nodes (half a label per
    replica), tiny CPU shares and engines, sockets on each node's own address."""
    return [
        f"ray.address={address}",
        "server.internal_host=node",
        "pools.prefill.resources={prefill: 0.5}",
        "pools.decode.resources={decode: 0.5}",
        "pools.prefill.num_cpus=0.1",
        "pools.decode.num_cpus=0.1",
        f"pools.prefill.engine={TINY_ENGINE}",
        f"pools.decode.engine={TINY_ENGINE}",
    ]


def actor_node(actor: Any) -> str:
    node_id: str = ray._private.state.state.actor_table(actor._actor_id.hex())["Address"]["NodeID"]
    return node_id


@pytest.mark.slow
def test_prefill_actors_land_on_prefill_nodes_and_decode_actors_on_decode_nodes(
    cluster: tuple[Cluster, dict[str, str]],
) -> None:
    ray_cluster, nodes = cluster
    config = load_config(
        None,
        [
            "model=shape:tiny-llama",
            *labelled_pools(ray_cluster.address),
            "pools.prefill.replicas=2",
            "pools.decode.replicas=2",
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
        deployment.add_replicas({"decode": 1})
        assert actor_node(deployment.replicas["decode-2"].actor) == nodes["decode"]
    finally:
        deployment.stop()


@pytest.mark.slow
def test_an_expert_parallel_group_spans_nodes_with_its_ranks_numbered_node_by_node(
    cluster: tuple[Cluster, dict[str, str]],
) -> None:
    """A decode group of 4 ranks on two decode nodes (2 ranks fit on each): one placement
    group, ranks 0-1 on one node and 2-3 on the other, each bound on its own node's address;
    every rank started, so the 4 engines formed their group across the nodes."""
    ray_cluster, nodes = cluster
    second = ray_cluster.add_node(
        num_cpus=1, resources={"decode": 1}, object_store_memory=NODE_MEMORY
    )
    ray_cluster.wait_for_nodes()
    config = load_config(
        None,
        [
            "model=shape:tiny-mixtral",
            *labelled_pools(ray_cluster.address),
            "pools.decode.expert_parallel=4",
        ],
    )
    deployment = Deployment(config)
    try:
        deployment.start_ray()
        deployment.start_workers()
        ranks = [deployment.replicas[f"decode-0.{r}"] for r in range(4)]
        assert len({id(r.placement_group) for r in ranks}) == 1
        placed = [actor_node(r.actor) for r in ranks]
        assert placed[0] == placed[1] and placed[2] == placed[3]
        assert {placed[0], placed[2]} == {nodes["decode"], second.node_id}
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        bound = {w["worker_id"]: w["request_addr"] for w in deployment.workers}
        for rank, node in enumerate(placed):
            assert bound[f"decode-0.{rank}"].startswith(f"tcp://{addresses[node]}:")
        deployment.remove_replica("decode-0.2")  # a rank's removal takes its whole group
        assert sorted(w["worker_id"] for w in deployment.workers) == ["prefill-0"]
    finally:
        deployment.stop()


def test_bundles_are_ranked_node_by_node_in_the_order_nodes_first_appear() -> None:
    assert bundles_by_node(["a", "b", "a", "c", "b", "a"]) == [0, 2, 5, 1, 4, 3]
    assert bundles_by_node(["a"]) == [0]


def test_a_private_ray_offers_each_label_its_replicas_demand_rounded_up_to_whole_units() -> None:
    gpu_1p1d = load_config(REPO / "configs" / "gpu-1p1d.yaml")
    assert local_label_totals(gpu_1p1d.pools) == {"prefill_node": 1.0, "decode_node": 1.0}
    shared = load_config(
        None,
        [
            "pools.prefill.resources={node: 0.25, prefill: 1.1}",
            "pools.prefill.replicas=10",
            "pools.decode.resources={node: 0.25}",
            "pools.decode.replicas=3",
        ],
    )
    assert local_label_totals(shared.pools) == {"node": 4.0, "prefill": 11.0}


@pytest.mark.slow
def test_fractional_node_labels_start_every_worker_on_a_private_one_host_ray() -> None:
    config = load_config(
        REPO / "configs" / "gpu-1p1d.yaml",
        [
            "model=shape:tiny-llama",
            "transfer.backend=gloo",
            "pools.prefill.replicas=2",
            *(
                f"pools.{pool}.{key}"
                for pool in ("prefill", "decode")
                for key in ("device=cpu", "num_threads=1", f"engine={TINY_ENGINE}")
            ),
        ],
    )
    assert config.ray.address is None
    assert config.pools["prefill"].resources == {"prefill_node": 0.001}
    deployment = Deployment(config)
    try:
        deployment.start_ray()
        labels = {k: v for k, v in ray.cluster_resources().items() if k.endswith("_node")}
        assert labels == {"prefill_node": 1.0, "decode_node": 1.0}
        deployment.start_workers()
        assert sorted(w["worker_id"] for w in deployment.workers) == [
            "decode-0",
            "prefill-0",
            "prefill-1",
        ]
    finally:
        deployment.stop()
    assert not ray.is_initialized()


def test_a_replica_waits_for_room_until_its_deadline_saying_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """wait_placed: True as soon as the placement lands, a progress line every 10 s while it
    waits, False at the deadline (the last wait cut to it)."""
    clock = [0.0]

    def placed_at(when: float) -> Any:
        def ready(seconds: float) -> bool:
            if clock[0] + seconds >= when:
                clock[0] = max(clock[0], when)
                return True
            clock[0] += seconds
            return False

        return ready

    def now() -> float:
        return clock[0]

    assert wait_placed(placed_at(25.0), 60.0, "decode-3 ({'GPU': 1})", 10.0, now)
    assert clock[0] == 25.0
    assert capsys.readouterr().out.splitlines() == [
        "splitserve: waiting for room for decode-3 ({'GPU': 1}) in the Ray cluster: "
        f"{s} s of 60 s"
        for s in (10, 20)
    ]
    clock[0] = 0.0
    assert not wait_placed(placed_at(1e9), 35.0, "decode-3", 10.0, now)
    assert clock[0] == 35.0
    assert len(capsys.readouterr().out.splitlines()) == 3
