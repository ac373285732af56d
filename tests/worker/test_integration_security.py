"""Redis with a password, an ACL user, and mutual TLS: every kvrq process works, none shows the secret.

Per mode one real redis-server (its plain port closed where TLS is on, the `default` user off for the
ACL) and one real `kvrq worker` on the builtin model. Through the secured URL: a Producer job and an
agent's second turn resumed from the worker's Redis store (TLS mode) or from a store named by a URL
with the password (the others); `kvrq status`, `kvrq maintenance`, `kvrq batch run` on a 2-line file,
`kvrq batch status`, and `kvrq dashboard` with its pages. Then the secret is searched for in the
output of every process, every page, and every value of every key in Redis (job data, meta, results,
streams, worker hashes, batch records).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from redis.exceptions import RedisError

from producer.client import Producer
from producer.wire.redact import redact_url
from tests.conftest import REDIS_SERVER_HINT, free_port, require_binary
from tests.worker.procs import ROOT, WorkerProcess, wait_for
from tests.worker.stackhelp import http_get, serves

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODES = ("password", "acl", "tls")
SYSTEM = "You are a concise assistant. Answer in one short sentence."


@dataclass
class SecureRedis:
    """A redis-server on 127.0.0.1 that only answers with the secret (and over TLS in mode `tls`)."""

    mode: str
    workdir: Path
    secret: str = field(default_factory=lambda: f"kvrq-{secrets.token_hex(12)}")
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.mode == "password":
            return f"redis://:{self.secret}@127.0.0.1:{self.port}/0"
        if self.mode == "acl":
            return f"redis://alice:{self.secret}@127.0.0.1:{self.port}/0"
        tls = self.workdir / "tls"
        return (
            f"rediss://alice:{self.secret}@127.0.0.1:{self.port}/0?ssl_cert_reqs=required"
            f"&ssl_ca_certs={tls / 'ca.crt'}&ssl_certfile={tls / 'client.crt'}"
            f"&ssl_keyfile={tls / 'client.key'}"
        )

    def start(self) -> None:
        binary = require_binary("redis-server", REDIS_SERVER_HINT)
        args = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        if self.mode == "password":
            args += ["--requirepass", self.secret]
        else:
            args += ["--user", "alice", "on", f">{self.secret}", "~*", "&*", "+@all"]
            args += ["--user", "default", "off"]
        if self.mode == "tls":
            tls = make_certificates(self.workdir / "tls")
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "yes"]
            args += ["--tls-cert-file", str(tls / "server.crt"), "--tls-key-file", str(tls / "server.key")]
            args += ["--tls-ca-cert-file", str(tls / "ca.crt")]
        else:
            args += ["--port", str(self.port)]
        with open(self.workdir / "redis.log", "wb") as log:
            self.proc = subprocess.Popen([binary, *args], stdout=log, stderr=subprocess.STDOUT)
        wait_for(self.answers, 15, f"redis-server ({self.mode}) did not start")

    def answers(self) -> bool:
        try:
            return bool(Redis.from_url(self.url, socket_timeout=1).ping())
        except (RedisError, OSError):
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def make_certificates(directory: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, with the openssl CLI."""
    openssl = require_binary("openssl", "apt-get install openssl")
    directory.mkdir(parents=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvrq test CA",
        "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    (directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=kvrq {name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
        extension = ["-extfile", "server.ext"] if name == "server" else []
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-out", f"{name}.crt", *extension)  # fmt: skip
    return directory


@dataclass
class Stack:
    redis: SecureRedis
    worker: WorkerProcess
    outputs: dict[str, str] = field(default_factory=dict)  # what each process printed, by name


@pytest.fixture(scope="module", params=MODES)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    mode = str(request.param)
    workdir = tmp_path_factory.mktemp(f"secure-{mode}")
    redis = SecureRedis(mode, workdir)
    redis.start()
    # TLS: the worker's store is the queue's own Redis (`redis`); otherwise a URL with the password.
    store = "redis" if mode == "tls" else redis.url
    worker = WorkerProcess(
        redis.url, workdir, name=f"kvrq-secure-{mode}", args=["--store", store, "--max-batch", "4"]
    )
    try:
        worker.start()
        yield Stack(redis, worker)
        assert worker.terminate() == 0, worker.log()
    finally:
        worker.stop()
        redis.stop()


def kvrq(stack: Stack, name: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run `kvrq ARGS` to its end; the output is kept for the secret check and returned."""
    done = subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    stack.outputs[name] = done.stdout + done.stderr
    assert done.returncode == 0, f"kvrq {' '.join(args[:2])} exited {done.returncode}:\n{done.stderr}"
    return done.stdout


def every_value_in_redis(connection: Redis) -> Iterator[tuple[str, bytes]]:
    """Every key's name and values, zlib-compressed ones (rq's job data, exc_info) inflated too."""
    for raw_key in connection.scan_iter(count=1000):
        key = raw_key.decode(errors="replace")
        kind = str(connection.type(raw_key), "ascii")  # type: ignore[arg-type]
        values: list[Any] = [raw_key]
        if kind == "string":
            values.append(connection.get(raw_key) or b"")
        elif kind == "hash":
            hash_fields: Any = connection.hgetall(raw_key)
            values += [part for item in hash_fields.items() for part in item]
        elif kind == "list":
            values += connection.lrange(raw_key, 0, -1)
        elif kind == "set":
            values += list(connection.smembers(raw_key))
        elif kind == "zset":
            values += connection.zrange(raw_key, 0, -1)
        elif kind == "stream":
            entries: Any = connection.xrange(raw_key)
            values += [part for _, entry in entries for item in entry.items() for part in item]
        for value in values:
            yield key, bytes(value)
            with contextlib.suppress(zlib.error):
                yield key, zlib.decompress(value)


def test_worker_producer_cli_batch_and_dashboard_work_and_never_show_the_secret(
    stack: Stack, tmp_path: Path
) -> None:
    url, secret = stack.redis.url, stack.redis.secret
    with pytest.raises(RedisError):  # without the secret (and, for TLS, without TLS) no entry
        Redis(host="127.0.0.1", port=stack.redis.port, socket_timeout=2).ping()

    # A job and an agent's second turn, resumed from the store behind the secured Redis.
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    with Producer(url) as producer:
        first = producer.submit({"agent_id": "sec-agent", "messages": messages, "max_tokens": 6}).result(180)
        turn2 = [*messages, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Why?"}]
        second = producer.submit({"agent_id": "sec-agent", "messages": turn2, "max_tokens": 6}).result(180)
        job_meta = producer.handle(second.job_id).meta()
    assert first.usage.generated_tokens > 0 and first.worker == stack.worker.name
    assert second.usage.reused_tokens > 0, second.usage  # the cache went through the store and back
    assert secret not in json.dumps(job_meta) + first.model_dump_json() + second.model_dump_json()

    # CLI commands: the URL by flag and by environment.
    status = kvrq(stack, "status", "status", "--redis", url)
    assert f"worker {stack.worker.name}" in status and "queue kvrq: " in status
    report = kvrq(stack, "maintenance", "maintenance", env={"KVRQ_REDIS_URL": url})
    assert "queue kvrq: 0 job(s) of dead workers re-queued" in report

    lines = tmp_path / "in.jsonl"
    lines.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"c{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"prompt": f"{i} + {i} =", "max_tokens": 3, "temperature": 0},
                }
            )
            + "\n"
            for i in (1, 2)
        )
    )
    output = tmp_path / "out.jsonl"
    summary = json.loads(
        kvrq(stack, "batch run", "batch", "run", str(lines), "-o", str(output), "--redis", url, "--json")
    )
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in records) == ["c1", "c2"]
    assert all(r["error"] is None for r in records), records
    kvrq(stack, "batch status", "batch", "status", summary["run_id"], env={"KVRQ_REDIS_URL": url})

    # rq-dashboard through the secured URL: pages and JSON answer, none shows the secret.
    port = free_port()
    dashboard_log = tmp_path / "dashboard.log"
    with open(dashboard_log, "wb") as log:
        dashboard = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "dashboard", "--redis", url, "--port", str(port)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: dashboard.poll() is not None or serves(f"{base}/"), 60, "dashboard did not answer")
        pages = {}
        for path in ("/", "/0/view/workers", "/0/data/queues.json", "/0/data/workers.json",
                     f"/0/data/job/{second.job_id}.json"):  # fmt: skip
            code, body = http_get(base + path)
            assert code == 200, (path, body[:300])
            pages[path] = body.decode(errors="replace")
        assert stack.worker.name in pages["/0/data/workers.json"]
        assert "kvrq" in pages["/0/data/queues.json"]
    finally:
        dashboard.terminate()
        dashboard.wait(timeout=20)
    stack.outputs["dashboard"] = dashboard_log.read_text(errors="replace")
    assert "for redis" in stack.outputs["dashboard"]  # its banner names the Redis it serves, redacted
    stack.outputs.update({f"page {path}": body for path, body in pages.items()})

    # Nothing anywhere shows the secret.
    stack.outputs["worker"] = stack.worker.log()
    store_shown = "store redis" if stack.redis.mode == "tls" else f"store {redact_url(url)}"
    assert store_shown in stack.outputs["worker"]  # the startup line names the store, without the secret
    shown = [name for name, text in stack.outputs.items() if secret in text]
    assert shown == [], f"the secret shows in: {shown}"
    connection = Redis.from_url(url)
    holding = {key for key, value in every_value_in_redis(connection) if secret.encode() in value}
    assert holding == set(), f"the secret is stored in: {sorted(holding)}"
    assert connection.dbsize() > 0


def test_a_wrong_secret_fails_without_showing_it(stack: Stack) -> None:
    wrong = f"wrong-{secrets.token_hex(8)}"
    url = stack.redis.url.replace(stack.redis.secret, wrong)
    done = subprocess.run(
        [sys.executable, "-m", "worker.cli", "status", "--redis", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "AuthenticationError" in done.stderr or "invalid username-password" in done.stderr
    assert wrong not in done.stdout + done.stderr
