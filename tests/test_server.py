"""`inferscale serve` for real: the newcomer's path on Qwen2.5-Coder-0.5B-Instruct.

One command starts the front and its engine (vLLM's OpenAI server with the
connector, on loopback); facts go in through :class:`MemoryClient`; the plain
``openai`` client chats with ``user=`` and gets answers from memory, whole and
streamed; Mem0 extracts facts from a conversation with the served model; a
forgotten user leaves nothing behind; bad input never takes the server down.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time

import httpx
import pytest

from inferscale.client import MemoryClient, ServerError
from inferscale.datasets.demo import FACTS, QUESTIONS

pytestmark = pytest.mark.slow
QWEN05 = "qwen2.5-coder-0.5b-instruct"
MAYA = "maya@example.com"


@pytest.fixture(scope="module")
def front(qwen05_front):
    """The session's `inferscale serve qwen2.5-coder-0.5b-instruct` (conftest.py), with Maya's facts."""
    with MemoryClient(qwen05_front.url) as memory:
        memory.add(MAYA, facts=[{"text": text, "source_turn": turn} for text, turn in FACTS])
    return qwen05_front


@pytest.fixture(scope="module")
def chat(front):
    from openai import OpenAI

    return OpenAI(base_url=f"{front.url}/v1", api_key="EMPTY")


def ask(chat, question: str, user: str = MAYA, **kwargs):
    messages = kwargs.pop("messages", [{"role": "user", "content": question}])
    return chat.chat.completions.create(model=QWEN05, messages=messages, user=user, max_tokens=24,
                                        temperature=0.0, **kwargs)


def test_the_answer_comes_from_the_users_memory(chat):
    question = "What is the name of my cat?"
    answer = ask(chat, question)
    assert QUESTIONS[question] in answer.choices[0].message.content
    memory = answer.model_extra["inferscale"]
    assert memory["mode"] == "kv" and len(memory["fact_ids"]) == 10
    assert memory["report"]["fallback"] is None and memory["report"]["injected_tokens"] > 0
    plain = chat.chat.completions.create(model=QWEN05, messages=[{"role": "user", "content": question}],
                                         max_tokens=24, temperature=0.0)  # no user: vLLM's own chat
    assert "Pixel" not in plain.choices[0].message.content


def test_streaming_gives_the_same_answer(chat):
    question = "Which city does my sister live in?"
    whole = ask(chat, question).choices[0].message.content
    chunks = list(ask(chat, question, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].model_extra["inferscale"]["mode"] == "kv"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason is not None and "Porto" in whole


def test_chat_history_follows_the_memory_and_text_mode_reads_the_same_facts(chat):
    history = [{"role": "user", "content": "Hi, it's me again."}, {"role": "assistant", "content": "Welcome back!"},
               {"role": "user", "content": "What am I allergic to?"}]
    assert "peanut" in ask(chat, "", messages=history).choices[0].message.content.lower()
    text = ask(chat, "What am I allergic to?", extra_body={"inferscale": {"mode": "text", "k": 5}})
    assert "peanut" in text.choices[0].message.content.lower()
    assert text.model_extra["inferscale"]["mode"] == "text" and len(text.model_extra["inferscale"]["fact_ids"]) == 5


def test_memory_endpoints_round_trip(front):
    with MemoryClient(front.url) as memory:
        facts = memory.list(MAYA)
        assert [f["text"] for f in facts] == [text for text, _ in FACTS]
        (best,) = memory.search(MAYA, "Where does my sister live?", k=1)
        assert "Ana" in best["text"]
        new = memory.update(MAYA, best["id"], "Maya's sister Ana lives in Braga.")
        assert memory.get(MAYA, new["id"])["text"].endswith("Braga.")
        assert memory.delete(MAYA, new["id"]) == {"user_id": MAYA, "deleted": new["id"]}
        assert len(memory.list(MAYA)) == len(FACTS) - 1
        with pytest.raises(ServerError) as missing:
            memory.get(MAYA, new["id"])
        assert missing.value.status == 404
        assert MAYA in memory.users()


def test_forgetting_a_user_removes_everything(front, chat):
    from openai import NotFoundError

    user = "ivy"
    with MemoryClient(front.url) as memory:
        extracted = memory.add(user, messages=[{"role": "user", "content": "I have a grey cat called Pixel and "
                                                                           "I work as a nurse in Lisbon."}])
        assert extracted and all(f["source_turn"] for f in extracted)  # Mem0 on the served model
        memory.add(user, facts=["Ivy plays the cello."])
        assert ask(chat, "What instrument do I play?", user=user).model_extra["inferscale"]["fact_ids"]
        kv = front.data / "kv" / "users" / user  # format 3: the user's index and K/V segments
        assert (kv / "index.json").is_file() and list(kv.glob("seg-*.safetensors"))
        gone = memory.forget(user)
        assert gone["facts_deleted"] == len(extracted) + 1 and gone["mem0_memories_deleted"] >= len(extracted)
        assert user not in memory.users()
        with pytest.raises(ServerError) as unknown:
            memory.list(user)
        assert unknown.value.status == 404
    assert not kv.exists()
    assert not [p for p in (front.data / "kv").rglob("*") if user in p.name]  # nor a format 1/2 file
    with pytest.raises(NotFoundError, match="no memory stored for user 'ivy'"):
        ask(chat, "What instrument do I play?", user=user)
    db = sqlite3.connect(front.data / "mem0" / "history.db")
    assert db.execute("SELECT COUNT(*) FROM messages WHERE session_scope = 'user_id=ivy'").fetchone() == (0,)
    db.close()


def test_bad_input_is_refused_and_the_server_carries_on(front, chat):
    v1 = f"{front.url}/v1"
    answers = [
        httpx.post(f"{v1}/chat/completions", content=b'{"user": "maya", "messages": [',
                   headers={"Content-Type": "application/json"}),
        httpx.post(f"{v1}/chat/completions", json={"model": QWEN05, "user": "nobody",
                                                   "messages": [{"role": "user", "content": "hi"}]}),
        httpx.post(f"{v1}/chat/completions", json={"model": QWEN05, "user": MAYA, "inferscale": {"k": 10**12},
                                                   "messages": [{"role": "user", "content": "hi"}]}),
        httpx.post(f"{v1}/chat/completions", json={"model": QWEN05, "user": "maya\n",
                                                   "messages": [{"role": "user", "content": "hi"}]}),
        httpx.post(f"{v1}/completions", json={"model": QWEN05, "prompt": [1, 2], "cache_salt": "inferscale-x",
                                              "kv_transfer_params": {"inferscale": {"user_id": MAYA, "fact_ids": []}}}),
        httpx.post(f"{v1}/chat/completions", json={"model": "gpt-4", "user": MAYA,
                                                   "messages": [{"role": "user", "content": "hi"}]}),
    ]
    assert [a.status_code for a in answers] == [400, 404, 400, 400, 400, 404]
    assert all(a.json()["error"]["message"] for a in answers)
    assert httpx.get(f"{front.url}/health").status_code == 200
    assert "Pixel" in ask(chat, "What is the name of my cat?").choices[0].message.content


OMAR = "omar@example.com"
OMAR_FACTS = ["Omar's locker code is 7319.", "Omar has a parrot called Zazu.", "Omar rows on the Douro at dawn."]


def test_no_request_names_its_way_into_another_users_memory(front, chat):
    """Omar (or anyone) tries every way to reach Maya's memory through the front: her fact ids,
    memory params, a forged salt, her user id beside his, huge k, her facts by id; each is a clear
    4xx or answers from Omar's memory alone, and nothing that comes back shows Maya's facts."""
    v1 = f"{front.url}/v1"
    with MemoryClient(front.url) as memory:
        omar = {f["id"] for f in memory.add(OMAR, facts=OMAR_FACTS)}
        maya = {f["id"]: f["text"] for f in memory.list(MAYA)}
    assert "7319" in ask(chat, "What is my locker code?", user=OMAR).choices[0].message.content  # control
    stolen = {"inferscale": {"user_id": MAYA, "fact_ids": list(maya)}}
    chat_body = {"model": QWEN05, "user": OMAR, "max_tokens": 24, "temperature": 0,
                 "messages": [{"role": "user", "content": "What is the name of my cat?"}]}
    tries = {
        "another user's fact ids as an option": ("post", "chat/completions", {**chat_body, "inferscale": {
            "fact_ids": list(maya)}}, 400),
        "client-supplied kv_transfer_params": ("post", "chat/completions", {**chat_body, "kv_transfer_params": stolen},
                                               400),
        "a forged cache salt": ("post", "chat/completions", {**chat_body, "cache_salt": "inferscale-" + "0" * 32}, 400),
        "her id beside his": ("post", "chat/completions", {**chat_body, "inferscale": {"user_id": MAYA}}, 400),
        "no user, her params": ("post", "chat/completions", {**chat_body, "user": None, "kv_transfer_params": stolen},
                                400),
        "huge k": ("post", "chat/completions", {**chat_body, "inferscale": {"k": 1024}}, 200),
        "huge k as text": ("post", "chat/completions", {**chat_body, "inferscale": {"k": 1024, "mode": "text"}}, 200),
        "search with huge k": ("post", "memories/search", {"user_id": OMAR, "query": "my cat", "k": 1024}, 200),
        "her params on completions": ("post", "completions", {"model": QWEN05, "prompt": "Hi", "max_tokens": 2,
                                                              "kv_transfer_params": stolen}, 400),
    }
    answers = {name: getattr(httpx, method)(f"{v1}/{path}", json=body, timeout=120)
               for name, (method, path, body, _) in tries.items()}
    fact = next(iter(maya))
    answers["her params, no Content-Type"] = httpx.post(f"{v1}/completions", content=json.dumps(
        tries["her params on completions"][2]).encode())
    answers["her fact by id, read"] = httpx.get(f"{v1}/memories/{fact}", params={"user_id": OMAR})
    answers["her fact by id, changed"] = httpx.put(f"{v1}/memories/{fact}", json={"user_id": OMAR, "text": "Mine."})
    answers["her fact by id, deleted"] = httpx.delete(f"{v1}/memories/{fact}", params={"user_id": OMAR})
    expected = {name: status for name, (*_, status) in tries.items()} | {
        "her params, no Content-Type": 400, "her fact by id, read": 404, "her fact by id, changed": 404,
        "her fact by id, deleted": 404}
    assert {name: a.status_code for name, a in answers.items()} == expected
    for name, answer in answers.items():
        shown = answer.text
        assert not any(text in shown for text in maya.values()) and "Pixel" not in shown, name
    for name in ("huge k", "huge k as text"):
        assert set(answers[name].json()["inferscale"]["fact_ids"]) <= omar, name
    assert {f["id"] for f in answers["search with huge k"].json()["results"]} == omar
    with MemoryClient(front.url) as memory:
        assert {f["id"]: f["text"] for f in memory.list(MAYA)} == maya  # nothing of hers changed
    mine = ask(chat, "What is my locker code? What is my parrot called?").choices[0].message.content
    assert "7319" not in mine and "Zazu" not in mine  # and the other way around


def test_the_engine_port_injects_nothing_for_a_forged_request(front):
    """Isolation holds for a client that reaches the engine itself on loopback: Maya's memory
    params with her exact prompt, or with only the question, and any salt it can compute or
    guess get no injection and the same coarse report; the server's own request does."""
    from inferscale.api import Context, GenerationAPI
    from inferscale.config import Config
    from test_api_isolation import REFUSED, guessed_salts

    engine = f"http://127.0.0.1:{front.engine_port()}"
    generation = GenerationAPI(Context(Config.from_dict({"model": QWEN05, "data_dir": str(front.data)})))
    facts = [f.fact_id for f in generation.context.record.facts(MAYA).values()]
    question = "What is the name of my cat?"
    request = generation.prompt(MAYA, question, facts)
    exact, params = request.prompt["prompt_token_ids"], request.kv_transfer_params
    blind = generation.prompt(MAYA, question, [], mode="none").prompt["prompt_token_ids"]  # the question alone

    def complete(prompt: list[int], salt: str | None) -> tuple[str, dict]:
        body = {"model": QWEN05, "prompt": prompt, "max_tokens": 8, "temperature": 0, "kv_transfer_params": params,
                **({"cache_salt": salt} if salt else {})}
        answer = httpx.post(f"{engine}/v1/completions", json=body, headers=front.engine_headers(), timeout=120)
        if answer.status_code == 400 and "cache_salt" in answer.text:  # vLLM refuses salts with '@' or '/'
            return answer.text, REFUSED
        return answer.json()["choices"][0]["text"], answer.json()["kv_transfer_params"]["inferscale"]

    for salt in [*guessed_salts(MAYA, exact[: request.memory_tokens]), None]:
        assert complete(exact, salt)[1] == REFUSED, salt
        text, report = complete(blind, salt)
        assert report == REFUSED and "Pixel" not in text, salt
    text, report = complete(exact, request.prompt["cache_salt"])  # control: the server's own salt
    assert report["fallback"] is None and report["injected_tokens"] > 0 and "Pixel" in text


