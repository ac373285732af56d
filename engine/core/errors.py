"""Typed errors of the engine, so callers (the worker) can tell a bad request from a busy pool."""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong (empty prompt, bad sampling value...): retrying cannot help."""


class RequestTooLargeError(InvalidRequestError):
    """The request needs more blocks than the whole pool holds: it can never run on this engine."""


class PoolExhaustedError(EngineError):
    """The pool cannot hold the request now; it may fit once running sequences finish."""

    def __init__(self, requested: int, free: int, total: int) -> None:
        self.requested = requested
        self.free = free
        self.total = total
        super().__init__(f"block pool exhausted: requested {requested} blocks, {free} of {total} free")


class UnsupportedModelError(EngineError):
    """The model uses a cache type the block pool cannot represent."""


class CacheMismatchError(InvalidRequestError):
    """A saved cache belongs to another model or spec, or its tokens and blocks disagree."""
