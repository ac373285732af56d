"""redact_url hides every password a Redis URL can carry and keeps what an operator needs to see."""

from __future__ import annotations

import pytest
from redis.connection import parse_url

from producer.wire.redact import redact_url

SECRET = "s3cr3t-Pa55"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"redis://:{SECRET}@127.0.0.1:6379/0", "redis://***@127.0.0.1:6379/0"),
        (f"redis://alice:{SECRET}@10.0.0.5:6380/2", "redis://alice:***@10.0.0.5:6380/2"),
        (
            f"rediss://alice:{SECRET}@127.0.0.1:6390/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem",
            "rediss://alice:***@127.0.0.1:6390/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem",
        ),
        (
            f"rediss://127.0.0.1:6390/0?ssl_keyfile=/k.pem&ssl_password={SECRET}&password={SECRET}&db=1",
            "rediss://127.0.0.1:6390/0?ssl_keyfile=/k.pem&ssl_password=***&password=***&db=1",
        ),
        (f"unix://:{SECRET}@/run/redis.sock?db=3", "unix://***@/run/redis.sock?db=3"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("disk:.kvrq/cache", "disk:.kvrq/cache"),
        ("redis", "redis"),
    ],
)
def test_redact_url_hides_passwords_and_keeps_the_rest(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "password",
    ["p@ss", "with:colon", "sl/ash", "q?mark", "percent%40encoded", "hash#tag", "Pass&word=1"],
)
def test_redact_url_never_shows_an_awkward_password(password: str) -> None:
    """Passwords with URL delimiters in them, written unencoded as people do, still never show."""
    assert redact_url(f"redis://bob:{password}@db.internal:6379/0") == "redis://bob:***@db.internal:6379/0"


def test_redact_url_masks_what_redis_py_reads_as_the_password() -> None:
    """Whatever redis-py would send as AUTH password is gone from the shown URL."""
    for url in (
        f"redis://u:{SECRET}@h:1/0",
        f"redis://h:1/0?password={SECRET}",
        f"rediss://h:1/0?ssl_password={SECRET}",
        f"redis://u:{SECRET.replace('5', '%35')}@h:1/0",
    ):
        options = parse_url(url)
        secrets = {value for key, value in options.items() if "password" in key}
        assert secrets, url
        for secret in secrets:
            assert secret not in redact_url(url)