def test_metrics_show_the_front_and_the_connector(front):
    text = httpx.get(f"{front.url}/metrics").text
    assert _value(text, "inferscale_retrieval_seconds_count") > 0
    assert _value(text, "inferscale_compose_seconds_count") > 0
    assert _value(text, "vllm:inferscale_injected_tokens_total") > 0
    assert 'vllm:inferscale_fallbacks_total{engine="0",model_name="qwen2.5-coder-0.5b-instruct",reason=' in text


def test_the_command_line_reaches_a_running_server(front):
    from test_cli import run

    out = run("facts", MAYA, "--server", front.url)
    assert out.returncode == 0, out.stderr
    assert "Maya has a grey cat called Pixel." in out.stdout and "D1:5" in out.stdout
    assert MAYA in run("users", "--server", front.url).stdout.split()
    out = run("forget", "nobody", "--server", front.url)
    assert out.returncode == 2 and "no memory stored for user 'nobody'" in out.stderr


def test_the_front_stops_when_the_engine_dies(front):
    """Last: kills the engine (of the session's front, conftest.py: nothing runs on it after this module). The front notices, exits 1, and leaves no process behind."""
    engine = front.engine_pid()
    os.killpg(engine, signal.SIGKILL)
    assert front.proc.wait(timeout=60) == 1
    assert "the engine exited" in front.log_text()


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")
