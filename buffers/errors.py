"""Errors raised by the replay buffer and the version clock.

Every Lua script validates before it writes, so each of these means: nothing was changed by
the call that raised it. Scripts reply ``ASYNCRL_<CODE> message``; :func:`from_response`
maps the code to the class below.
"""

from __future__ import annotations

__all__ = [
    "BufferError",
    "SchemaMismatch",
    "MalformedData",
    "SettingsMismatch",
    "CursorMismatch",
    "DuplicateItem",
    "UnknownItem",
    "LeaseLost",
    "InvalidTransition",
    "VersionConflict",
    "VersionAhead",
    "BadRequest",
    "BadOffset",
    "PartialWrite",
    "NotPermitted",
    "from_response",
    "error_for",
]


class BufferError(RuntimeError):
    """Base class of every replay-buffer error."""


class SchemaMismatch(BufferError):
    """The keyspace was written by an incompatible asyncrl version, or holds foreign keys."""


class MalformedData(BufferError):
    """A stored record is missing fields or has arrays of the wrong byte length."""


class SettingsMismatch(BufferError):
    """The run was opened with different buffer settings (R, B, n, M, ...) than the stored ones."""


class CursorMismatch(BufferError):
    """``feed`` was called with a start cursor other than the stored dataset cursor."""


class DuplicateItem(BufferError):
    """A prompt group with this id already exists in the run."""


class UnknownItem(BufferError):
    """The sample, group or batch does not exist (committed, dropped, drained or never created)."""


class LeaseLost(BufferError):
    """The claim is no longer valid: its lease expired and was reclaimed, or a recovery revoked it."""


class InvalidTransition(BufferError):
    """The call is not allowed in the item's current state (e.g. scoring a running sample)."""


class VersionConflict(BufferError):
    """Compare-and-set of the version clock failed: not newer, or the expected version differs."""


class VersionAhead(BufferError):
    """A token's policy version is newer than the clock: the engine holds abandoned weights."""


class BadRequest(BufferError, ValueError):
    """The arguments are invalid (lengths, ranges, finish reason, ...); the message says what to fix."""


class BadOffset(BadRequest):
    """A chunk was appended at an offset other than the stored response length."""


class PartialWrite(BufferError):
    """One item of a multi-item script failed after it had begun writing (a Redis error mid-way):
    that item may be partly applied; its neighbours in the same call are unaffected."""


class NotPermitted(BufferError):
    """These Redis credentials may not do this (a role's ACL user, docs/security.md)."""


_CODES: dict[str, type[BufferError]] = {
    "SCHEMA": SchemaMismatch,
    "MALFORMED": MalformedData,
    "CURSOR": CursorMismatch,
    "DUPLICATE": DuplicateItem,
    "UNKNOWN": UnknownItem,
    "LEASE_LOST": LeaseLost,
    "INVALID": InvalidTransition,
    "VERSION_CONFLICT": VersionConflict,
    "VERSION_AHEAD": VersionAhead,
    "BAD_REQUEST": BadRequest,
    "BAD_OFFSET": BadOffset,
    "PARTIAL": PartialWrite,
}


def error_for(code: str, message: str) -> BufferError:
    """The :class:`BufferError` for a per-item error ``code`` of a multi-item script."""
    return _CODES.get(code, BufferError)(message)


def from_response(exc: Exception) -> Exception:
    """The :class:`BufferError` for a script's ``ASYNCRL_<CODE> message`` error reply.

    Other errors (a Lua runtime error on malformed data, e.g. a non-numeric field) become
    :class:`MalformedData`; anything not from a script is returned unchanged.
    """
    text = str(exc)
    if text.startswith("NOPERM") or "can't access at least one of the keys" in text or "has no permissions" in text:
        return NotPermitted(f"these Redis credentials are not allowed this operation (docs/security.md): {text}")
    if text.startswith("ASYNCRL_"):
        code, _, msg = text[len("ASYNCRL_"):].partition(" ")
        return _CODES.get(code, BufferError)(msg)
    if "user_script" in text or "Error running script" in text:
        return MalformedData(f"a buffer script failed on stored data: {text}")
    return exc
