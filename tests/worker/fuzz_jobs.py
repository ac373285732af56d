"""Fuzzed kvrq jobs, enqueued the way any plain-rq client can: each one is invalid by construction.

`fuzz_cases(n, seed)` draws `n` cases from families of bad input (wrong types, junk payloads,
broken chat messages, oversized fields, bad argument shapes, other function names, pickled
jobs). Every case knows the words its failure reason must contain (the field, or the
function / serializer at fault), so a test can check that each fails alone with a reason
that names what is wrong. `enqueue(case, connection)` puts it on a queue with rq's own API.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.client import JobFailedError, JobHandle, ResultTimeoutError
from producer.models import (
    MAX_MESSAGES,
    MAX_METADATA_BYTES,
    MAX_PROMPT_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKENS_LIMIT,
)
from producer.wire.ids import MAX_AGENT_ID_LENGTH
from producer.wire.protocol import JOB_FUNCTION, ErrorCode


@dataclass(frozen=True)
class FuzzCase:
    family: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    function: str = JOB_FUNCTION
    pickled: bool = False  # enqueued with rq's default (pickle) serializer
    expect: tuple[str, ...] = ()  # each must appear in the failure reason

    def describe(self) -> str:
        shown = repr((self.function, self.args, self.kwargs))
        return f"{self.family}: {shown[:160]}{'...' if len(shown) > 160 else ''}"


def enqueue(case: FuzzCase, connection: Redis, queue_name: str = "kvrq") -> Job:
    """Enqueue `case` with plain rq (JSON, or rq's default pickle for pickled cases)."""
    queue = (
        Queue(queue_name, connection=connection)
        if case.pickled
        else Queue(queue_name, connection=connection, serializer=JSONSerializer)
    )
    return queue.enqueue_call(case.function, args=case.args, kwargs=case.kwargs)  # rq consumes nothing


def good_request(rng: random.Random) -> dict[str, Any]:
    """A valid request for the fields to be broken one at a time."""
    if rng.random() < 0.5:
        return {"prompt": "Say hi.", "max_tokens": 2}
    return {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}


def _junk_text(rng: random.Random, size: int = 12) -> str:
    alphabet = string.ascii_letters + string.punctuation + " éß中\u200b"
    return "".join(rng.choice(alphabet) for _ in range(size))


def _word(rng: random.Random) -> str:
    """Junk that no numeric field coerces (always holds a letter)."""
    return "x" + "".join(rng.choice(string.ascii_letters + "!? ") for _ in range(rng.randint(0, 8)))


# Values each field never accepts, by field: (value maker, what the reason must name).
def _bad_field_value(rng: random.Random, name: str) -> Any:
    junk_containers: list[Any] = [[], {}, [1, 2], {"a": 1}]
    makers: dict[str, list[Callable[[], Any]]] = {
        "max_tokens": [
            lambda: _word(rng),
            lambda: rng.choice(junk_containers),
            lambda: rng.randint(-(10**6), 0),
            lambda: rng.randint(MAX_TOKENS_LIMIT + 1, 10**12),
            lambda: rng.uniform(1.1, 99.9),
        ],
        "temperature": [
            lambda: _word(rng),
            lambda: rng.uniform(-100, -0.001),
            lambda: rng.uniform(100.01, 1e9),
            lambda: rng.choice(junk_containers),
        ],
        "top_p": [lambda: _word(rng), lambda: rng.uniform(-5, 0), lambda: rng.uniform(1.001, 50)],
        "seed": [lambda: _word(rng), lambda: rng.randint(-(10**6), -1), lambda: 2**63 + rng.randint(0, 99)],
        "stop": [
            lambda: _word(rng),
            lambda: [rng.randint(0, 9)],
            lambda: [""],
            lambda: ["s"] * (MAX_STOP_STRINGS + rng.randint(1, 20)),
            lambda: ["x" * rng.randint(257, 4000)],
        ],
        "agent_id": [
            lambda: "../" + _word(rng),
            lambda: "/etc/" + _word(rng),
            lambda: "a/" * rng.randint(1, 5) + "b",
            lambda: "",
            lambda: "a" * rng.randint(MAX_AGENT_ID_LENGTH + 1, 5000),
            lambda: rng.randint(0, 10**6),
            lambda: ["agent"],
            lambda: ".hidden",
            lambda: "agent " + _word(rng),
        ],
        "prompt": [
            lambda: "",
            lambda: rng.randint(0, 99),
            lambda: [_word(rng)],
            lambda: {"text": _word(rng)},
            lambda: "p" * (MAX_PROMPT_CHARS + rng.randint(1, 1000)),
        ],
        "metadata": [
            lambda: _word(rng),
            lambda: [1, 2, 3],
            lambda: {"blob": "m" * (MAX_METADATA_BYTES + rng.randint(1, 5000))},
        ],
        "queue": [lambda: "bad queue/" + _word(rng), lambda: "", lambda: [1]],
        "job_timeout": [lambda: rng.randint(-100, 0), lambda: _word(rng)],
        "retries": [lambda: rng.randint(-100, -1), lambda: rng.randint(101, 10**6), lambda: _word(rng)],
    }
    return rng.choice(makers[name])()


def _bad_messages(rng: random.Random) -> tuple[Any, str]:
    """Broken chat messages, and where pydantic will point."""
    content = "hello"
    choices: list[tuple[Any, str]] = [
        ([], "messages"),
        (_word(rng), "messages"),
        ({"role": "user", "content": content}, "messages"),
        ([_word(rng)], "messages.0"),
        ([{"content": content}], "messages.0.role"),
        (
            [{"role": "user"}],
            "messages.0",
        ),  # "content may be left out only on an assistant message with tool_calls"
        ([{"role": "user", "content": rng.randint(0, 9)}], "messages.0.content"),
        ([{"role": "", "content": content}], "messages.0.role"),
        ([{"role": "not a role " + _word(rng), "content": content}], "messages.0.role"),
        ([{"role": "user", "content": content, _word(rng).replace(" ", "_"): 1}], "messages.0"),
        ([{"role": "user", "content": "c" * (MAX_PROMPT_CHARS + 1)}], "messages.0.content"),
        ([{"role": "user", "content": content}] * (MAX_MESSAGES + rng.randint(1, 50)), "messages"),
        ([{"role": "user", "content": content}, None], "messages.1"),
    ]
    return rng.choice(choices)


FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "agent_id",
    "prompt",
    "metadata",
    "queue",
    "job_timeout",
    "retries",
)


