"""Agent turns across the fleet: an agent's jobs run one at a time, in enqueue order, on any worker.

Three Redis records per agent (keys in producer/wire/protocol.py):
- a line (sorted set): every held job of the agent, scored by its first enqueue time. A job
  joins when a worker takes it and leaves when it ends; a job handed back (drain, crash
  re-run) keeps its place, so the agent's later jobs never overtake it;
- a lock: the job at the head of the line takes it, with a TTL its worker's heartbeats renew;
  it is released only once the job's cache is durable in the shared store, so the next job,
  on any worker, resumes from it. Within one worker the lock passes straight to the agent's
  next job (the hot tier has the cache already);
- a fence counter, bumped by every taker: the store refuses a put whose fence is older than
  the cache it holds, so a worker that lost its lock (stalled, partitioned) never overwrites
  a newer cache. On a replicated Redis (a Sentinel URL's `wait`) a turn is used only once a
  replica holds its lock and fence, so a failover cannot hand one fence to two turns.

A dead worker's locks are freed by whoever notices its death (`release_dead_worker`). On a
replicated Redis a release is confirmed like a job's ending (worker/fleet/confirmed_endings.py): a failover
that dropped it would leave the agent's next turn waiting out the lock's TTL (90 s by default), so a
release found undone on the new primary is made again (`confirm_releases`).
The remaining race: two workers that dequeue two jobs of one agent within the same few
milliseconds may both see the line before the earlier one has joined it.
"""

from __future__ import annotations

import logging

from redis import Redis
from redis.exceptions import WatchError
from rq.job import Job, JobStatus

from producer.wire.protocol import agent_fence_key, agent_jobs_key, agent_lock_key, worker_agents_key
from producer.wire.redis_url import wait_replicated
from producer.wire.text import as_text
from worker.fleet.replica_reads import ReplicaReads

log = logging.getLogger("kvrq.worker")

_ENDED = {None, JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED}


