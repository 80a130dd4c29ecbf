"""The environment server's HTTP schemas: one pydantic model per endpoint, every size bounded.

| endpoint | request | answer |
|---|---|---|
| ``POST /tools/calculate`` | :func:`calculate_request_model` (``expression``, ``call_id``, ``deadline_ms``, ``replay``) | :class:`ToolResponse` |
| ``GET /health`` | — | :class:`HealthResponse` |
| any error (400, 401, 404, 413, 503) | — | :class:`ErrorResponse` |

Requests are strict (a number is not a string) and reject unknown keys; strings have a maximum
length, numbers bounds. The same models validate the answers on the client's side, so a
malformed answer is detected there, not trusted.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

__all__ = ["calculate_request_model", "ToolResponse", "HealthResponse", "ErrorResponse", "ErrorBody",
           "MAX_CALL_ID_CHARS", "MAX_RESULT_CHARS", "MAX_DEADLINE_MS", "CALL_ID_PATTERN", "TOOL_OUTCOMES"]

#: Longest call id (``<sample id>:<trajectory>:<call index>`` fits easily).
MAX_CALL_ID_CHARS = 256
#: A call id: printable ASCII without spaces or quotes (it is logged and hashed, never a label).
CALL_ID_PATTERN = r"^[A-Za-z0-9_.:/~\-]+$"
#: Longest result or error text in an answer.
MAX_RESULT_CHARS = 4096
#: Longest deadline a request may ask for (one hour); the server's own deadline still caps it.
MAX_DEADLINE_MS = 3_600_000
#: How a call ended: a result, the tool refused its input, or the deadline passed.
TOOL_OUTCOMES = ("ok", "tool_error", "deadline")

_STRICT = ConfigDict(extra="forbid", strict=True)


def calculate_request_model(max_expression_chars: int) -> type[BaseModel]:
    """The schema of a ``POST /tools/calculate`` body.

    Fields: ``expression`` (1..``max_expression_chars`` characters), ``call_id`` (1..256
    characters of :data:`CALL_ID_PATTERN`; seeds the call's latency), ``deadline_ms``
    (1..3,600,000; the server caps it at ``agent.env_server.deadline_seconds``) and ``replay``
    (the worker is replaying a recorded episode; counted, it changes nothing else).

    Raises:
        ValueError: ``max_expression_chars < 1``.
    """
    if max_expression_chars < 1:
        raise ValueError(f"max_expression_chars must be >= 1, got {max_expression_chars}")
    return create_model(
        "CalculateRequest",
        __config__=_STRICT,
        expression=(str, Field(min_length=1, max_length=max_expression_chars)),
        call_id=(str, Field(min_length=1, max_length=MAX_CALL_ID_CHARS, pattern=CALL_ID_PATTERN)),
        deadline_ms=(int, Field(ge=1, le=MAX_DEADLINE_MS)),
        replay=(bool, False),
    )


class ToolResponse(BaseModel):
    """The answer to a tool call (HTTP 200).

    Attributes:
        outcome: ``ok`` (``result`` holds the tool's result as text), ``tool_error`` (``error``
            holds why the tool refused the input, e.g. ``ValueError: division by zero``) or
            ``deadline`` (the call ran past its deadline; ``error`` says which).
        result, error: at most 4096 characters each.
        call_id: the request's.
        latency_seconds: the drawn latency of the call (>= 0; the call may have been cut
            shorter by its deadline).
        elapsed_seconds: the call's time on the server, queueing included.
    """

    model_config = ConfigDict(extra="forbid")

    outcome: Literal["ok", "tool_error", "deadline"]
    result: str | None = Field(None, max_length=MAX_RESULT_CHARS)
    error: str | None = Field(None, max_length=MAX_RESULT_CHARS)
    call_id: str = Field(max_length=MAX_CALL_ID_CHARS)
    latency_seconds: float = Field(ge=0.0)
    elapsed_seconds: float = Field(ge=0.0)


class HealthResponse(BaseModel):
    """``GET /health``: ``status`` ``ok`` (200), ``draining`` or ``starting`` (503); the tools served,
    the calls running now and the latency distribution in words."""

    model_config = ConfigDict(extra="forbid")

    status: Literal["ok", "draining", "starting"]
    tools: list[str] = Field(max_length=64)
    in_flight: int = Field(ge=0)
    latency: str = Field(max_length=512)


class ErrorBody(BaseModel):
    """What went wrong, in words that say what to fix."""

    model_config = ConfigDict(extra="forbid")

    message: str = Field(max_length=MAX_RESULT_CHARS)


class ErrorResponse(BaseModel):
    """Every non-200 answer: ``{"error": {"message": ...}}``."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorBody
