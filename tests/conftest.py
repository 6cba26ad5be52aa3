"""Shared fixtures: the real SmolLM2 model, its tokenizer and the transformers reference, and
one default `splitserve serve` deployment for the modules that only send it requests."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.gguf_file import read_gguf
from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.loader import load_tokenizer, resolve_model
from tests.support import keyed_deployment, ray_head
from tests.support.collect import collect_dropped_engines
from tests.support.disagg import PROMPTS, Reference, reference
from tests.support.reference import load_gguf_tensors
from tests.support.server_process import ServerProcess, serve, stop

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return resolve_model(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: str) -> Any:
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def make_llm(smollm2_tokenizer: Any) -> Callable[..., LLM]:
    """Builds a SmolLM2 LLM with engine overrides, reusing the loaded tokenizer."""

    def build(**overrides: Any) -> LLM:
        collect_dropped_engines()  # the engines of earlier tests first
        overrides.setdefault("max_model_len", 2048)
        config = EngineConfig(model=SMOLLM2, **overrides)
        return LLM.from_engine(LLMEngine(config, tokenizer=smollm2_tokenizer))

    return build


# Modules that start servers, Ray clusters or worker processes: marked `processes`. `make test`
# (tools/test.sh) runs them one after another in one pytest process and every other module in
# a second one beside it: two deployments side by side (a chaos or live-scaling test beside
# another server) ran their waits on restarts and heartbeats two to three times as long. A
# module with a tight latency bound (test_api_hung_redis) is here too: in the other lane it ran
# beside a whole deployment and once missed its bound (0.41 s against 0.25 s). Modules that
# start only light processes (two Gloo peers: test_transfer, test_expert_parallel; a stub HTTP
# server: test_bench_serve) run in the other lane, which finishes a minute or so earlier. So do
# deployments that neither restart workers nor bound a latency (test_deepseek_serving,
# test_disagg_2p1d, and the keyed deployment of test_api_errors and
# test_api_responses_messages): in this lane the suite took over 12 minutes. test_shape_serving
# (two deployments, 40 s) is here since the other lane grew to 9m23s against this one's 8m15s.
PROCESS_MODULES = frozenset(
    {
        "test_api_e2e",
        "test_api_fuzz",
        "test_api_edges_served",
        "test_api_hostile_served",
        "test_api_hung_redis",
        "test_deploy_placement",
        "test_deploy_scale",
        "test_disagg_chaos",
        "test_disagg_e2e",
        "test_disagg_faults",
        "test_expert_parallel_serving",
        "test_gemma3_served",
        "test_kv_cache_e2e",
        "test_observability",
        "test_shape_serving",
        "test_structured_api",
        "test_vision_e2e",
    }
)
# Modules that start their workers in the test process (threads and Gloo peers, no Ray): they
# run in the other lane, after all of its own modules. That lane finished 2 to 3 minutes
# before this one, which kept about one core busy in that time.
LATE_MODULES = frozenset(
    {
        "test_api_migration",
        "test_internal_sockets",
        "test_peer_blocks",
        "test_worker_failures",
        "test_worker_headers",
    }
)


SCALES_SHARED = frozenset({"test_deploy_scale"})
"""Modules that scale a shared deployment (up, then back to its replicas): they run after the
deployment's other users, so that none of those sees it scaled or its request log grown."""
SHARED_SERVERS = ("default_server", "keyed_server")
"""The session's shared deployments. Idle, one still takes about 6% of a core (heartbeats,
its Ray): each is stopped after the last test that uses it (pytest_runtest_teardown), and
the modules that use one run before the others of their lane."""
BY_NAME = {"test_observability": "default_server", "test_structured_api": "default_server"}
"""Modules that take a shared deployment by name (``request.getfixturevalue``), which their
tests' fixture names do not show."""


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _module_name(item) in PROCESS_MODULES:
            item.add_marker(pytest.mark.processes)
    sharing = {_module_name(item) for item in items if _shared_servers(item)}

    def order(item: pytest.Item) -> tuple[bool, bool, bool, bool]:
        """Stable: else unchanged. Whole modules move: their module fixtures start once."""
        module = _module_name(item)
        late, scales = module in LATE_MODULES, module in SCALES_SHARED
        return late, module not in sharing, scales, not _joins_ray_head(item)

    items.sort(key=order)


RAY_HEAD_MODULES = frozenset(
    {
        "test_deepseek_serving",
        "test_disagg_2p1d",
        "test_disagg_chaos",
        "test_disagg_faults",
        "test_expert_parallel_serving",
        "test_gemma3_served",
        "test_kv_cache_e2e",
        "test_observability",
        "test_shape_serving",
        "test_structured_api",
        "test_vision_e2e",
    }
)
"""Modules whose deployments join the shared Ray head (tests/support/ray_head.py), besides
the keyed deployment's: they run before the other modules of their lane, and the head
(about 4% of a core, idle) stops after the last of them. A module missing here still gets a
head: ``serve`` starts another."""


def _joins_ray_head(item: pytest.Item) -> bool:
    return _module_name(item) in RAY_HEAD_MODULES or "keyed_server" in _shared_servers(item)


