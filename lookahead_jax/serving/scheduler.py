"""The scheduler: one thread that owns the slot engine, and a bounded queue in front of it.

Requests (`Job`s) arrive from the HTTP handlers through `submit` (refused when the queue is
full or the server drains). The engine thread loops: drop cancelled jobs, admit queued jobs
into free slots (prefill), run one step of every lane, and hand each job its new text through
its `sink` (called on the engine thread; the server forwards it to the handler's event loop).
Stop strings and the text itself are handled here, on the host, from the token ids.

Failures stay with the request that caused them: a bad request found at admission fails with
400, a prefill that raises fails that request (500), a step that raises fails the requests of
that lane only (500) and the lane starts afresh; the other lanes, the queue and the server go
on.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import traceback
import uuid
from typing import Callable

from lookahead_jax.serving.metrics import Metrics
from lookahead_jax.serving.slots import RequestError, SlotEngine, SlotRequest, Update

log = logging.getLogger("lookahead_jax.serve")


class Draining(Exception):
    """The server is shutting down and takes no new requests."""


@dataclasses.dataclass
class Event:
    """What a job's sink receives. kind: "delta" (text, ids), "done" (finish_reason, usage,
    stats) or "error" (status, message)."""

    kind: str
    text: str = ""
    ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    stats: dict | None = None
    status: int = 200
    message: str = ""


@dataclasses.dataclass
class Job:
    request: SlotRequest
    sink: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:24])
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    cancelled: bool = False
    handle: int | None = None
    ids: list[int] = dataclasses.field(default_factory=list)
    sent_ids: int = 0
    sent_text: int = 0
    first_token: float | None = None
    steps: int = 0  # forward passes so far (the prefill counted)
    settings: dict = dataclasses.field(default_factory=dict)


class Scheduler:
    def __init__(self, slots: SlotEngine, decode: Callable[[list[int]], str], *,
                 queue_size: int = 64, metrics: Metrics | None = None):
        self.slots = slots
        self.decode = decode
        self.queue_size = queue_size
        self.metrics = metrics or Metrics(slots.slots)
        self._queue: collections.deque[Job] = collections.deque()
        self._active: dict[int, Job] = {}
        self._admitting = 0  # jobs taken from the queue and not yet in a slot (prefilling)
        self._cv = threading.Condition()
        self._stopping = False
        self.draining = False
        self._thread: threading.Thread | None = None

    # -- from the HTTP side -----------------------------------------------------------------
    def submit(self, job: Job) -> bool:
        """Queues a job; False when the queue is full. Raises Draining while shutting down."""
        with self._cv:
            if self.draining or self._stopping:
                raise Draining()
            if len(self._queue) >= self.queue_size:
                self.metrics.requests.labels(job.request.method, "rejected").inc()
                return False
            self._queue.append(job)
            self.metrics.queue.set(len(self._queue))
            self._cv.notify()
        return True

    def cancel(self, job: Job) -> None:
        """The client went away: the job is dropped before its next step."""
        with self._cv:
            job.cancelled = True
            self._cv.notify()

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._queue) + len(self._active) + self._admitting

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="lookahead-engine", daemon=True)
        self._thread.start()

    def drain(self, timeout_s: float) -> bool:
        """Stops taking requests and waits up to `timeout_s` for the queued and running ones
        to finish; returns whether they all did."""
        with self._cv:
            self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.pending

    def stop(self) -> None:
        """Ends the engine thread; requests still queued or running fail with 503."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)
        for job in list(self._queue) + list(self._active.values()):
            job.sink(Event("error", status=503, message="the server shut down"))
        self._queue.clear()
        self._active.clear()

    # -- the engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._queue or self._active):
                    self._cv.wait(timeout=1.0)
                    self.metrics.update_rate()
                if self._stopping:
                    return
            try:
                self._tick()
            except Exception:  # noqa: BLE001  (a bug here must not kill the thread silently)
                log.error("scheduler error:\n%s", traceback.format_exc())
                time.sleep(0.1)

    def _tick(self) -> None:
        for handle, job in list(self._active.items()):
            if job.cancelled:
                self._finish(job, "cancelled")
        while self.slots.free > 0:
            with self._cv:
                if not self._queue:
                    break
                job = self._queue.popleft()
                self._admitting += 1
                self.metrics.queue.set(len(self._queue))
            try:
                if job.cancelled:
                    self.metrics.finished(job.request.method, "cancelled", 0, 0)
                    continue
                self._admit(job)
            finally:
                with self._cv:
                    self._admitting -= 1
        for lane in list(self.slots.lanes.values()):
            if not lane.handles:
                continue
            try:
                updates = self.slots.step_lane(lane)
            except Exception as e:  # noqa: BLE001  (the lane's requests fail, nothing else)
                log.error("step failed:\n%s", traceback.format_exc())
                for handle in self.slots.drop_lane(lane):
                    job = self._active.pop(handle, None)
                    if job is not None:
                        self._fail(job, 500, f"decoding failed: {type(e).__name__}: {e}")
                continue
            for handle, update in updates.items():
                job = self._active.get(handle)
                if job is not None:
                    self._deliver(job, update)
        self.metrics.busy.set(self.slots.live)

    def _admit(self, job: Job) -> None:
        try:
            handle, first = self.slots.admit(job.request)
        except RequestError as e:
            self._fail(job, 400, str(e))
            return
        except Exception as e:  # noqa: BLE001  (this request fails alone)
            log.error("prefill failed:\n%s", traceback.format_exc())
            self._fail(job, 500, f"prefill failed: {type(e).__name__}: {e}")
            return
        job.handle = handle
        self._active[handle] = job
        self.metrics.busy.set(self.slots.live)
        self._deliver(job, first)

    def _deliver(self, job: Job, update: Update) -> None:
        if job.cancelled:
            self._finish(job, "cancelled")
            return
        now = time.monotonic()
        if update.ids:
            if job.first_token is None:
                job.first_token = now
                self.metrics.ttft.observe(now - job.arrived)
            self.metrics.per_step.labels(job.request.method).observe(len(update.ids))
        job.ids.extend(update.ids)
        job.steps = update.steps
        text = self.decode(job.ids)
        finish = None
        cut = _first_stop(text, job.stop)
        if cut is not None:
            text, finish = text[:cut], "stop"
            job.ids = _ids_through(job.ids, cut, job.stop, self.decode)
        elif update.done:
            eos = job.ids and job.ids[-1] in self.slots.engine.eos_ids
            finish = "stop" if eos else "length"
        if finish is None:
            hold = max((len(s) for s in job.stop), default=1) - 1
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for it
                hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
            ready = text[:max(len(text) - hold, job.sent_text)]
            self._emit_delta(job, ready)
            return
        self._emit_delta(job, text)
        self._finish(job, finish)

    def _emit_delta(self, job: Job, text: str) -> None:
        new_text = text[job.sent_text:]
        new_ids = job.ids[job.sent_ids:]
        if not new_text and not new_ids:
            return
        job.sent_text = len(text)
        job.sent_ids = len(job.ids)
        self.metrics.generated(job.request.method, len(new_ids))
        job.sink(Event("delta", text=new_text, ids=new_ids))

    def _finish(self, job: Job, reason: str) -> None:
        if job.handle is not None:
            self._active.pop(job.handle, None)
            self.slots.evict(job.handle)
            self.metrics.busy.set(self.slots.live)
        steps = job.steps
        self.metrics.finished(job.request.method, reason, len(job.ids), steps)
        if reason == "cancelled":
            return
        self.metrics.latency.observe(time.monotonic() - job.arrived)
        usage = {"prompt_tokens": len(job.request.ids), "completion_tokens": len(job.ids),
                 "total_tokens": len(job.request.ids) + len(job.ids)}
        stats = {"method": job.request.method, **job.settings, "steps": steps,
                 "step_compression": len(job.ids) / steps if steps else 0.0}
        job.sink(Event("done", finish_reason=reason, usage=usage, stats=stats))

    def _fail(self, job: Job, status: int, message: str) -> None:
        self.metrics.finished(job.request.method, "error", len(job.ids), 0)
        job.sink(Event("error", status=status, message=message))


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def _ids_through(ids: list[int], cut: int, stops: tuple[str, ...],
                 decode: Callable[[list[int]], str]) -> list[int]:
    """The shortest prefix of `ids` whose text contains a stop string."""
    for n in range(1, len(ids) + 1):
        if _first_stop(decode(ids[:n]), stops) is not None:
            return ids[:n]
    return ids

