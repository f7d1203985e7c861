"""The front's pure parts: the engine's command line and environment, GPU sharing, the host-memory
settings, chat parsing and reshaping."""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import socket
import threading
import time

import pytest
from pydantic import ValidationError

import tiny_models
from inferscale.config import Config
from inferscale.errors import ConfigError
from inferscale import host_memory
from inferscale.server import serve
from inferscale.server.engine import gpu, launch
from inferscale.server.chat.request import completion_body, parse_chat
from inferscale.server.chat.answers import chat_chunk, chat_completion
from inferscale.server.engine.log import EngineLog
from inferscale.server.errors import APIError, validation_message
from inferscale.server.memory.schemas import SearchMemories

GiB = 1 << 30


def test_the_engine_listens_on_loopback_with_the_connector_and_the_users_arguments_last():
    cmd = launch.engine_command("/m", "qwen", Config(), 4321, 12288, ["--max-num-seqs", "8"], "cpu")
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "4321"
    transfer = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_module_path"] == "inferscale.connector.vllm_adapter"
    assert cmd[-2:] == ["--max-num-seqs", "8"] and "--enforce-eager" in cmd
    assert cmd[cmd.index("--served-model-name") + 1] == "qwen" and cmd[cmd.index("--max-model-len") + 1] == "12288"
    gpu_cmd = launch.engine_command("/m", "qwen", Config(), 4321, None, [], "cuda")
    assert "--enforce-eager" not in gpu_cmd and "--max-model-len" not in gpu_cmd


def test_the_users_no_enable_prefix_caching_turns_vllms_prefix_cache_off():
    """The engine starts with the prefix cache on; a user's ``--no-enable-prefix-caching`` (docs/server.md)
    comes later on the command line and wins under vLLM's own parser."""
    from vllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())

    def prefix_caching(user_args: list[str]) -> bool:
        command = launch.engine_command("/m", "qwen", Config(), 4321, None, user_args, "cuda")
        return parser.parse_known_args(command[command.index("--model"):])[0].enable_prefix_caching

    assert prefix_caching(["--no-enable-prefix-caching"]) is False
    assert prefix_caching([]) is True


def test_the_engine_starts_with_the_host_memory_settings_where_the_environment_sets_none(monkeypatch):
    env = host_memory.engine_environment({"PATH": "/bin", "MALLOC_ARENA_MAX": "8"}, "cpu")
    assert env["PATH"] == "/bin" and env["MALLOC_ARENA_MAX"] == "8"  # the user's value wins
    assert env["INFERSCALE_MALLOC_TRIM_S"] == "10" and env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"
    assert "MALLOC_MMAP_THRESHOLD_" not in env  # the front's only: the engine's steps allocate too much for it
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in host_memory.engine_environment({}, "cuda")  # oneDNN: CPU only
    assert host_memory.engine_environment({}, "cuda")["MALLOC_ARENA_MAX"] == "2"
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    engine_env = serve._engine_environment("cpu")
    assert "VLLM_API_KEY" not in engine_env and engine_env["MALLOC_ARENA_MAX"] == "2"


class FakeLibc:
    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad):
        self.calls.append(("malloc_trim", pad))
        return 1


def test_the_front_applies_the_malloc_settings_its_environment_does_not_set(monkeypatch):
    libc = FakeLibc()
    monkeypatch.setattr(host_memory, "_glibc", lambda: libc)
    applied = host_memory.configure_front({"MALLOC_ARENA_MAX": "4"})  # glibc read it at the process's start
    assert applied == {"MALLOC_MMAP_THRESHOLD_": str(256 << 10)} and libc.calls == [("mallopt", -3, 256 << 10)]
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)  # not glibc: nothing to do
    assert host_memory.configure_front({}) == {} and not host_memory.start_trimming(1.0)


def test_the_worker_trims_every_interval_in_one_thread(monkeypatch):
    libc = FakeLibc()
    monkeypatch.setattr(host_memory, "_glibc", lambda: libc)
    monkeypatch.setattr(host_memory, "_trimming", None)
    monkeypatch.setattr(host_memory, "_stop_trimming", threading.Event())
    assert not host_memory.start_trimming(0.0)  # INFERSCALE_MALLOC_TRIM_S=0: off
    try:
        assert host_memory.start_trimming(0.01)
        thread = host_memory._trimming
        deadline = time.monotonic() + 10
        while ("malloc_trim", 0) not in libc.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ("malloc_trim", 0) in libc.calls
        assert host_memory.start_trimming(5.0) and host_memory._trimming is thread  # one thread per process
    finally:
        host_memory.stop_trimming()
    assert not thread.is_alive()


