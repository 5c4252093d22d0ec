"""The ray backends: engine cores (`data_parallel_backend="ray"`) and workers
(`executor="ray"`) as Ray actors (engine/executor/ray_utils.py).

One Ray cluster for the module: a fake two-node `Cluster` on this host, 2 CPUs a node, which
this process drives and every engine here joins. On it: the greedy tokens of DP 2 on Ray equal
DP 1's and the native launcher's, each rank on a node of its own (read back from Ray) and its
start in the trace; DP 2 x TP 2 with the workers as actors too; a killed actor named within the
liveness bounds, and its placement groups freed. Stopping by signals with the ray backend is in
tests/engine/test_stopping.py; a script that never shuts down and leaves nothing of its own
local cluster is here, as it must start that cluster itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import threading
import time

import pytest

from stepscope.engine import LLM, SamplingParams
from stepscope.engine.frontend.engine_group import EngineDeadError
from stepscope.traces import names
from stepscope.traces.backend.explain import startup
from stepscope.traces.backend.store import TraceStore
from tests.engine.test_data_parallel import TINY, tokens  # the DP tests' prompts and engine
from tests.process_tree import ProcessTree, wait_pids_gone

pytestmark = pytest.mark.slow  # a Ray cluster, and engines started on it


@pytest.fixture(scope="module")
def cluster():
    """Two nodes of 2 CPUs on this host, every process of it in one tree killed at the end."""
    import ray
    from ray.cluster_utils import Cluster

    tree = ProcessTree()
    with tree.adopting():
        fake = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
        )
        fake.add_node(num_cpus=2)
        fake.wait_for_nodes()
        ray.init(address=fake.address, logging_level="warning")
    try:
        yield fake
    finally:
        ray.shutdown()
        fake.shutdown()
        tree.kill()


def live_groups(wait_s: float = 10.0) -> list[str]:
    """Placement groups not removed, by name (waiting up to `wait_s` for none: a removal is
    asynchronous)."""
    from ray.util import placement_group_table

    deadline = time.monotonic() + wait_s
    while True:
        live = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
        if not live or time.monotonic() > deadline:
            return sorted(g["name"] for g in live)
        time.sleep(0.1)


def group_nodes(name: str) -> list[str]:
    """The node of each bundle of the live placement group `name`."""
    from ray.util import placement_group_table

    (group,) = [g for g in placement_group_table().values()
                if g["name"] == name and g["state"] != "REMOVED"]  # fmt: skip
    return list(group["bundles_to_node_id"].values())


@pytest.fixture(scope="module")
def dp1_tokens() -> list[list[int]]:
    with LLM(**TINY) as llm:
        return tokens(llm)


def test_dp2_on_ray_gives_the_native_tokens_one_rank_per_node(cluster, dp1_tokens, tmp_path):
    import ray

    with LLM(**TINY, executor="mp", data_parallel_size=2) as native:
        assert tokens(native) == dp1_tokens
    db = tmp_path / "ray.duckdb"
    with LLM(**TINY, data_parallel_size=2, data_parallel_backend="ray", trace_db=db) as llm:
        assert tokens(llm) == dp1_tokens
        actors = llm.client.group.procs
        nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        placed = [actors[rank].node_id for rank in (0, 1)]
        assert len(set(placed)) == 2 and set(placed) <= nodes, placed
        # The engine cores the API side knows are the actors' processes.
        cores = {p.dp_rank: p.pid for p in llm.processes() if p.role == "engine_core"}
        assert cores == {rank: actors[rank].pid for rank in (0, 1)}
        assert live_groups(0) == ["stepscope-engine-core-0", "stepscope-engine-core-1"]
    assert live_groups() == []
    assert wait_pids_gone(list(cores.values())) == []
    store = TraceStore(db, read_only=True)
    try:
        start = store.df(
            f"SELECT attributes FROM spans WHERE name = '{names.PROCESS_START}' ORDER BY start_ns"
        )
        attributes = [json.loads(a) for a in start["attributes"]]
        assert sorted(a[names.DP_RANK] for a in attributes) == [0, 1]
        assert {a[names.BACKEND] for a in attributes} == {"ray"}
        assert sorted(a[names.RAY_NODE_ID] for a in attributes) == sorted(placed)
        assert all(a[names.RAY_ACTOR_START_S] > 0 for a in attributes)
        first = int(store.df("SELECT min(start_ns) AS t FROM requests")["t"][0])
        started = startup(store, first)
    finally:
        store.close()
    assert started is not None and started["backend"] == "ray"
    assert started["ray_actor_start_s"] > 0 and started["ready_before_s"] >= 0
    assert started["engine_start_s"] >= started["ray_actor_start_s"]


def test_dp2_tp2_with_workers_as_actors_gives_the_dp1_tokens(cluster, dp1_tokens) -> None:
    layout = {"data_parallel_size": 2, "tensor_parallel_size": 2}
    backends = {"data_parallel_backend": "ray", "distributed_executor_backend": "ray"}  # vLLM's
    with LLM(**TINY, **layout, **backends) as llm:
        assert tokens(llm) == dp1_tokens
        procs = llm.processes()
        workers = sorted((p.dp_rank, p.rank) for p in procs if p.role == "worker")
        assert workers == [(0, 0), (0, 1), (1, 0), (1, 1)]
        # A rank's two workers are actors in the two bundles of its placement group, on the
        # node of its engine core; the ranks on different nodes.
        cores = llm.client.group.procs
        for rank in (0, 1):
            assert group_nodes(f"stepscope-engine-core-{rank}") == [cores[rank].node_id] * 2
        assert cores[0].node_id != cores[1].node_id
        pids = [p.pid for p in procs if p.role != "api"]
    assert live_groups() == []
    assert wait_pids_gone(pids) == []


def test_a_killed_actor_is_named_and_its_groups_freed(cluster) -> None:
    llm = LLM(**TINY, data_parallel_size=2, data_parallel_backend="ray")
    actor = llm.client.group.procs[1]
    killed_at: list[float] = []

    def kill_soon() -> None:
        time.sleep(1.0)
        killed_at.append(time.monotonic())
        os.kill(actor.pid, signal.SIGKILL)

    threading.Thread(target=kill_soon, daemon=True).start()
    long = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    with pytest.raises(EngineDeadError, match="DP rank 1.*Ray actor died") as error:
        while True:
            llm.generate(["Hello"] * 4, long, use_tqdm=False)
    # The same bound as a killed process's (tests/engine/test_engine_processes.py).
    assert time.monotonic() - killed_at[0] < 15.0, error.value
    llm.shutdown()
    assert live_groups() == []
    assert wait_pids_gone([llm.client.group.procs[0].pid, actor.pid]) == []


SCRIPT = textwrap.dedent(
    """
    import sys
    from stepscope.engine import LLM, SamplingParams

    llm = LLM(model="tiny-llama", num_kv_blocks=64, data_parallel_size=2,
              data_parallel_backend="ray", trace_db=sys.argv[1])
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    print(len(out[0].outputs[0].token_ids), flush=True)
    # no shutdown: the interpreter's exit stops the engine, then the Ray cluster it started
    """
)


def test_a_script_that_never_shuts_down_leaves_nothing_of_ray(tmp_path, process_tree) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local cluster
    db = tmp_path / "run.duckdb"
    done = process_tree.run([sys.executable, "-c", SCRIPT, str(db)], timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["4"]
    saved = [line for line in done.stderr.splitlines() if "trace saved to" in line]
    assert saved and saved[-1].endswith(" 0 lost"), done.stderr[-2000:]
    # The script's tree held the cluster (GCS, raylet, the actors' workers): all gone with it.
    assert process_tree.wait_gone(timeout=30) == []
