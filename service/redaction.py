"""Secrets out of the log: the one place that redacts them, whatever logged them.

SECURITY.md promises that only a hash of each API token is kept; a log line is kept too, so no log line
may carry a token, a cookie or a database password. Every record, from structlog or from the standard
library (uvicorn's loggers included), passes through ``redact_secrets`` after its exception, if any, has
been rendered to text and before the line is written (``service/logs.py``), so a secret is caught in a
field, in a message, in a header pair of an ASGI scope or in a traceback's text alike.

Two rules, because a secret arrives either under a name or inside text:

- **by name**: the value of a field or header pair named like a secret (``authorization``, ``cookie``,
  ``password``, ...; see ``SECRET_NAMES``) is replaced whole.
- **by shape**: in any text, a ``Bearer``/``Basic`` credential, an API token (``llt_...``), the password
  of a URL (``postgresql://user:PASSWORD@host``) or of a key/value DSN (``password=...``), and a
  ``Cookie:`` header's value are replaced.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from structlog.typing import EventDict, WrappedLogger

REDACTED: Final = "[REDACTED]"

# Field and header names whose value is a secret, compared lower-cased with ``-`` read as ``_``. Not
# ``fencing_token``: that is a lease's number, which investigators need.
SECRET_NAMES: Final = frozenset(
    {
        "authorization",
        "proxy_authorization",
        "cookie",
        "set_cookie",
        "password",
        "passwd",
        "secret",
        "token",
        "api_token",
        "access_token",
        "refresh_token",
        "x_api_key",
    }
)

_SHAPES: Final = (
    (re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]+"), rf"\1\2{REDACTED}"),
    (re.compile(r"\bllt_[A-Za-z0-9_-]+"), f"llt_{REDACTED}"),
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s/:@'\"]*:)[^\s@/'\"]+@"), rf"\1{REDACTED}@"),
    (re.compile(r"(?i)\b(password\s*=\s*)('[^']*'|\"[^\"]*\"|[^\s,;'\"]+)"), rf"\1{REDACTED}"),
    (re.compile(r"(?i)\b((?:set-)?cookie:\s*)[^\r\n'\"]+"), rf"\1{REDACTED}"),
)


def _is_secret_name(name: object) -> bool:
    if isinstance(name, bytes):
        name = name.decode("latin-1")
    return isinstance(name, str) and name.lower().replace("-", "_") in SECRET_NAMES


def redact_text(text: str) -> str:
    """``text`` with every secret of a known shape replaced."""
    for pattern, replacement in _SHAPES:
        text = pattern.sub(replacement, text)
    return text


def redact(value: Any) -> Any:
    """``value`` with its secrets replaced: in text, and in mappings, lists and tuples at any depth
    (a two-item tuple or list whose first item names a secret is a header pair: its value goes). Any
    other object becomes its ``repr``, redacted: a renderer would write that repr as it is."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, bytes | bytearray):
        text = bytes(value).decode("latin-1")
        redacted = redact_text(text)
        return value if redacted == text else redacted
    if isinstance(value, Mapping):
        return {k: REDACTED if _is_secret_name(k) else redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [value[0], REDACTED] if len(value) == 2 and _is_secret_name(value[0]) else map(redact, value)
        return tuple(items) if isinstance(value, tuple) else list(items)
    if value is None or isinstance(value, bool | int | float):
        return value
    return redact_text(repr(value))  # what a renderer would write for it, secrets out


def redact_secrets(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """structlog processor: the event with every secret replaced (see the module's docstring)."""
    redacted: EventDict = redact(event_dict)
    return redacted