class AgentTurns:
    def __init__(self, connection: Redis, owner: str, ttl_s: float) -> None:
        self.connection = connection
        self.owner = owner
        self.ttl_ms = int(ttl_s * 1000)
        self._locks: dict[str, str] = {}  # agent -> job id holding its lock from this worker
        self._released: ReplicaReads[tuple[str, str]] = ReplicaReads(
            connection, lambda released: f"agent {released[0]}'s release by job {released[1]}"
        )  # (agent, job id) released, until a replica confirms it

    def _token(self, job_id: str) -> str:
        return f"{self.owner}/{job_id}"

    def join(self, agent_id: str, job_id: str, first_enqueued_at: float) -> None:
        """Stand `job_id` in its agent's line (idempotent: a re-taken job keeps its place)."""
        self.connection.zadd(agent_jobs_key(agent_id), {job_id: first_enqueued_at}, nx=True)

    def leave(self, agent_id: str, job_id: str) -> None:
        """`job_id` ended: the agent's next job may take the turn once the lock is released."""
        self.connection.zrem(agent_jobs_key(agent_id), job_id)

    def take(self, agent_id: str, job_id: str, *, held_here: set[str]) -> int | None:
        """The fence of `job_id`'s turn, or None while an earlier job or another worker has it.

        `held_here`: job ids this worker still runs; a lock of this worker held for any other
        job (one that ended and is saving its cache to the shared store) passes to `job_id`.
        """
        if not self._is_head(agent_id, job_id):
            return None
        lock_key, token = agent_lock_key(agent_id), self._token(job_id)
        taken = self.connection.set(lock_key, token, nx=True, px=self.ttl_ms)
        if not taken and not self._hand_over(lock_key, token, held_here):
            return None
        fence = int(self.connection.incr(agent_fence_key(agent_id)))
        self.connection.sadd(worker_agents_key(self.owner), agent_id)
        # On a replicated Redis (the URL's `wait`) the turn is used only once a replica holds it: a
        # failover that dropped the fence would hand the same fence to the agent's next turn.
        wait_replicated(self.connection, [lock_key, agent_fence_key(agent_id)])
        self._locks[agent_id] = job_id
        return fence

    def _is_head(self, agent_id: str, job_id: str) -> bool:
        key = agent_jobs_key(agent_id)
        while True:
            head = _texts(self.connection.zrange(key, 0, 0))
            if not head or head[0] == job_id:
                return True
            status = as_text(self.connection.hget(Job.key_for(head[0]), "status"))
            if status not in _ENDED:
                return False  # an earlier job of this agent is queued or running somewhere
            self.connection.zrem(key, head[0])  # left behind by a job that ended elsewhere

    def _hand_over(self, lock_key: str, token: str, held_here: set[str]) -> bool:
        with self.connection.pipeline() as pipe:
            try:
                pipe.watch(lock_key)
                current = as_text(pipe.get(lock_key))
                if current == token:
                    pipe.unwatch()
                    return True  # ours already (a retry after an outage)
                prefix = f"{self.owner}/"
                if current is None or not current.startswith(prefix) or current[len(prefix) :] in held_here:
                    pipe.unwatch()
                    return False
                pipe.multi()
                pipe.set(lock_key, token, px=self.ttl_ms)
                pipe.execute()
                return True
            except WatchError:
                return False

    def release(self, agent_id: str, job_id: str) -> None:
        """Free the agent's lock if `job_id` still holds it (a handed-over lock is left alone)."""
        key = agent_lock_key(agent_id)
        with self.connection.pipeline() as pipe:
            try:
                pipe.watch(key)
                if as_text(pipe.get(key)) != self._token(job_id):
                    pipe.unwatch()
                else:
                    pipe.multi()
                    pipe.delete(key)
                    pipe.srem(worker_agents_key(self.owner), agent_id)
                    pipe.execute()
                    self._released.add((agent_id, job_id))
            except WatchError:
                pass  # it changed hands meanwhile: not ours to delete
        if self._locks.get(agent_id) == job_id:
            del self._locks[agent_id]

    def confirm_releases(self) -> int:
        """Make again the lock releases a failover dropped (the lock is ours again on the new primary,
        though this worker let it go); how many. 0 while no replica confirms (worker/fleet/replica_reads.py).
        Raises redis-py's ConnectionError when Redis is away."""
        found = self._released.read_back(lambda pipe, released: pipe.get(agent_lock_key(released[0])))
        again = 0
        for (agent_id, job_id), (value,) in found:
            if as_text(value) == self._token(job_id) and self._locks.get(agent_id) != job_id:
                log.warning(
                    "agent %s: the release of job %s's turn was gone after a failover: again",
                    agent_id,
                    job_id,
                )
                self.release(agent_id, job_id)
                again += 1
        return again

    def refresh(self) -> list[str]:
        """Renew every lock this worker holds; the agents whose lock is no longer ours are returned."""
        if not self._locks:
            return []
        agents = list(self._locks)
        values = self.connection.mget([agent_lock_key(agent) for agent in agents])
        lost = [a for a, v in zip(agents, values, strict=True) if as_text(v) != self._token(self._locks[a])]
        with self.connection.pipeline(transaction=False) as pipe:
            for agent in agents:
                if agent not in lost:
                    pipe.pexpire(agent_lock_key(agent), self.ttl_ms)
            pipe.expire(worker_agents_key(self.owner), max(1, self.ttl_ms // 1000))
            pipe.execute()
        for agent in lost:
            del self._locks[agent]
        return lost


def release_dead_worker(connection: Redis, worker_name: str) -> list[str]:
    """Free every agent lock a dead worker held; returns those agents."""
    agents = _texts(connection.smembers(worker_agents_key(worker_name)))
    freed = []
    for agent in agents:
        key = agent_lock_key(agent)
        with connection.pipeline() as pipe:
            try:
                pipe.watch(key)
                value = as_text(pipe.get(key))
                if value is None or not value.startswith(f"{worker_name}/"):
                    pipe.unwatch()
                    continue
                pipe.multi()
                pipe.delete(key)
                pipe.execute()
                freed.append(agent)
            except WatchError:
                continue
    connection.delete(worker_agents_key(worker_name))
    return freed


def _texts(values: object) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]  # type: ignore[attr-defined]
