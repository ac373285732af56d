"""The wire contract at the bottom: what producers, workers and stores must agree on.

Job names and Redis keys (`protocol`), the agent-id rule (`ids`), Redis URLs and failover
(`redis_url`), secrets masked in what is shown (`redact`) and Redis answers as text (`text`).
It imports nothing from kvrq outside itself, only the standard library and redis-py, so `store/`
and every client may import it without pulling in the producer's rq and pydantic side.
"""