def test_the_trim_interval_comes_from_the_environment():
    assert host_memory.trim_interval({}) == 0.0 and host_memory.trim_interval({}, 10.0) == 10.0
    assert host_memory.trim_interval({"INFERSCALE_MALLOC_TRIM_S": "2.5"}) == 2.5
    assert host_memory.trim_interval({"INFERSCALE_MALLOC_TRIM_S": "soon"}, 10.0) == 0.0


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and malloc_trim are glibc's")
def test_glibc_is_found_and_trims():
    """32 MiB freed inside the heap, below a block still in use: ``malloc_trim(0)`` hands the
    pages back (1), where a trim that did nothing answers 0."""
    libc = host_memory._glibc()
    assert libc is not None
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    blocks = [libc.malloc(16 << 10) for _ in range(2049)]  # below the mmap threshold: from the heap
    try:
        assert all(blocks)
        for block in blocks[:-1]:
            libc.free(block)
        assert libc.malloc_trim(0) == 1
    finally:
        libc.free(blocks[-1])


@pytest.mark.parametrize("arg", ["--host", "--port=9", "--kv-transfer-config", "--api-key=x", "--uds"])
def test_arguments_the_front_sets_are_refused(arg):
    with pytest.raises(ConfigError, match=arg.split("=")[0]):
        launch.check_vllm_args(["--dtype", "bfloat16", arg])


