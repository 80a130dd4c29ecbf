"""Secrets of a run: reading them, hiding them, and files that hold them (docs/security.md).

The secrets are ``security.api_key``, ``security.redis_password`` and ``buffer.redis_url``
(when it carries a password), held as pydantic ``SecretStr`` so that ``repr``, ``str``,
``model_dump`` and log lines show ``**********``. Code that must use a value calls
:func:`reveal` at the last moment. Roles receive secrets through their environment
(``ASYNCRL_*`` variables, readable only by the same user in ``/proc/<pid>/environ``), never
on their command line, and files that hold them are created ``0600`` (directories ``0700``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "API_KEY_ENV",
    "ENGINE_API_KEY_ENV",
    "REDIS_URL_ENV",
    "private_dir",
    "redact_url",
    "reveal",
    "url_without_password",
    "write_private",
]

#: Environment variable carrying the rollout servers' API key to every role.
API_KEY_ENV = "ASYNCRL_SECURITY__API_KEY"
#: Environment variable carrying the API key an embedded engine server must require (set only
#: when ``rollout.api_key_required``; ``rollout_server.server`` reads it instead of ``--api-key``).
ENGINE_API_KEY_ENV = "ASYNCRL_ENGINE_API_KEY"
#: Environment variable carrying a role's Redis URL (with that role's user and password).
REDIS_URL_ENV = "ASYNCRL_BUFFER__REDIS_URL"


def reveal(value: Any) -> str | None:
    """The plain text of a ``SecretStr`` (or a ``str``); None and ``""`` give None."""
    if value is None:
        return None
    text = value.get_secret_value() if hasattr(value, "get_secret_value") else str(value)
    return text or None


def _netloc(host: str | None, port: int | None, user: str | None, password: str | None) -> str:
    where = (host or "") + (f":{port}" if port else "")
    if user and password is not None:
        return f"{user}:{password}@{where}"
    if password is not None:
        return f":{password}@{where}"
    if user:
        return f"{user}@{where}"
    return where


def redact_url(url: Any) -> str:
    """``redis://user:***@host:port/db``: a URL safe to print (the password replaced by ``***``).

    Accepts a ``str`` or ``SecretStr``; a URL that cannot be parsed is replaced by ``<redacted URL>``.
    """
    text = reveal(url) or ""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        return "<redacted URL>"
    if parts.password is None:
        return text
    return urlunsplit(parts._replace(netloc=_netloc(parts.hostname, port, parts.username, "***")))


def url_without_password(url: Any) -> str | None:
    """The URL with its password removed (user, host, port and db kept); None for None."""
    text = reveal(url)
    if text is None:
        return None
    parts = urlsplit(text)
    if parts.password is None:
        return text
    return urlunsplit(parts._replace(netloc=_netloc(parts.hostname, parts.port, parts.username, None)))


def private_dir(path: Path | str) -> Path:
    """Create ``path`` (and parents) if missing and make it ``0700``; returns it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_private(path: Path | str, text: str) -> Path:
    """Write ``text`` to ``path`` atomically, mode ``0600`` from the first byte; returns the path.

    Raises:
        OSError: the directory is not writable.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing tmp file keeps its mode otherwise
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path
