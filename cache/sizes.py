"""Byte counts for people: ``"512 B"``, ``"1.5 GiB"``."""

from __future__ import annotations


def human_bytes(n: float | None) -> str:
    """Binary units with one decimal (whole bytes below 1 KiB), up to TiB; "-" for an unknown count."""
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024:
            return f"{x:.0f} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"