def _wrong_field(rng: random.Random) -> FuzzCase:
    request = good_request(rng)
    name = rng.choice(FIELDS)
    if name == "prompt":
        request.pop("messages", None)
    request[name] = _bad_field_value(rng, name)
    return _as_job(rng, "wrong type or range", request, (name,))


def _broken_messages(rng: random.Random) -> FuzzCase:
    request = good_request(rng)
    request.pop("prompt", None)
    request["messages"], where = _bad_messages(rng)
    return _as_job(rng, "broken messages", request, (where,))


def _junk_payload(rng: random.Random) -> FuzzCase:
    junk_key = "k" + _word(rng).replace(" ", "_")
    choices: list[tuple[Any, tuple[str, ...]]] = [
        (_junk_text(rng), ("request",)),
        (rng.randint(-99, 99), ("request",)),
        ([_word(rng), 1], ("request",)),
        (None, ("request",)),
        ({}, ("prompt", "messages")),
        ({"max_tokens": 3}, ("prompt", "messages")),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, ("prompt", "messages")),
        ({"prompt": "hi", junk_key: _junk_text(rng)}, (junk_key,)),
        ({"prompt": "hi", "stream": True}, ("stream",)),
    ]
    payload, expect = rng.choice(choices)
    if payload is None:  # no argument at all
        return FuzzCase("junk payload", expect=("no request",))
    return FuzzCase("junk payload", args=(payload,), expect=expect)


def _argument_shapes(rng: random.Random) -> FuzzCase:
    request = {"prompt": "hi", "max_tokens": 2}
    choices = [
        FuzzCase("argument shape", args=(request, request), expect=("one positional",)),
        FuzzCase("argument shape", args=(request,), kwargs={"max_tokens": 3}, expect=("not both",)),
        FuzzCase("argument shape", args=(request, _word(rng), 3), expect=("one positional",)),
        FuzzCase("argument shape", kwargs={"request": _word(rng)}, expect=("request",)),
    ]
    return rng.choice(choices)


def _other_function(rng: random.Random) -> FuzzCase:
    function = rng.choice(
        ["os.system", "builtins.print", "worker.jobs.other", "worker.jobs.generate2", "json.loads"]
    )
    return FuzzCase("other function", args=({"prompt": "hi"},), function=function, expect=(function,))


def _pickled(rng: random.Random) -> FuzzCase:
    return FuzzCase("pickled job", args=(good_request(rng),), pickled=True, expect=("JSONSerializer",))


def _as_job(rng: random.Random, family: str, request: dict[str, Any], expect: tuple[str, ...]) -> FuzzCase:
    """The documented positional form, or the fields as keyword arguments (also accepted)."""
    if rng.random() < 0.3:
        return FuzzCase(family, kwargs=request, expect=expect)
    return FuzzCase(family, args=(request,), expect=expect)


FAMILIES: tuple[tuple[Callable[[random.Random], FuzzCase], float], ...] = (
    (_wrong_field, 0.45),
    (_broken_messages, 0.2),
    (_junk_payload, 0.15),
    (_argument_shapes, 0.06),
    (_other_function, 0.07),
    (_pickled, 0.07),
)


def fuzz_cases(n: int, seed: int = 0) -> list[FuzzCase]:
    """`n` invalid jobs, every family represented once `n` >= len(FAMILIES)."""
    rng = random.Random(seed)
    makers = [maker for maker, _ in FAMILIES]
    weights = [weight for _, weight in FAMILIES]
    cases = [maker(rng) for maker in makers[: min(n, len(makers))]]
    cases += [rng.choices(makers, weights)[0](rng) for _ in range(n - len(cases))]
    return cases


def failure_problem(case: FuzzCase, handle: JobHandle) -> str | None:
    """What is wrong with how `case`'s job ended, or None when it failed alone as it should:
    status failed, code invalid_request, a one-line reason naming every word of `case.expect`."""
    try:
        handle.result(timeout=0.001)
    except JobFailedError as exc:
        if exc.code != ErrorCode.INVALID_REQUEST:
            return f"code {exc.code}, not invalid_request: {exc.reason}"
        if "\n" in exc.reason.strip():
            return f"a reason of several lines: {exc.reason!r}"
        missing = [word for word in case.expect if word not in exc.reason]
        return f"the reason does not name {missing}: {exc.reason}" if missing else None
    except ResultTimeoutError:
        return f"still {handle.status()}"
    return "it finished"
