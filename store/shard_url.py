"""The sharded store's URL: `shards:URL|URL|...`, one Redis URL per shard, and each shard's name.

Each element is any Redis URL the worker's `connect` takes (producer/wire/redis_url.py owns that rule:
redis://, rediss://, unix://, redis+sentinel://...). `|` separates them because it cannot appear
unencoded in a URL (a password holding one is written %7C), while `,` `;` `&` and `?` can.

A shard's *name* decides which agents it holds (rendezvous hashing, store/sharded.py), so it must
not change when a password, a timeout or a sentinel address does: it is the address without
credentials or options (`HOST:PORT/DB`, `unix:PATH?db=N`, `sentinel:MASTER/DB`), or the name given
with `?shard=NAME` (stripped before the URL is used), which keeps a shard's agents when it moves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from producer.wire.redact import redact_url

SHARDS_PREFIX = "shards:"
SEPARATOR = "|"
#: Redis URL forms a shard may take (the Sentinel ones need the worker's connect function).
SHARD_SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://", "rediss+sentinel://")
_NAME_OPTION = "shard"


@dataclass(frozen=True)
class Shard:
    """One shard of a `shards:` URL: the URL to connect to and the name it is routed by."""

    url: str
    name: str


def is_sharded_uri(uri: str) -> bool:
    return uri.startswith(SHARDS_PREFIX)


def redact(url: str) -> str:
    """A URL, or each URL of a `shards:` list, with its passwords masked, for messages."""
    if is_sharded_uri(url):
        parts = url.removeprefix(SHARDS_PREFIX).split(SEPARATOR)
        return SHARDS_PREFIX + SEPARATOR.join(redact_url(part) for part in parts)
    return redact_url(url)


def parse_shards(uri: str) -> list[Shard]:
    """The shards of a `shards:` URL, in the order given; ValueError (passwords masked) when malformed:
    no shard, a URL that is not a Redis one, or two shards with the same name."""
    shown = redact(uri)
    if not is_sharded_uri(uri):
        raise ValueError(f"not a sharded store URL: {shown!r} (want shards:URL|URL|...)")
    items = [item.strip() for item in uri.removeprefix(SHARDS_PREFIX).split(SEPARATOR)]
    if not any(items):
        raise ValueError(f"sharded store URL {shown!r} names no shard")
    shards = []
    for item in items:
        if not item.startswith(SHARD_SCHEMES):
            raise ValueError(
                f"sharded store URL {shown!r}: shard {redact(item)!r} is not a Redis URL "
                f"({', '.join(SHARD_SCHEMES)})"
            )
        shards.append(_shard(item))
    names = [shard.name for shard in shards]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"sharded store URL {shown!r} names shard {twice[0]!r} twice")
    return shards


def _shard(url: str) -> Shard:
    """The URL without `?shard=`, and the shard's name (that option, else its address)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    given = [value for key, value in query if key == _NAME_OPTION]
    rest = [(key, value) for key, value in query if key != _NAME_OPTION]
    clean = urlunsplit(parts._replace(query=urlencode(rest))) if given else url
    if given:
        if not given[-1]:
            raise ValueError(f"shard {redact(url)!r}: ?shard= needs a name")
        return Shard(clean, given[-1])
    return Shard(clean, _address(parts.scheme.lower(), parts.netloc, parts.path, dict(rest)))


def _address(scheme: str, netloc: str, path: str, query: dict[str, str]) -> str:
    host = netloc.rpartition("@")[2].lower()
    segments = [unquote(p) for p in path.split("/") if p]
    if scheme.endswith("+sentinel"):  # the sentinels only find the primary: the master is the shard
        master = segments[0] if segments else ""
        db = segments[1] if len(segments) > 1 else query.get("db", "0")
        return f"sentinel:{master}/{db}"
    if scheme == "unix":
        return f"unix:{unquote(path)}?db={query.get('db', '0')}"
    if not re.search(r":\d+$", host):
        host += ":6379"  # redis://h and redis://h:6379 are one server
    db = segments[0] if segments else query.get("db", "0")
    return f"{host}/{db}"
