"""Redis URLs as they may be shown: in logs, status output, error messages and job meta.

A Redis URL can carry a password twice: in its userinfo (`redis://user:PASSWORD@host`) and in
query arguments redis-py passes on (`?password=...`, `?ssl_password=...` for an encrypted key).
Everything that prints a URL goes through `redact_url`, so no secret reaches a terminal or a log.
"""

from __future__ import annotations

import re

MASK = "***"
_SECRET_QUERY_ARGUMENT = re.compile(r"(^|[?&;])([^=&;#]*password[^=&;#]*)=[^&;#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """`url` with every password replaced by ***; the scheme, user name, host, port, db and paths stay.

    Masks too much rather than too little: an unencoded `@` further on (a password with `/` in it)
    hides everything up to it. Strings that are not URLs (`disk:PATH`, `redis`) come back unchanged.
    """
    scheme, separator, rest = url.partition("://")
    if not separator:
        return url
    userinfo, at, after = rest.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        shown_user = user if colon and not re.search(r"[/?#]", user) else ""
        rest = f"{shown_user}:{MASK}@{after}" if shown_user else f"{MASK}@{after}"
    address, question, query = rest.partition("?")
    if question:
        query = _SECRET_QUERY_ARGUMENT.sub(lambda m: f"{m.group(1)}{m.group(2)}={MASK}", query)
    return f"{scheme}{separator}{address}{question}{query}"
