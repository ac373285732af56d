"""`kvrq demo`: two agents, three turns each, answers streamed, and per turn how much of the
prompt came from the agent's saved KV cache and how soon the first token arrived.

Each agent carries a long briefing in its system message, so its first turn prefills
hundreds of tokens (cold) and its later turns resume from the cache (warm).
With `--spawn`, the demo starts its own redis-server and worker and stops them at the end.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import IO

from producer.client import Producer
from producer.liveness import live_workers
from producer.models import ChatMessage, GenerationRequest
from worker.cli.commands import summary_line
from worker.cli.spawn import redis_server, worker_process

_FACTS = (
    "The Lighthouse Project keeps a fleet of eleven research boats along a rocky northern coast. "
    "Each boat is named after a seabird: Puffin, Gannet, Fulmar, Kittiwake, Shearwater, Petrel, Tern, "
    "Guillemot, Razorbill, Skua and Cormorant. The fleet measures water temperature, salinity and "
    "plankton every morning at dawn, and sends its readings to a station on the harbour wall. "
    "The station is run by three people: Ada, who maintains the instruments; Bram, who plans the routes; "
    "and Chidi, who writes the weekly report. In winter only four boats sail, because storms close the outer "
    "channel for weeks at a time. The oldest boat, Cormorant, was built in 1978 and still has its original "
    "brass compass. The newest, Puffin, carries an underwater drone that can dive to two hundred metres. "
)
AGENTS: dict[str, tuple[str, list[str]]] = {
    "harbour-guide": (
        "You are the friendly guide of the Lighthouse Project. Answer briefly, using only these notes. "
        + _FACTS * 3,
        ["How many boats are in the fleet?", "Which boat is the oldest?", "Who writes the weekly report?"],
    ),
    "route-planner": (
        "You help Bram plan boat routes for the Lighthouse Project. Be brief and practical. Notes: "
        + _FACTS * 3,
        ["Which boats sail in winter?", "What can the Puffin do?", "When are readings taken?"],
    ),
}


def run_demo(
    redis_url: str, queue: str, *, max_tokens: int, timeout: float, out: IO[str] = sys.stdout
) -> int:
    with Producer(redis_url, queue) as producer:
        if not live_workers(producer.connection, queue):
            print(
                f"no kvrq worker listens on queue {queue}: start one (kvrq worker) or use --spawn", file=out
            )
            return 1
        histories = {
            agent: [ChatMessage(role="system", content=system)] for agent, (system, _) in AGENTS.items()
        }
        turns = max(len(questions) for _, questions in AGENTS.values())
        for turn in range(turns):
            for agent, (_, questions) in AGENTS.items():
                history = histories[agent]
                history.append(ChatMessage(role="user", content=questions[turn]))
                print(f"\n[{agent}, turn {turn + 1}] {questions[turn]}", file=out)
                request = GenerationRequest(agent_id=agent, messages=history, max_tokens=max_tokens)
                started = time.perf_counter()
                handle = producer.submit(request)
                first: float | None = None
                out.write("> ")
                for text in handle.stream(timeout=timeout):
                    if first is None:
                        first = time.perf_counter() - started
                    out.write(text)
                    out.flush()
                result = handle.result(timeout=timeout)
                print(f"\n  {summary_line(result, first)}", file=out)
                history.append(ChatMessage(role="assistant", content=result.text))
    print(
        "\nTurn 1 of each agent prefilled its whole briefing (cold); later turns resumed from the cache.",
        file=out,
    )
    return 0


def demo(
    redis_url: str,
    queue: str,
    *,
    spawn_redis: bool,
    spawn_worker: bool,
    store: str | None,
    max_tokens: int,
    timeout: float,
    out: IO[str] = sys.stdout,
) -> int:
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvrq-demo-")))
        if spawn_redis:
            redis_url = stack.enter_context(redis_server(workdir))
            print(f"(started redis-server at {redis_url})", file=out)
        if spawn_worker:
            queue = f"{queue}-demo-{os.getpid()}"  # private queue: only our worker takes these jobs
            print("(starting a kvrq worker: loading the model takes a few seconds)", file=out)
            stack.enter_context(
                worker_process(redis_url, queue=queue, store=store or f"disk:{workdir / 'cache'}")
            )
        try:
            return run_demo(redis_url, queue, max_tokens=max_tokens, timeout=timeout, out=out)
        except KeyboardInterrupt:
            print("\ninterrupted", file=out)
            return 130
    return 0
