"""The controller layer's error: raised by ``asyncrl train`` and the modules it runs on."""

from __future__ import annotations

__all__ = ["ControllerError"]


class ControllerError(RuntimeError):
    """The run cannot start or continue (the message says what to fix)."""
