"""Counts said with their nouns, the one place that knows a count of 1 takes the singular:
`counted(1, "point")` is "1 point", `counted(3, "point")` "3 points", `counted(2, "entry", "entries")`
"2 entries"; `noun` alone where the count is said elsewhere (`of the 1 failed point`)."""

from __future__ import annotations


def noun(n: int, singular: str, plural: str | None = None) -> str:
    """`singular` for a count of 1 (or -1), else `plural` (default: `singular` + "s")."""
    return singular if abs(n) == 1 else plural or f"{singular}s"


def counted(n: int, singular: str, plural: str | None = None) -> str:
    """`n` and its noun: "1 point", "0 points", "12 points"."""
    return f"{n} {noun(n, singular, plural)}"