def test_a_port_left_in_time_wait_by_a_killed_server_is_free_a_listened_one_is_not():
    """After a crash (kill -9) of a front with clients connected, its connections sit in
    TIME_WAIT for a minute; uvicorn binds over them, so the check must too."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            launch.check_port_free("127.0.0.1", port)
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: its end goes to TIME_WAIT
        client.recv(1)
        client.close()
    launch.check_port_free("127.0.0.1", port)


def test_argument_values():
    args = ["--served-model-name", "a", "b", "--max-model-len=8k", "--served-model-name", "c"]
    assert launch.arg_value(args, "--served-model-name") == "c"
    assert launch.arg_value(args, "--max-model-len") == "8k" and launch.arg_value(args, "--dtype") is None


def test_the_context_fits_mem0s_extraction_where_the_model_allows():
    assert launch.context_length(Config(), 32768) == 11264  # 8000 + 2048 + 1024, rounded up to 1024
    assert launch.context_length(Config(), 2048) == 2048
    assert launch.context_length(Config.from_dict({"model": {"max_model_len": 20000}}), 32768) == 20000


def test_the_engine_leaves_the_encoder_its_share_of_the_gpu():
    assert gpu.engine_utilization(8 * GiB, 80 * GiB) == 0.77  # 0.9 - (8 + 2) / 80
    with pytest.raises(ConfigError, match="--encoder-device cpu"):
        gpu.engine_utilization(60 * GiB, 80 * GiB)
    model = tiny_models.tiny_model_dir("qwen2", "float32")
    assert gpu.encoder_bytes(model, "float32") == 2 * gpu.encoder_bytes(model, "bfloat16") > 0


def test_a_chat_is_parsed_into_memory_options_conversation_and_sampling():
    call = parse_chat({"model": "m", "user": "ann@example.com", "max_completion_tokens": 9, "n": 2, "top_k": 5,
                       "inferscale": {"k": 3, "mode": "text"}, "stream": True,
                       "messages": [{"role": "developer", "content": "Be brief."},
                                    {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                 {"type": "text", "text": "there?"}]}]}, 1024)
    assert (call.user_id, call.mode, call.k, call.stream) == ("ann@example.com", "text", 3, True)
    assert call.generation_mode == "prompt"  # answered as "text", as asked
    assert call.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere?"}]
    body = completion_body(call, {"prompt_token_ids": [1, 2], "cache_salt": "s"}, {"inferscale": {}}, "served")
    assert body == {"model": "m", "prompt": [1, 2], "cache_salt": "s", "kv_transfer_params": {"inferscale": {}},
                    "max_tokens": 9, "n": 2, "top_k": 5, "stream": True}
    plain = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, 1024)
    assert plain.user_id is None and plain.mode == "none"
    default = parse_chat({"model": "m", "user": "ann", "messages": [{"role": "user", "content": "hi"}]}, 1024)
    assert default.mode == "kv" and default.fields["max_tokens"] is None  # up to the context's end, as chat does


@pytest.mark.parametrize("body, needle", [
    ({"user": "a", "inferscale": {"user_id": "b"}}, "differ"),
    ({"user": "a", "inferscale": {"top_k": 3}}, "unknown inferscale option"),
    ({"inferscale": {"mode": "kv"}}, "needs a user"),
    ({"user": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     "last message"),
    ({"user": "a", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "only text"),
    ({"user": "a", "messages": [{"role": "assistant", "content": None, "tool_calls": [{}]},
                                {"role": "user", "content": "x"}]}, "tool calls"),
    ({"user": "a", "prompt": [1], "messages": [{"role": "user", "content": "x"}]}, "set by the server"),
    ({"user": "a"}, "'model' is required"),
    ({}, "'model' is required"),  # without a user too, as OpenAI refuses it
    ({"user": "a", "model": ""}, "'model' must be a model's name"),
    ({"model": "m", "user": "a", "inferscale": {"k": "3"}}, r"inferscale.k must be an integer in 1..1024, got '3'"),
    ({"model": "m", "user": "a", "inferscale": {"k": True}}, r"inferscale.k must be an integer in 1..1024, got True"),
])
def test_malformed_chats_are_refused(body, needle):
    with pytest.raises(APIError, match=needle) as info:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, 1024)
    assert info.value.status == 400


def test_completions_are_reshaped_as_chat():
    completion = {"id": "cmpl-7", "created": 1, "model": "m", "usage": {"total_tokens": 3},
                  "choices": [{"index": 0, "text": "Pixel.", "finish_reason": "stop"}],
                  "kv_transfer_params": {"inferscale": {"injected_tokens": 40}}}
    chat = chat_completion(completion, {"mode": "kv"})
    assert chat["id"] == "chatcmpl-7" and chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "Pixel."}
    assert chat["inferscale"] == {"mode": "kv", "report": {"injected_tokens": 40}} and chat["usage"]["total_tokens"] == 3
    started: set[int] = set()
    first = chat_chunk({"id": "cmpl-7", "choices": [{"index": 0, "text": "Pi"}]}, started, {"mode": "kv"})
    then = chat_chunk({"id": "cmpl-7", "choices": [{"index": 0, "text": "xel", "finish_reason": "stop"}]}, started)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Pi"} and first["inferscale"]
    assert then["choices"][0]["delta"] == {"content": "xel"} and then["choices"][0]["finish_reason"] == "stop"
    assert "inferscale" not in then and then["object"] == "chat.completion.chunk"


@pytest.mark.parametrize("k, shown", [("3", "'3'"), (True, "True"), (0, "0"), (1025, "1025"), (2.0, "2.0")])
def test_search_takes_k_as_chat_does(k, shown):
    with pytest.raises(ValidationError) as info:
        SearchMemories.model_validate({"user_id": "ann", "query": "pets", "k": k})
    assert validation_message(info.value.errors()) == f"k: k must be an integer in 1..1024, got {shown}"
    assert SearchMemories.model_validate({"user_id": "ann", "query": "pets", "k": 3}).k == 3
    assert SearchMemories.model_validate({"user_id": "ann", "query": "pets"}).k is None


NOISE = [b"(APIServer pid=1) ERROR [async_llm.py:906] AsyncLLM output_handler failed.\n",
         b"(APIServer pid=1) ERROR [async_llm.py:906] Traceback (most recent call last):\n",
         b"(APIServer pid=1) ERROR [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore ...\n"]


def _relayed(lines: list[bytes], stopping: bool) -> bytes:
    import io
    import os

    read, write = os.pipe()
    out, log = io.BytesIO(), EngineLog()
    if stopping:
        log.stopping()
    log.relay(os.fdopen(read, "rb"), out, "test")
    with os.fdopen(write, "wb") as pipe:
        pipe.writelines(lines)
    log.join()
    return out.getvalue()


def test_the_engine_log_drops_vllms_engine_dead_report_only_while_the_front_stops_it():
    before, after = [b"INFO serving\n"], [b"INFO API server: shutting down\n"]
    assert _relayed(before + NOISE + after, stopping=True) == b"".join(before + after)
    assert _relayed(before + NOISE + after, stopping=False) == b"".join(before + NOISE + after)
    cut = NOISE[:2] + [b"ERROR something else\n"] * 50  # not that report: every line passes
    assert _relayed(cut, stopping=True) == b"".join(cut)
