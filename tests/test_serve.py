"""The OpenAI-compatible server, over real HTTP on 127.0.0.1 with a real client (aiohttp):
outputs equal offline generation, 32 concurrent streams, 429s past the queue, disconnects free
slots, bad requests get 400 naming the field, an engine failure fails only its request, and
SIGTERM drains. The model is a tiny random Llama with a BPE tokenizer and a chat template
(conftest's hf_ckpt), so every program compiles in about a second."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

aiohttp = pytest.importorskip("aiohttp")

from lookahead_jax.serving.server import Server  # noqa: E402
from lookahead_jax.serving.slots import Limits, SlotEngine, SlotRequest  # noqa: E402
from lookahead_jax.store.tokenizer import encode_messages  # noqa: E402

LIMITS = Limits(max_len=256, max_tokens=200, W=4, N=3, G=4, pl_tokens=6, pl_ngram=3)
MODEL = "tiny_llama"
PROMPTS = ["hello world, this is a tiny tokenizer", "the quick brown fox jumps over the lazy dog",
           "JAX and Flax decode text. JAX and Flax", "this is a tiny test of the lookahead"]


class Running:
    """A Server listening on 127.0.0.1 (any free port), its event loop on a thread."""

    def __init__(self, server: Server):
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), self.loop).result()
        self.url = f"http://127.0.0.1:{port}"

    def stop(self, drain_s: float = 5.0) -> bool:
        done = asyncio.run_coroutine_threadsafe(self.server.shutdown(drain_s), self.loop)
        finished = done.result(timeout=drain_s + 60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        return finished


@pytest.fixture(scope="module")
def engine(served_engine):
    return served_engine


@pytest.fixture(scope="module")
def running(engine):
    run = Running(Server(SlotEngine(engine, slots=4, limits=LIMITS), model_name=MODEL,
                         queue_size=64))
    yield run
    run.stop()


def offline(engine, slots, body: dict, chat: bool = False) -> list[int]:
    """What offline Engine.generate_ids gives for this request body."""
    tok = engine.tokenizer
    if chat:
        ids = encode_messages(tok, body["messages"])
    else:
        ids = list(tok.encode(body["prompt"], add_special_tokens=True))
    from lookahead_jax.serving.api import parse  # noqa: PLC0415
    parsed = parse(json.loads(json.dumps(body)), chat=chat, model_name=MODEL,
                   default_method="lookahead", max_tokens=LIMITS.max_tokens,
                   max_len=LIMITS.max_len, encode_text=lambda t: ids,
                   encode_chat=lambda m: ids)
    request: SlotRequest = parsed.request
    return engine.generate_ids([ids], method=slots.method_for(request),
                               max_new_tokens=request.max_tokens, seed=request.seed).tokens[0]


async def post(session, url, body, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None), r.headers


async def stream(session, url, body) -> tuple[int, list[dict]]:
    """POSTs a streaming request; returns the status and every SSE data object ([DONE] as
    the string "[DONE]")."""
    async with session.post(url, json=body) as r:
        if r.status != 200:
            return r.status, [await r.json(content_type=None)]
        events = []
        async for line in r.content:
            line = line.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
        return r.status, events


def run(coro):
    return asyncio.run(coro)


SAMPLED = {"temperature": 0.9, "top_p": 0.95}


def body_for(i: int, **kw) -> dict:
    """Request i of a mix: four decodings, greedy or sampled (seeds differ by request)."""
    decoding = [{"method": "ar"}, {"method": "lookahead"}, {"method": "lookahead", "W": 3, "N": 2},
                {"method": "prompt_lookup"}][i % 4]
    sampling = [{"temperature": 0}, {**SAMPLED, "seed": 10 + i}][(i // 4) % 2]
    return {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 24,
            "lookahead": decoding, "return_token_ids": True, **sampling, **kw}


# -- outputs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ar", "lookahead", "prompt_lookup"])
def test_completions_over_http_equal_offline(engine, running, method):
    slots = running.server.slots

    async def go():
        async with aiohttp.ClientSession() as s:
            out = []
            for sampling in ({"temperature": 0}, {**SAMPLED, "seed": 7}):
                body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 24,
                        "lookahead": {"method": method}, "return_token_ids": True, **sampling}
                status, resp, _ = await post(s, running.url + "/v1/completions", body)
                out.append((body, status, resp))
            return out

    for body, status, resp in run(go()):
        assert status == 200, resp
        choice = resp["choices"][0]
        assert choice["token_ids"] == offline(engine, slots, body)
        assert choice["text"] == engine.decode(choice["token_ids"])
        assert resp["usage"]["completion_tokens"] == len(choice["token_ids"])
        assert resp["lookahead"]["method"] == method and resp["lookahead"]["steps"] >= 1


def test_streamed_chat_equals_offline_and_carries_several_tokens_per_chunk(engine, running):
    body = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": 40,
            "return_token_ids": True, "lookahead": {"method": "prompt_lookup"},
            "messages": [{"role": "system", "content": "the quick brown fox"},
                         {"role": "user", "content": "jumps over the lazy dog the quick"}]}

    async def go():
        async with aiohttp.ClientSession() as s:
            return await stream(s, running.url + "/v1/chat/completions", body)

    status, events = run(go())
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert ids == offline(engine, running.server.slots, body, chat=True)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == engine.decode(ids)
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] in ("stop", "length")
    assert final["usage"]["completion_tokens"] == len(ids)
    # a step that accepts several tokens sends them in one chunk
    assert len(chunks) - 1 < len(ids) and final["lookahead"]["step_compression"] > 1


def test_stop_strings_end_the_text_before_them(engine, running):
    async def go():
        async with aiohttp.ClientSession() as s:
            full = await post(s, running.url + "/v1/completions", body_for(0, max_tokens=40))
            text = full[1]["choices"][0]["text"]
            stop = text[len(text) // 2: len(text) // 2 + 3]
            cut = await post(s, running.url + "/v1/completions",
                             body_for(0, max_tokens=40, stop=[stop]))
            return text, stop, cut

    text, stop, (status, resp, _) = run(go())
    assert stop and status == 200
    assert resp["choices"][0]["text"] == text[:text.find(stop)]
    assert resp["choices"][0]["finish_reason"] == "stop"


def test_32_concurrent_streaming_clients_each_get_their_offline_output(engine, running):
    bodies = [body_for(i, stream=True) for i in range(32)]

    async def go():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(stream(s, running.url + "/v1/completions", b)
                                          for b in bodies))

    results = run(go())
    for body, (status, events) in zip(bodies, results):
        assert status == 200 and events[-1] == "[DONE]"
        chunks = events[:-1]
        ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        assert ids == offline(engine, running.server.slots, body), body
        assert chunks[-1]["usage"]["completion_tokens"] == len(ids)
        assert "".join(c["choices"][0]["text"] for c in chunks) == engine.decode(ids)


def test_models_and_health(running):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(running.url + "/v1/models") as r:
                models = await r.json()
            async with s.get(running.url + "/health") as r:
                return models, r.status, await r.json()

    models, status, health = run(go())
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 256
    assert status == 200 and health["status"] == "ok" and health["slots"] == 4


# -- bad requests -----------------------------------------------------------------------------
BAD = [
    ("completions", None, b'{"prompt": "hi", ', "body"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, None, "model"),
    ("completions", {"prompt": ""}, None, "prompt"),
    ("completions", {"prompt": []}, None, "prompt"),
    ("chat", {"messages": []}, None, "messages"),
    ("chat", {"messages": [{"role": "user", "content": ""}]}, None, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, None, "messages[0].role"),
    ("completions", {"prompt": "hello " * 300}, None, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "hello " * 300}]}, None, "messages"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, None, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 201}, None, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, None, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, None, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, None, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, None, "top_p"),
    ("completions", {"prompt": "hi", "lookahead": {"W": 5}}, None, "lookahead.W"),
    ("completions", {"prompt": "hi", "lookahead": {"N": 9}}, None, "lookahead.N"),
    ("completions", {"prompt": "hi", "lookahead": {"G": 99}}, None, "lookahead.G"),
    ("completions", {"prompt": "hi", "lookahead": {"method": "beam"}}, None, "lookahead.method"),
    ("completions", {"prompt": "hi", "n": 2}, None, "n"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, None,
     "logprobs"),
    ("completions", {"prompt": "hi", "stop": [1]}, None, "stop"),
]


@pytest.mark.parametrize("endpoint, body, raw, param", BAD)
def test_bad_requests_get_400_naming_the_field(running, endpoint, body, raw, param):
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"

    async def go():
        async with aiohttp.ClientSession() as s:
            return await post(s, running.url + path, body, raw=raw)

    status, resp, _ = run(go())
    assert status == 400, resp
    assert resp["error"]["param"] == param and resp["error"]["type"] == "invalid_request_error"
    assert resp["error"]["message"]


# -- load, disconnects, failures, shutdown ----------------------------------------------------
def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def _metrics(session, url) -> str:
    async with session.get(url + "/metrics") as r:
        return await r.text()


def test_a_burst_beyond_the_queue_gets_429_while_accepted_requests_complete(engine):
    burst = Running(Server(SlotEngine(engine, slots=1, limits=LIMITS), model_name=MODEL,
                           queue_size=2))
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                tasks = [asyncio.create_task(post(s, burst.url + "/v1/completions",
                                                  body_for(0, max_tokens=60)))
                         for _ in range(10)]
                await asyncio.sleep(0.2)
                async with s.get(burst.url + "/health") as r:
                    health = r.status
                return health, await asyncio.gather(*tasks)

        health, results = run(go())
    finally:
        burst.stop()
    statuses = sorted(status for status, _, _ in results)
    assert health == 200
    # accepted: at least the queue's 2 (the one slot may take a third before the burst ends,
    # or not yet, on a loaded machine); the rest are refused
    assert statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
    assert set(statuses) == {200, 429}
    for status, resp, headers in results:
        if status == 429:
            assert headers["Retry-After"] == "1" and resp["error"]["type"] == "rate_limit_error"
        else:
            assert resp["usage"]["completion_tokens"] == 60


def test_clients_that_disconnect_mid_stream_free_their_slots(running):
    async def go():
        async with aiohttp.ClientSession() as s:
            before = _metric(await _metrics(s, running.url), "lookahead_requests_total",
                             '{method="ar",outcome="cancelled"}')
            responses = []
            for i in range(4):
                body = body_for(0, stream=True, max_tokens=200, temperature=0.7, seed=i)
                r = await s.post(running.url + "/v1/completions", json=body)
                await r.content.readline()  # the first chunk has started
                responses.append(r)
            busy_mid = _metric(await _metrics(s, running.url), "lookahead_slots_busy")
            for r in responses:
                r.close()  # the client goes away mid-stream
            for _ in range(100):
                text = await _metrics(s, running.url)
                if _metric(text, "lookahead_slots_busy") == 0:
                    break
                await asyncio.sleep(0.1)
            return busy_mid, text, before

    busy_mid, text, before = run(go())
    assert busy_mid >= 1
    assert _metric(text, "lookahead_slots_busy") == 0
    cancelled = _metric(text, "lookahead_requests_total", '{method="ar",outcome="cancelled"}')
    assert cancelled - before == 4


class FaultySlots(SlotEngine):
    """Fails the prefill of requests with seed 13 and any step of a lane holding seed 14."""

    def prefill(self, request):
        if request.seed == 13:
            raise RuntimeError("injected prefill failure")
        return super().prefill(request)

    def step_lane(self, lane):
        if any(self._requests[h].seed == 14 for h in lane.handles):
            raise RuntimeError("injected step failure")
        return super().step_lane(lane)


def test_a_request_that_fails_in_the_engine_fails_alone(engine):
    faulty = Running(Server(FaultySlots(engine, slots=4, limits=LIMITS), model_name=MODEL))
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                url = faulty.url + "/v1/completions"
                good = [body_for(i) for i in (0, 1, 3)]  # greedy: other lanes
                bad_prefill = body_for(5, seed=13)
                bad_step = body_for(6, seed=14)  # alone in its lane (lookahead W=3 N=2, sampled)
                results = await asyncio.gather(
                    *(post(s, url, b) for b in good), post(s, url, bad_prefill),
                    stream(s, url, {**bad_step, "stream": True}))
                async with s.get(faulty.url + "/health") as r:
                    health = r.status
                after = await post(s, url, good[0])
                return good, results, health, after

        good, results, health, after = run(go())
    finally:
        faulty.stop()
    for body, (status, resp, _) in zip(good, results[:3]):
        assert status == 200 and resp["choices"][0]["token_ids"] == offline(
            engine, faulty.server.slots, body)
    status, resp, _ = results[3]
    assert status == 500 and "injected prefill failure" in resp["error"]["message"]
    status, events = results[4]  # failed after its first token: the stream ends with an error
    assert (status == 500 and "injected step failure" in events[0]["error"]["message"]) or (
        status == 200 and "injected step failure" in events[-2]["error"]["message"])
    assert health == 200 and after[0] == 200


class SlowSlots(SlotEngine):
    """Steps that take at least 20 ms, so a 150-token request outlasts the test's moves."""

    def step_lane(self, lane):
        time.sleep(0.02)
        return super().step_lane(lane)


