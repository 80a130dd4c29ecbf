"""The Redis replay buffer: partial samples, token-budget regeneration, staleness, crash safety.

``from buffers import ReplayBuffer, BufferSettings`` — see docs/buffer.md for the API contract.
"""

from buffers.buffer import FINISH_REASONS, STALE_POLICIES, BufferSettings, ReplayBuffer
from buffers.errors import (
    BadOffset,
    BadRequest,
    BufferError,
    CursorMismatch,
    DuplicateItem,
    InvalidTransition,
    LeaseLost,
    MalformedData,
    NotPermitted,
    PartialWrite,
    SchemaMismatch,
    SettingsMismatch,
    UnknownItem,
    VersionAhead,
    VersionConflict,
)

__all__ = [
    "ReplayBuffer", "BufferSettings", "FINISH_REASONS", "STALE_POLICIES", "BufferError", "BadOffset",
    "BadRequest", "CursorMismatch", "DuplicateItem", "InvalidTransition", "LeaseLost", "MalformedData",
    "NotPermitted", "PartialWrite",
    "SchemaMismatch", "SettingsMismatch", "UnknownItem", "VersionAhead", "VersionConflict",
]
