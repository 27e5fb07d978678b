"""Times as the API server writes them (RFC 3339 in UTC, to the second) and back."""

from __future__ import annotations

from datetime import datetime, timezone


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str | None) -> float | None:
    """Seconds since the epoch; None for a missing or unreadable time (a field nobody set is not a time)."""
    if not text:
        return None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).timestamp()
