"""`kvrq dashboard`: every page and JSON endpoint of rq-dashboard answers while workers hold JSON jobs.

Two setups on real redis-servers: an rq worker that holds two jobs through rq's own execution API
in this process (fast: no model), and a real `kvrq worker` (the builtin model) holding long jobs
with others queued, finished, failed and canceled. One test renders the Workers page in headless
Chromium, as a browser would after fetching workers.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq import Queue, Worker
from rq.serializers import JSONSerializer

from producer.client import Producer
from producer.wire.protocol import JOB_FUNCTION
from tests.conftest import free_port, require_binary
from tests.worker.procs import ROOT, RedisProcess, WorkerProcess, wait_for
from tests.worker.stackhelp import http_get, serves

REGISTRIES = ("queued", "started", "finished", "failed", "canceled", "deferred", "scheduled")
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy decoding keeps counting: jobs that stay busy


class Dashboard:
    """`python -m worker.cli dashboard` on a free loopback port."""

    def __init__(self, redis_url: str, workdir: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "dashboard.log"
        command = [
            sys.executable,
            "-m",
            "worker.cli",
            "dashboard",
            "--redis",
            redis_url,
            "--port",
            str(self.port),
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        wait_for(lambda: self.proc.poll() is not None or serves(f"{self.base}/"), 60, "no dashboard")
        assert self.proc.poll() is None, self.output()

    def get(self, path: str) -> bytes:
        status, body = http_get(self.base + path)
        assert status == 200, (
            f"{path} answered {status}:\n{body.decode(errors='replace')[-2000:]}\n{self.output()}"
        )
        return body

    def json(self, path: str) -> Any:
        return json.loads(self.get(path))

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=30)


@dataclass
class Scene:
    """Jobs by the registry they are in, and the worker that holds the started ones."""

    worker_name: str
    jobs: dict[str, set[str]] = field(default_factory=dict)


def check_every_endpoint(dashboard: Dashboard, scene: Scene) -> dict[str, Any]:
    """Every page and JSON endpoint answers 200 and lists the jobs where they are; the worker's row."""
    for page in ("/", "/0/view/queues", "/0/view/workers", "/0/view/jobs"):
        dashboard.get(page)
    (queue,) = [q for q in dashboard.json("/0/data/queues.json")["queues"] if q["name"] == "kvrq"]
    assert queue["count"] == len(scene.jobs.get("queued", ()))
    for registry in REGISTRIES[1:]:
        if registry in scene.jobs:
            assert queue[f"{registry}_job_registry_count"] == len(scene.jobs[registry]), registry
    for registry in REGISTRIES:
        dashboard.get(f"/0/view/jobs/kvrq/{registry}/8/asc/1")
        listed = dashboard.json(f"/0/data/jobs/kvrq/{registry}/8/asc/1.json")["jobs"]
        assert {job["id"] for job in listed} == scene.jobs.get(registry, set()), registry
    for registry, ids in scene.jobs.items():
        for job_id in ids:
            dashboard.get(f"/0/view/job/{job_id}")
            assert dashboard.json(f"/0/data/job/{job_id}.json")["status"] == registry, job_id
    (row,) = dashboard.json("/0/data/workers.json")["workers"]
    assert row["name"] == scene.worker_name
    return row


def held_executions(redis_url: str, worker_name: str) -> list[str]:
    """The job ids of the worker's executions, as rq itself reads them."""
    worker = Worker.find_by_key(
        f"rq:worker:{worker_name}", connection=Redis.from_url(redis_url), serializer=JSONSerializer
    )
    assert worker is not None
    return sorted(execution.job_id for execution in worker.get_current_executions(refresh=True))


