"""The engine process's loop over real ZeroMQ pipes (in a thread): ready, generate,
commands, shutdown; and the KV pool sizing."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import zmq
from radixlm.runtime.config import Endpoints, EngineConfig
from radixlm.runtime.engine.engine_main import run_engine
from radixlm.runtime.engine.pool_size import CPU_MAX_TOKENS, kv_capacity
from radixlm.runtime.engine.wire import (
    EngineCommand,
    EngineGenerate,
    EngineReady,
    Shutdown,
    StepOutputs,
    ToClient,
    encode,
    to_frontend_decoder,
)
from radixlm.runtime.model import ModelConfig
from radixlm.runtime.protocol import GetStats, SamplingParams, StatsReply, decode_server
from radixlm.runtime.transport.channel import open_socket
from scheduler_harness import hf_greedy
from tiny_models import load_hf_model, make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("loop"), "qwen2", seed=3)


def test_engine_loop_serves_over_zmq(tiny_dir, tmp_path):
    endpoints = Endpoints(client=f"ipc://{tmp_path}/c", to_engine=f"ipc://{tmp_path}/e",
                          to_frontend=f"ipc://{tmp_path}/f", runtime_dir=str(tmp_path))
    config = EngineConfig(model=str(tiny_dir), device="cpu", kv_tokens=1024, page_size=4,
                          threads=1)
    ctx: zmq.Context[Any] = zmq.Context()
    inbox = open_socket(ctx, zmq.PULL, endpoints.to_frontend, bind=True)
    engine = threading.Thread(target=run_engine, args=(config, endpoints), daemon=True)
    engine.start()
    outbox = open_socket(ctx, zmq.PUSH, endpoints.to_engine, bind=False)
    try:
        assert inbox.poll(60_000), "no EngineReady"
        ready = to_frontend_decoder.decode(inbox.recv())
        assert isinstance(ready, EngineReady)
        assert (ready.kv_capacity, ready.page_size, ready.context_length) == (1024, 4, 256)
        assert ready.model_dir == str(tiny_dir) and ready.vocab_size == 448

        prompt = list(range(5, 35))
        outbox.send(encode(EngineGenerate(key=7, client=b"c", rid="r", input_ids=prompt,
                                          sampling=SamplingParams(max_tokens=6, temperature=0,
                                                                  ignore_eos=True))))
        tokens: list[int] = []
        final = None
        while final is None:
            assert inbox.poll(30_000), "no output"
            msg = to_frontend_decoder.decode(inbox.recv())
            assert isinstance(msg, StepOutputs)
            for o in msg.outputs:
                tokens += o.token_ids
                final = o if o.finish_reason else final
        assert final.usage.completion_tokens == 6
        assert tokens == hf_greedy(load_hf_model(tiny_dir), prompt, 6)

        outbox.send(encode(EngineCommand(client=b"c", msg=GetStats(rid="s"))))
        assert inbox.poll(30_000)
        reply = to_frontend_decoder.decode(inbox.recv())
        assert isinstance(reply, ToClient) and reply.client == b"c"
        stats = decode_server(reply.data)
        assert isinstance(stats, StatsReply) and stats.invariant_ok
        assert (stats.capacity, stats.running, stats.prompt_tokens_total) == (1024, 0, 30)

        outbox.send(encode(Shutdown()))
        engine.join(30)
        assert not engine.is_alive()
    finally:
        inbox.close(0)
        outbox.close(0)
        ctx.term()


def test_pool_sizing(tiny_dir):
    cfg = ModelConfig.from_dir(tiny_dir)
    cpu = torch.device("cpu")
    assert kv_capacity(1000, 0.5, cfg, cpu, torch.float32, 16) == 992  # whole pages
    # From memory on CPU: capped (a tiny model's KV is a few KiB per token).
    assert kv_capacity(0, 0.5, cfg, cpu, torch.float32, 1) == CPU_MAX_TOKENS
    with pytest.raises(ValueError):
        kv_capacity(100, 0.5, cfg, cpu, torch.float32, 1)
    with pytest.raises(ValueError):
        kv_capacity(0, 1.5, cfg, cpu, torch.float32, 1)
