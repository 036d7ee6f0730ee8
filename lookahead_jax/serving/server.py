"""The OpenAI-compatible HTTP server (aiohttp), in front of the scheduler's engine thread.

    POST /v1/completions, /v1/chat/completions   (stream: server-sent events)
    GET  /v1/models, /health, /metrics           (/metrics: Prometheus text format)

Status codes: 400 with an OpenAI error object whose `param` names the field at fault; 429 with
Retry-After when the queue is full; 500 for a request whose decoding failed (the others go on);
503 while draining. A client that disconnects cancels its request, which frees its slot
before the next step. `Server.shutdown` (SIGTERM in `python -m lookahead_jax.serve`) stops
taking requests, lets the running ones finish within a bound, then closes.

    server = Server(engine, slots=SlotEngine(engine, slots=8), model_name="smollm2_135m")
    await server.start("127.0.0.1", 8000)
    ...
    await server.shutdown(drain_s=30)
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from lookahead_jax.serving import api
from lookahead_jax.serving.metrics import CONTENT_TYPE
from lookahead_jax.serving.scheduler import Draining, Event, Job, Scheduler
from lookahead_jax.serving.slots import RequestError, SlotEngine, request_settings
from lookahead_jax.store.tokenizer import encode_messages, encode_prompt
from models.config import ConfigError

log = logging.getLogger("lookahead_jax.serve")
POLL_S = 0.25  # how often a waiting handler checks that its client is still there


class Server:
    def __init__(self, slots: SlotEngine, *, model_name: str, default_method: str | None = None,
                 queue_size: int = 64, retry_after_s: int = 1):
        engine = slots.engine
        self.slots = slots
        self.model_name = model_name
        self.default_method = default_method or ("lookahead" if engine.lookahead else "ar")
        self.retry_after_s = retry_after_s
        tok = engine.tokenizer
        self._encode_text = None if tok is None else (
            lambda text: encode_prompt(tok, text, chat=False))
        self._encode_chat = None if getattr(tok, "chat_template", None) is None else (
            lambda messages: encode_messages(tok, messages))
        decode = (lambda ids: "") if tok is None else engine.decode
        self.scheduler = Scheduler(slots, decode, queue_size=queue_size)
        self.metrics = self.scheduler.metrics
        self.app = web.Application(client_max_size=8 * 2 ** 20)
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics_text),
        ])
        self._runner: web.AppRunner | None = None

    # -- life cycle -------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        """Starts the engine thread and listens; returns the port (pass 0 for any free one)."""
        self.scheduler.start()
        self._runner = web.AppRunner(self.app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def shutdown(self, drain_s: float = 30.0) -> bool:
        """Stops taking requests (503), waits up to `drain_s` for the running ones, then stops.
        Returns whether every request finished in time."""
        loop = asyncio.get_running_loop()
        finished = await loop.run_in_executor(None, self.scheduler.drain, drain_s)
        await loop.run_in_executor(None, self.scheduler.stop)
        await asyncio.sleep(0.05)  # let handlers write what the last events carried
        if self._runner is not None:
            await self._runner.cleanup()
        return finished

    # -- endpoints --------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "lookahead_jax",
             "max_model_len": self.slots.limits.max_len}]})

    async def health(self, request: web.Request) -> web.Response:
        status = "draining" if self.scheduler.draining else "ok"
        return web.json_response(
            {"status": status, "slots": self.slots.slots, "slots_busy": self.slots.live,
             "pending": self.scheduler.pending}, status=503 if status == "draining" else 200)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.text(), headers={"Content-Type": CONTENT_TYPE})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            return _error(400, f"malformed JSON: {e}", "body")
        try:
            parsed = api.parse(body, chat=chat, model_name=self.model_name,
                               default_method=self.default_method,
                               max_tokens=self.slots.limits.max_tokens,
                               max_len=self.slots.limits.max_len, encode_text=self._encode_text,
                               encode_chat=self._encode_chat)
            method = self.slots.check(parsed.request)
        except RequestError as e:
            param = "messages" if chat and e.param == "prompt" else e.param
            return _error(400, str(e), param)
        except ConfigError as e:  # e.g. an invalid chat template rendering
            return _error(400, str(e), None)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        job = Job(parsed.request, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                  stop=parsed.stop, settings=request_settings(method))
        try:
            accepted = self.scheduler.submit(job)
        except Draining:
            return _error(503, "the server is shutting down", None, "server_error")
        if not accepted:
            resp = _error(429, "the request queue is full; retry later", None, "rate_limit_error")
            resp.headers["Retry-After"] = str(self.retry_after_s)
            return resp
        try:
            if parsed.stream:
                return await self._stream(request, parsed, job, events)
            return await self._collect(request, parsed, job, events)
        except BaseException:  # the client went away (or the handler was cancelled)
            self.scheduler.cancel(job)
            raise

    async def _next(self, request: web.Request, job: Job, events: asyncio.Queue) -> Event:
        """The job's next event; cancels the job when the client has gone away meanwhile."""
        while True:
            try:
                return await asyncio.wait_for(events.get(), POLL_S)
            except asyncio.TimeoutError:
                transport = request.transport
                if transport is None or transport.is_closing():
                    raise ConnectionResetError("the client went away")

    async def _collect(self, request, parsed, job, events) -> web.Response:
        text, ids = [], []
        while True:
            ev = await self._next(request, job, events)
            if ev.kind == "delta":
                text.append(ev.text)
                ids.extend(ev.ids)
            elif ev.kind == "error":
                return _error(ev.status, ev.message, None, "server_error")
            else:
                return web.json_response(api.response(
                    parsed, job.id, self.model_name, "".join(text), ids, ev.finish_reason,
                    ev.usage, ev.stats))

    async def _stream(self, request, parsed, job, events) -> web.StreamResponse:
        first = await self._next(request, job, events)  # a failure before any token: a status
        if first.kind == "error":
            return _error(first.status, first.message, None, "server_error")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        ev, is_first = first, True
        while True:
            if ev.kind == "delta":
                await send(api.chunk(parsed, job.id, self.model_name, ev.text, ev.ids,
                                     first=is_first))
                is_first = False
            elif ev.kind == "error":
                await send(api.error_body(ev.message, None, "server_error"))
                break
            else:
                await send(api.chunk(parsed, job.id, self.model_name, None, [],
                                     ev.finish_reason, first=is_first, usage=ev.usage,
                                     stats=ev.stats))
                break
            ev = await self._next(request, job, events)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _error(status: int, message: str, param: str | None,
           kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(api.error_body(message, param, kind), status=status)