def loopback_only(port: int) -> bool:
    """Whether the listening socket on `port` is bound to 127.0.0.1 (Linux /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if int(port_hex, 16) == port and state == "0A":
            return address == "0100007F"
    raise AssertionError(f"nothing listens on port {port}")


# ---- rq's execution API in this process: no model, fast --------------------------------------------


@pytest.mark.integration
def test_every_endpoint_answers_while_an_rq_worker_holds_json_jobs(redis_url: str, tmp_path: Path) -> None:
    connection = Redis.from_url(redis_url)
    queue = Queue("kvrq", connection=connection, serializer=JSONSerializer)
    jobs = [queue.enqueue(JOB_FUNCTION, {"prompt": f"job {n}", "max_tokens": 8}) for n in range(5)]
    worker = Worker([queue], connection=connection, serializer=JSONSerializer, name="holds-two")
    worker.register_birth()
    taken = []
    for _ in range(3):  # what a kvrq worker does for every job it takes into its engine
        dequeued = Queue.dequeue_any([queue], None, connection=connection, serializer=JSONSerializer)
        assert dequeued is not None
        job, _ = dequeued
        execution = worker.prepare_execution(job)
        worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
        taken.append((job, execution))
    worker.set_state("busy")
    failed, execution = taken[2]
    worker.handle_job_failure(failed, queue, exc_string="InvalidRequestError: test", execution=execution)
    jobs[3].cancel()
    scene = Scene(
        "holds-two",
        {
            "started": {jobs[0].id, jobs[1].id},
            "failed": {jobs[2].id},
            "canceled": {jobs[3].id},
            "queued": {jobs[4].id},
        },
    )
    dashboard = Dashboard(redis_url, tmp_path)
    try:
        row = check_every_endpoint(dashboard, scene)
        assert row["state"] == "busy" and row["held_jobs"] == 2
        assert row["current_job"]["call_string"] == "busy: 2 jobs held"  # no kvrq fields: a plain rq worker
        assert row["current_job"]["job_id"] == jobs[0].id  # the oldest held job
        assert loopback_only(dashboard.port)
    finally:
        assert dashboard.stop() == 0, dashboard.output()
        worker.register_death()


# ---- a real kvrq worker -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def busy_kvrq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Scene, Dashboard]]:
    """A kvrq worker (max batch 2) holding long jobs; others queued, finished, failed and canceled."""
    workdir = tmp_path_factory.mktemp("dashboard")
    redis = RedisProcess(workdir)
    redis.start()
    worker = WorkerProcess(redis.url, workdir, name="kvrq-dash", args=["--max-batch", "2"])
    dashboard: Dashboard | None = None
    try:
        worker.start()
        with Producer(redis.url) as producer:
            finished = producer.submit({"prompt": "Hello", "max_tokens": 2})
            finished.result(timeout=120)
            plain = Queue("kvrq", connection=Redis.from_url(redis.url), serializer=JSONSerializer)
            failed = plain.enqueue(JOB_FUNCTION, {"prompt": "x", "max_tokens": 0})  # invalid: fails at once
            wait_for(lambda: failed.get_status(refresh=True) == "failed", 60, "the bad job did not fail")
            long = [{"prompt": COUNTING, "max_tokens": 4000, "agent_id": "counter"}] * 2
            long += [{"prompt": COUNTING, "max_tokens": 4000}] * 6
            handles = producer.submit_many(long)
            connection = Redis.from_url(redis.url)
            wait_for(lambda: connection.hget("rq:worker:kvrq-dash", "kvrq_running") == b"2", 120, "not busy")
            queued = [h for h in handles if h.status() == "queued"]
            assert len(queued) >= 2, [h.status() for h in handles]
            queued[0].cancel()
        settled(lambda: held_executions(redis.url, "kvrq-dash"))
        statuses: dict[str, set[str]] = {"finished": {finished.id}, "failed": {failed.id}}
        for handle in handles:
            statuses.setdefault(handle.status(), set()).add(handle.id)
        assert statuses["started"] == set(held_executions(redis.url, "kvrq-dash"))
        dashboard = Dashboard(redis.url, workdir)
        yield redis.url, Scene("kvrq-dash", statuses), dashboard
    finally:
        if dashboard is not None:
            dashboard.stop()
        worker.stop()
        redis.stop()


@pytest.mark.integration
@pytest.mark.slow
def test_every_endpoint_answers_while_a_kvrq_worker_holds_jobs(
    busy_kvrq: tuple[str, Scene, Dashboard],
) -> None:
    redis_url, scene, dashboard = busy_kvrq
    row = check_every_endpoint(dashboard, scene)
    held = held_executions(redis_url, "kvrq-dash")
    assert row["state"] == "busy"
    assert row["held_jobs"] == len(held) == len(scene.jobs["started"])
    assert row["running_jobs"] == 2 and row["running_jobs"] + row["waiting_jobs"] == row["held_jobs"]
    summary = f"busy: {len(held)} jobs held (2 running, {row['waiting_jobs']} waiting)"
    assert row["current_job"]["call_string"] == summary
    assert row["current_job"]["job_id"] in held


@pytest.mark.integration
@pytest.mark.slow
def test_workers_page_renders_the_busy_worker_in_chromium(
    busy_kvrq: tuple[str, Scene, Dashboard], tmp_path: Path
) -> None:
    chromium = _chromium()
    redis_url, _, dashboard = busy_kvrq
    held = len(held_executions(redis_url, "kvrq-dash"))
    done = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",  # tests run as root in CI containers
            "--disable-gpu",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=10000",  # let the page fetch workers.json and fill its table
            "--dump-dom",
            f"{dashboard.base}/0/view/workers",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},  # OpenBLAS crashes its GPU process
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = done.stdout.split('<tr data-role="worker">')[1:]
    rendered = [row for row in rows if "<%" not in row]  # skip the row template itself
    assert len(rendered) == 1, done.stdout[-3000:]
    assert "kvrq-dash" in rendered[0]
    assert f"busy: {held} jobs held (2 running, " in rendered[0]
    assert "Loading..." not in done.stdout.split('id="workers"')[1].split("</table>")[0]


def _chromium() -> str:
    """Debian's `chromium` (Ubuntu's `chromium-browser`); skipped when missing, failed under CI=true."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    return found or require_binary("chromium", "apt-get install chromium; .ci/setup installs it on Debian")


def settled(read: Callable[[], object], quiet_s: float = 3.0, timeout: float = 60) -> None:
    """Wait until `read()` has returned the same value for `quiet_s` seconds."""
    deadline = time.monotonic() + timeout
    last, since = read(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"still changing after {timeout} s: {last}"
        time.sleep(0.5)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
