"""Jobs ended before they finish: rq's stop-job commands, producers' cancels, job timeouts, and the
hand-back of a stopping worker. Each check returns its endings; the loop writes them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from queue import Empty
from typing import Any

from redis import Redis

from producer.wire.protocol import ErrorCode, cancel_key
from worker.jobs import rqexec
from worker.loop.outcomes import Canceled, Ending, Failed, HandedBack, Stopped
from worker.loop.scheduler import Scheduler


class Stops:
    def __init__(self, worker: rqexec.KvrqWorker, connection: Redis, scheduler: Scheduler) -> None:
        self.worker = worker
        self.connection = connection
        self.scheduler = scheduler

    def take_commands(self) -> None:
        """Mark the held jobs rq's pubsub thread was told to stop (cancel: the producer's flag is set)."""
        while True:
            try:
                payload: dict[str, Any] = self.worker.commands.get_nowait()
            except Empty:
                return
            held = self.scheduler.by_job_id(str(payload.get("job_id", "")))
            if held is None:
                continue
            if self.connection.exists(cancel_key(held.id)):  # JobHandle.cancel sets it before the command
                held.cancel_requested = True
            else:
                held.stop_requested = True

    def requested(self) -> Iterator[Ending]:
        """The held jobs a cancel or stop was asked for."""
        for held in [h for h in self.scheduler.all() if h.cancel_requested or h.stop_requested]:
            yield held, Canceled() if held.cancel_requested else Stopped()

    def timed_out(self) -> Iterator[Ending]:
        """The running jobs past their rq job_timeout (retried while rq's retries last)."""
        now = time.monotonic()
        for held in list(self.scheduler.running.values()):
            timeout = held.timeout_s
            if timeout is not None and held.admitted_mono is not None and now - held.admitted_mono > timeout:
                reason = f"JobTimeoutException: Job exceeded maximum timeout value ({timeout:.0f} seconds)"
                yield held, Failed(ErrorCode.TIMEOUT, reason, retry=True)

    def hand_back(self, running_too: bool) -> Iterator[Ending]:
        """Waiting jobs go back at once, running ones once `running_too` (the drain timeout is up).

        Each goes to the head of its queue, newest first, so the oldest ends up first and an
        agent's jobs keep their order.
        """
        back = list(self.scheduler.waiting)
        if running_too:
            back += list(self.scheduler.running.values())
        for held in sorted(back, key=lambda h: h.first_enqueued_at, reverse=True):
            yield held, HandedBack()