def _shared_servers(item: pytest.Item) -> set[str]:
    names = set(getattr(item, "fixturenames", ())) & set(SHARED_SERVERS)
    by_name = BY_NAME.get(_module_name(item))
    return names | {by_name} if by_name else names


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A lane of `make test` (``-m processes``, ``-m "not processes"``) does not import the
    other lane's test modules only to deselect their tests: the process modules' lane
    collected in 4.4 s of CPU instead of 7.9 s."""
    lane = config.getoption("markexpr")
    name = collection_path.name
    if lane not in LANES or not (name.startswith("test_") and name.endswith(".py")):
        return None
    return True if (collection_path.stem in PROCESS_MODULES) != (lane == "processes") else None


LANES = ("processes", "not processes")


def _module_name(item: pytest.Item) -> str:
    module = getattr(item, "module", None)
    return "" if module is None else module.__name__.rsplit(".", 1)[-1]


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, transformers, Ray, the test modules: about 370,000
    objects) lives as long as the session. Frozen, it is no longer walked by every full
    collection (one per module, one per make_llm, Python's own), which took 0.27 s each for
    it alone; they walk only what the tests made since."""
    gc.collect()
    gc.freeze()
    last = {name: item for item in session.items for name in _shared_servers(item)}
    session.config.stash[LAST_USERS] = {id(item): name for name, item in last.items()}
    joining = [item for item in session.items if _joins_ray_head(item)]
    if joining:
        session.config.stash[LAST_RAY_HEAD_USER] = joining[-1]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A shared deployment stops after the last test that uses it (SHARED_SERVERS); the
    shared Ray head after the last that joins it (RAY_HEAD_MODULES), once that test's module
    fixtures, its deployments among them, are torn down."""
    name = item.config.stash.get(LAST_USERS, {}).get(id(item))
    server = item.config.stash.get(STARTED, {}).get(name or "")
    if server is not None:
        stop(server)
    try:
        return (yield)
    finally:
        if item is item.config.stash.get(LAST_RAY_HEAD_USER, None):
            ray_head.stop()


LAST_USERS = pytest.StashKey[dict[int, str]]()
LAST_RAY_HEAD_USER = pytest.StashKey[pytest.Item]()
STARTED = pytest.StashKey[dict[str, ServerProcess]]()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Back in the collector's sight for the interpreter's last collections at exit (frozen,
    Triton's bindings reported their objects as leaked)."""
    gc.unfreeze()


@pytest.fixture(scope="module", autouse=True)
def free_engines() -> Iterator[None]:
    """Collect the module's engines when it ends (tests/support/collect.py)."""
    yield
    collect_dropped_engines()


@pytest.fixture(scope="session")
def smollm2_llm(make_llm: Callable[..., LLM]) -> LLM:
    return make_llm()


@pytest.fixture(scope="session")
def prompts_reference(smollm2_llm: LLM) -> list[Reference]:
    """The offline engine's greedy outputs for tests/support/disagg.py's 30 prompts, computed
    once for the modules that send them to a deployment (1P1D and 2P1D, full and streamed)."""
    return reference(smollm2_llm, PROMPTS)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: str, smollm2_tokenizer: Any) -> Any:
    """transformers' Llama on the same GGUF file's tensors, dequantized to float32: its config
    from the file's hyperparameters by transformers' GGUF key table, its special token ids the
    tokenizer's, the tensors as transformers' GGUF loading puts them (load_gguf_tensors)."""
    from gguf import MODEL_ARCH
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    gguf = read_gguf(smollm2_path)
    config = {
        name: gguf.metadata[f"llama.{key}"]
        for key, name in GGUF_CONFIG_MAPPING["llama"].items()
        if f"llama.{key}" in gguf.metadata
    }
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in gguf.tensors)
    tok = smollm2_tokenizer
    special = ("bos", "eos", "pad", "unk")
    config |= {f"{s}_token_id": getattr(tok, f"{s}_token_id") for s in special}
    with no_init_weights():
        model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    processor = TENSOR_PROCESSORS["llama"](config=config)
    missing = load_gguf_tensors(model, smollm2_path, MODEL_ARCH.LLAMA, processor)
    assert missing == ["lm_head.weight"]  # tied to the embeddings
    model.tie_weights()
    return model


@pytest.fixture(scope="session")
def default_server(pytestconfig: pytest.Config) -> Iterator[ServerProcess]:
    """The default deployment (one prefill and one decode worker), started once for every
    module that only sends it requests and waits until they are done, and last for the one
    that scales it up and back (SCALES_SHARED). A module that kills its workers or needs
    other settings starts its own with ``serve``. This one starts its own Ray, exactly as
    `make serve` does; the others join one shared head."""
    with serve(private_ray=True) as server:
        pytestconfig.stash.setdefault(STARTED, {})["default_server"] = server
        yield server


@pytest.fixture(scope="session")
def keyed_server(pytestconfig: pytest.Config) -> Iterator[ServerProcess]:
    """The keyed deployment (tests/support/keyed_deployment.py), started once for the two
    modules that send it requests (test_api_errors, test_api_responses_messages), which run
    in the same lane; stopped after the last of their tests (SHARED_SERVERS)."""
    with serve(*keyed_deployment.SETTINGS, flags=keyed_deployment.FLAGS) as server:
        pytestconfig.stash.setdefault(STARTED, {})["keyed_server"] = server
        yield server