def test_shutdown_drains_running_requests_and_refuses_new_ones(engine):
    srv = Running(Server(SlowSlots(engine, slots=2, limits=LIMITS), model_name=MODEL))

    async def go():
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(stream(s, srv.url + "/v1/completions",
                                              body_for(0, stream=True, max_tokens=150)))
            await asyncio.sleep(0.5)
            stopping = asyncio.get_running_loop().run_in_executor(None, srv.stop, 30.0)
            await asyncio.sleep(0.1)
            refused = await post(s, srv.url + "/v1/completions", body_for(0))
            return await task, refused, await stopping

    (status, events), refused, finished = run(go())
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert refused[0] == 503 and finished


def test_sigterm_drains_then_exits(hf_ckpt, tmp_path):
    """The real command: SIGTERM mid-stream lets the stream finish, then the process exits 0."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lookahead_jax.serve", f"--config={MODEL}", f"--ckpt={hf_ckpt}",
         "--port=0", "--slots=2", "--max_len=256", "--max_tokens=200", "--no-warmup",
         "--drain_s=60"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            m = re.search(r"on (http://\S+) ", line)
            url = m.group(1) if m else None
        assert url, "the server did not start"

        async def go():
            async with aiohttp.ClientSession() as s:
                task = asyncio.create_task(stream(s, url + "/v1/completions",
                                                  body_for(0, stream=True, max_tokens=150)))
                while True:  # wait until the stream is decoding
                    async with s.get(url + "/health") as r:
                        if (await r.json())["slots_busy"]:
                            break
                    await asyncio.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                return await task

        status, events = run(go())
        assert status == 200 and events[-1] == "[DONE]"
        assert events[-2].get("usage", {}).get("completion_tokens") == 150, events[-3:]
        assert proc.wait(timeout=60) == 0
        assert "draining" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_load_benchmark_smoke(hf_ckpt, tmp_path):
    """benchmarks.serve_load end to end on the tiny model: a table, JSON, /metrics, lossless."""
    from benchmarks.common import DEFAULT_DATA_DIR, MT_BENCH  # noqa: PLC0415
    if not os.path.isfile(os.path.join(DEFAULT_DATA_DIR, MT_BENCH)):
        pytest.skip(f"needs {MT_BENCH} in {DEFAULT_DATA_DIR} (shared/data/SOURCES.md)")
    from benchmarks import serve_load  # noqa: PLC0415
    assert serve_load.main([f"--config={MODEL}", f"--ckpt={hf_ckpt}", "--n=2", "--max_tokens=6",
                            "--concurrency=1,2", "--methods=ar,prompt_lookup", "--slots=2",
                            "--max_len=500", f"--out={tmp_path}"]) == 0
    result = json.loads((tmp_path / "serve_load.json").read_text())
    assert result["lossless"] and len(result["cells"]) == 4
    cell = result["cells"][-1]
    assert cell["concurrency"] == 2 and cell["tokens"] == 12 and cell["ttft_s"]["p50"] > 0
    assert "| prompt_lookup | 2 |" in (tmp_path / "serve_load.md").read_text()
    metrics = (tmp_path / "serve_load_metrics.txt").read_text()
    assert 'lookahead_requests_total{method="ar",outcome="length"}' in metrics
