"""One engine configuration, generated into flags and keywords, sent whole to every process."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from stepscope.engine import LLM
from stepscope.engine import config as config_module
from stepscope.engine.config import PARTS, Endpoints, EngineConfig, SchedulerConfig
from stepscope.engine.engine_args import (
    add_engine_args,
    check_engine_kwargs,
    engine_config_from_args,
    engine_option_names,
)
from stepscope.engine.entrypoints.cli import build_parser
from stepscope.engine.entrypoints.launcher import APIServerArgs
from stepscope.engine.entrypoints.serving import ServerOptions
from stepscope.engine.frontend.engine_group import Attachment, EngineHandles
from stepscope.engine.messages import CoreProcArgs


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_every_engine_option_is_a_serve_flag_and_an_llm_keyword() -> None:
    names = engine_option_names()
    assert {"max_num_batched_tokens", "max_num_seqs", "data_parallel_size", "trace_db"} <= set(
        names
    )
    defaults = vars(_serve_args())
    for name in names:
        assert name in defaults, f"serve has no flag for {name}"
    check_engine_kwargs(dict.fromkeys(names))  # every one is an LLM keyword
    # The fields the engine sets itself are neither.
    for internal in ("dtype_reason", "data_parallel_rank", "data_parallel_rank_local"):
        assert internal not in names and internal not in defaults


def test_serve_flags_keep_their_flat_names() -> None:
    args = _serve_args(
        "--tp", "2", "--dp", "2", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
        "--trace-db", "run.duckdb", "--no-enable-prefix-caching", "--trace-content",
    )  # fmt: skip
    config = engine_config_from_args(args, offline=False)
    assert config.parallel_config.tensor_parallel_size == 2
    assert config.parallel_config.data_parallel_size == 2
    assert config.parallel_config.executor == "mp"  # a server's default
    assert (
        config.scheduler_config.max_num_batched_tokens,
        config.scheduler_config.max_num_seqs,
    ) == (64, 8)
    assert config.observability_config.trace_db == "run.duckdb"
    assert not config.cache_config.enable_prefix_caching
    assert config.observability_config.trace_content
    assert _serve_args("--tensor-parallel-size", "4").tensor_parallel_size == 4
    assert _serve_args("--no-trace").no_trace


def test_adding_a_field_to_the_config_adds_the_flag_and_the_keyword(monkeypatch) -> None:
    class Scheduler(SchedulerConfig):
        max_waiting_seconds: float | None = None
        """Give up on a request after this."""
        # Set by the engine: neither a flag nor a keyword.
        started_at: float = 0.0

    monkeypatch.setitem(PARTS, "scheduler_config", Scheduler)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--max-waiting-seconds", "2.5"])
    assert args.max_waiting_seconds == 2.5
    assert "Give up on a request" in parser.format_help()
    assert "--started-at" not in parser.format_help()
    check_engine_kwargs({"max_waiting_seconds": 1.0})
    assert config_module.field_parts()["max_waiting_seconds"] == "scheduler_config"
    built = EngineConfig.create(max_waiting_seconds=1.0)
    assert built.scheduler_config.max_waiting_seconds == 1.0


def test_an_unknown_llm_keyword_is_refused_with_the_nearest_name() -> None:
    with pytest.raises(
        ValueError, match="unknown engine option 'max_num_seq'; did you mean 'max_num_seqs'"
    ):
        LLM(model="tiny-llama", max_num_seq=4)
    with pytest.raises(ValueError, match="max_num_seqs: Expected `int"):
        LLM(model="tiny-llama", max_num_seqs="four")
    with pytest.raises(ValueError, match="did you mean"):
        EngineConfig.create(enable_prefix_cache=False)


def test_the_config_is_frozen_and_addresses_travel_beside_it() -> None:
    config = EngineConfig.create(model="tiny-llama", max_num_seqs=3)
    with pytest.raises(AttributeError):
        config.scheduler_config.max_num_seqs = 4  # type: ignore[misc]
    assert "collector" not in config.flat()
    args = CoreProcArgs(
        config=config.for_dp_rank(1, 0, 1), endpoints=Endpoints("http://127.0.0.1:9/"),
        model_dir="/m", handshake_addr="ipc://h", input_bind="ipc://i", parent_pid=1,
    )  # fmt: skip
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(args), type=CoreProcArgs)
    assert isinstance(back.config, EngineConfig)
    assert back.config == config.for_dp_rank(1, 0, 1)
    assert back.config.parallel_config.data_parallel_rank == 1
    assert back.endpoints.collector == "http://127.0.0.1:9/"
    api = APIServerArgs(
        attach=Attachment(EngineHandles(["ipc://a"], []), 0, "ipc://o"), fd=3,
        options=ServerOptions("m"), config=config, endpoints=Endpoints(), processes_file="/p",
        parent_pid=1,
    )  # fmt: skip
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(api), type=APIServerArgs).config == config


def test_the_config_crosses_to_the_engine_core_and_every_worker_whole() -> None:
    # API process -> engine-core process (CoreProcArgs) -> each TP worker process: each reports
    # the struct it received, through a utility call.
    with LLM(
        model="tiny-llama", executor="mp", tensor_parallel_size=2, data_parallel_size=1,
        max_num_seqs=7, max_num_batched_tokens=96, num_kv_blocks=40, block_size=32, seed=3,
        dtype="float32",
    ) as llm:  # fmt: skip
        core, *workers = llm.client.call_utility("get_config")
    sent = llm.config.for_dp_rank(0, 0, 1)
    assert msgspec.convert(core, EngineConfig) == sent
    assert len(workers) == 2
    for worker in workers:
        assert msgspec.convert(worker, EngineConfig) == sent
    assert sent.scheduler_config.max_num_seqs == 7
    assert sent.model_config.dtype_reason == "asked for"


def test_without_ray_the_flag_says_how_to_install_it(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    for option in ({"data_parallel_backend": "ray"}, {"distributed_executor_backend": "ray"}):
        with pytest.raises(ValueError, match=r"pip install -e '\.\[ray\]'"):
            EngineConfig.create(model="tiny-llama", **option)
