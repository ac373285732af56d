"""Worker configuration: environment variables (KVRQ_*) overridden by command-line flags.

docs/worker.md has the table; keep the two in step (tests/worker/test_settings.py checks it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from producer.wire.protocol import DEFAULT_QUEUE
from producer.wire.redis_url import DEFAULT_REDIS_URL


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVRQ_", extra="ignore")

    redis_url: str = Field(
        default=DEFAULT_REDIS_URL, description="Redis holding the queues (and the redis store)"
    )
    queues: str = Field(
        default=DEFAULT_QUEUE, description="comma-separated queue names, first is served first"
    )
    model: str = Field(default="smollm2-135m", description="builtin model name, mlx-lm model id or path")
    store: str = Field(
        default="disk:.kvrq/cache",
        description="agent cache store: disk:PATH, redis, redis://... or shards:URL|URL|...",
    )
    store_quantization: Literal["none", "q8", "q4"] = Field(
        default="none", description="KV quantization at rest"
    )
    kv_bits: Literal[8, 4] | None = Field(
        default=None, description="keep running K/V quantized to 8 or 4 bits (ragged batch models only)"
    )
    draft_model: str | None = Field(
        default=None,
        description="a small model of the same tokenizer that drafts tokens for speculative decoding "
        "(builtin name, mlx-lm model id or path; unset: drafts come from each row's own context)",
    )
    kv_group_size: Literal[32, 64, 128] | None = Field(
        default=None, description="values per quantization group of --kv-bits (default 64)"
    )
    store_hot_mb: float = Field(
        default=512, ge=0, description="recently used caches kept in worker memory (MB)"
    )
    store_max_mb: float | None = Field(default=None, gt=0, description="store size bound, LRU eviction (MB)")
    prefix_cache_mb: float | None = Field(
        default=None,
        ge=0,
        description="store budget for the prefixes of jobs without an agent, reused by later jobs "
        "(MB; default a quarter of store_max_mb, else 1024; 0: jobs without an agent reuse nothing)",
    )
    recent_prefix_mb: float = Field(
        default=256,
        ge=0,
        description="worker memory for the whole caches of recent jobs without an agent, reused token by "
        "token (the store keeps full blocks only; 0: off)",
    )
    warmup: bool = Field(
        default=True,
        description="run a few tokens through the engine before taking jobs (first turns stay fast)",
    )
    namespace: str = Field(
        default="default",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$",
        description="the tenant: reuse of shared prefixes never crosses it (a job may narrow it)",
    )
    pool_mb: float | None = Field(
        default=None, gt=0, description="KV block pool size in MB (engine default 2048)"
    )
    pool_blocks: int | None = Field(
        default=None, gt=0, description="KV block pool size in blocks (wins over MB)"
    )
    max_batch: int = Field(default=16, gt=0, description="sequences decoded together")
    prefill_tokens_per_step: int = Field(
        default=256, gt=0, description="prompt tokens run between two decode steps (chunked prefill)"
    )
    prefill_step_size: int = Field(
        default=512, gt=0, description="prompt tokens per prefill chunk on the BatchGenerator path"
    )
    name: str | None = Field(default=None, description="rq worker name (default: kvrq.HOST.PID.xxxx)")
    max_held: int | None = Field(
        default=None, gt=0, description="jobs held at once, running or waiting (default 2 x max_batch)"
    )
    heartbeat_interval: float = Field(
        default=5.0, gt=0, description="seconds between heartbeats of held jobs"
    )
    heartbeat_ttl: int = Field(
        default=90, gt=1, description="seconds without heartbeat before a job is abandoned"
    )
    liveness_ttl: float = Field(
        default=10.0, gt=0, description="seconds after a worker's death until others see it gone"
    )
    crash_check_interval: float = Field(
        default=5.0, gt=0, description="seconds between checks for jobs of dead workers"
    )
    crash_reruns: int = Field(
        default=2, ge=0, description="re-runs of a job whose worker died (per job: meta kvrq_crash_reruns)"
    )
    affinity: bool = Field(
        default=True, description="serve this worker's own queue first: jobs of agents it holds hot"
    )
    affinity_wait: float = Field(
        default=2.0, ge=0, description="seconds before a busy or draining worker's affine jobs go to others"
    )
    maintenance_interval: float = Field(
        default=60.0, gt=0, description="seconds between abandoned-job cleanups"
    )
    scheduler_interval: float = Field(
        default=1.0,
        ge=0,
        description="seconds between runs of rq's scheduler (scheduled jobs, Retry intervals); 0: off",
    )
    drain_timeout: float = Field(default=30.0, ge=0, description="SIGTERM: seconds to finish running jobs")
    result_ttl: int = Field(
        default=3600, ge=-1, description="seconds results are kept when the job sets none"
    )
    stream_ttl: int = Field(default=3600, gt=0, description="seconds a job's token stream is kept")
    stream_maxlen: int = Field(
        default=100_000,
        gt=0,
        description="entries a token stream keeps at least (one per token, plus a start and an end per run)",
    )
    progress_interval: float = Field(
        default=0.5, ge=0, description="seconds between job.meta progress updates"
    )
    metrics_port: int | None = Field(
        default=None, gt=0, lt=65536, description="serve Prometheus metrics on this port (off when unset)"
    )
    metrics_host: str = Field(default="127.0.0.1", description="address the metrics endpoint binds to")
    log_level: str = Field(default="INFO", description="DEBUG, INFO, WARNING or ERROR")

    @field_validator("queues")
    @classmethod
    def _some_queue(cls, value: str) -> str:
        if not [name for name in value.split(",") if name.strip()]:
            raise ValueError("at least one queue name is needed")
        return value

    @property
    def queue_names(self) -> list[str]:
        return [name.strip() for name in self.queues.split(",") if name.strip()]

    @property
    def held_limit(self) -> int:
        return self.max_held or 2 * self.max_batch

    def store_uri(self) -> str:
        """`redis` means the queue's own Redis."""
        return self.redis_url if self.store == "redis" else self.store
