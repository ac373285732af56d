"""Per-agent locks in Redis: two jobs of one agent never run at once, even on two workers.

Within one worker the scheduler already keeps an agent's jobs in order; the lock covers
several workers sharing a queue (and a Redis store). A lock lives as long as the
heartbeats that refresh it, so a killed worker's locks expire with its jobs.
"""

from __future__ import annotations

from redis import Redis
from redis.exceptions import WatchError

from producer.protocol import agent_lock_key


class AgentLocks:
    def __init__(self, connection: Redis, owner: str, ttl_s: int) -> None:
        self.connection = connection
        self.owner = owner
        self.ttl_ms = int(ttl_s * 1000)

    def _token(self, job_id: str) -> str:
        return f"{self.owner}/{job_id}"

    def acquire(self, agent_id: str, job_id: str) -> bool:
        token = self._token(job_id)
        if self.connection.set(agent_lock_key(agent_id), token, nx=True, px=self.ttl_ms):
            return True
        held = self.connection.get(agent_lock_key(agent_id))
        return _text(held) == token  # already ours (retry after an outage)

    def refresh(self, held: dict[str, str]) -> list[str]:
        """Extend the locks of `held` (agent id -> job id); return the agents whose lock is no longer ours."""
        if not held:
            return []
        agents = list(held)
        values = self.connection.mget([agent_lock_key(agent) for agent in agents])
        lost = [a for a, v in zip(agents, values, strict=True) if _text(v) != self._token(held[a])]
        with self.connection.pipeline(transaction=False) as pipe:
            for agent in agents:
                if agent not in lost:
                    pipe.pexpire(agent_lock_key(agent), self.ttl_ms)
            pipe.execute()
        return lost

    def release(self, agent_id: str, job_id: str) -> None:
        key = agent_lock_key(agent_id)
        with self.connection.pipeline() as pipe:
            try:
                pipe.watch(key)
                value = pipe.get(key)
                if _text(value) != self._token(job_id):
                    pipe.unwatch()
                    return
                pipe.multi()
                pipe.delete(key)
                pipe.execute()
            except WatchError:
                pass  # it changed hands meanwhile: not ours to delete


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
