"""The engine loop and its phases (see worker_loop.py's docstring for one pass, in order).

- worker_loop.py: WorkerLoop, lifecycle and `run_once`;
- intake.py: a dequeued rq job becomes a HeldJob (or a Rejected value);
- admission.py: `Admitter.ready(held) -> Ready | Wait | Outcome`, submit into the engine;
- step.py: one engine step, its output absorbed into each row's stream events;
- endings.py: the one ending path (`end`, `flush`), durability.py: cache puts until durable;
- stops.py: cancels, stop commands, timeouts, hand-back; upkeep.py: heartbeats and rq's registries;
- scheduler.py (admission policy), held.py (HeldJob), outcomes.py (Outcome, Ending), publisher.py
  (buffered stream writes), results.py (the rq result), timeline.py (a job's way to its first token).
"""
