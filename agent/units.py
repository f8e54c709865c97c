"""Parsing of human-written sizes ("200GiB", "1.5 GB", "90%") and durations ("5m", "1h30m")."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

MAX_BYTES = 1 << 60  # anything larger is a typo, not a disk


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string like "200GiB"; raises ValueError with the reason."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a string like '200GiB'")
    if isinstance(value, (int, float)):
        n = float(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise ValueError(f"{value!r} is not a size (try '200GiB', '512MB' or a byte count)")
        unit = m.group(2).lower()
        if unit not in _SIZE_UNITS:
            raise ValueError(f"{value!r}: unknown size unit {m.group(2)!r}")
        n = float(m.group(1)) * _SIZE_UNITS[unit]
    else:
        raise ValueError(f"{value!r} is not a size")
    if n < 0 or n != n:
        raise ValueError(f"{value!r}: a size cannot be negative")
    if n > MAX_BYTES:
        raise ValueError(f"{value!r}: larger than {MAX_BYTES} bytes")
    return int(n)


def parse_fraction_or_size(value: int | float | str) -> float | int:
    """"90%" or a float in (0, 1] → a fraction of the device (float); anything else → bytes (int)."""
    if isinstance(value, float) and 0 < value <= 1:
        return value
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            pct = float(value.strip()[:-1])
        except ValueError:
            raise ValueError(f"{value!r} is not a percentage") from None
        if not 0 < pct <= 100:
            raise ValueError(f"{value!r}: a percentage must be in (0, 100]")
        return pct / 100.0
    return parse_size(value)


def parse_duration(value: int | float | str) -> float:
    """Seconds from a number or a string like "5m", "1h30m", "250ms"; "-1" means forever."""
    if isinstance(value, bool):
        raise ValueError("a duration must be seconds or a string like '5m'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION_RE.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise ValueError(f"{value!r} is not a duration (try '30s', '5m', '1h')") from None
            seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    else:
        raise ValueError(f"{value!r} is not a duration")
    if seconds != seconds or (seconds < 0 and seconds != -1):
        raise ValueError(f"{value!r}: a duration must be >= 0 (or -1 for forever)")
    if seconds > 10 * 365 * 86400:
        raise ValueError(f"{value!r}: longer than ten years")
    return seconds
