"""Human byte sizes ("64MiB", "2GiB", "1.5GB", 4096) parsed at the edge of the API."""

from __future__ import annotations

import decimal
import re

MAX_BYTES = 2**63 - 1  # the largest size accepted anywhere (8 EiB): a signed 64-bit count

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """Return a byte count from an int or a string like ``"64MiB"``, ``"2 GiB"``, ``"1.5GB"``.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB, GiB, TiB) powers of
    1024. The number is read exactly (no float rounding) and a fractional byte is dropped.
    Raises ``ValueError`` for negative or unparsable sizes and sizes above ``MAX_BYTES``, and
    ``TypeError`` for other types.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"a size must be an int or a string like '64MiB', not {type(value).__name__}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return _bounded(value, value)
    match = _PATTERN.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot parse size {value!r}: use an int or a number with a unit "
            "(B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '64MiB'"
        )
    number = match.group(1)
    if len(number.partition(".")[0].lstrip("0")) > len(str(MAX_BYTES)):
        return _bounded(MAX_BYTES + 1, value)  # too many digits to be a size: refused unparsed
    with decimal.localcontext() as ctx:
        ctx.prec = len(number) + 16  # exact: digits of the number plus those of the largest unit
        return _bounded(int(decimal.Decimal(number) * _UNITS[unit]), value)


def _bounded(n: int, value: int | str) -> int:
    if n > MAX_BYTES:
        shown = repr(value) if len(str(value)) <= 40 else f"{str(value)[:32]!r}..."
        raise ValueError(
            f"size {shown} is too large: at most {MAX_BYTES} bytes (2**63-1, 8 EiB) are accepted"
        )
    return n


def format_bytes(n: int) -> str:
    """Render a byte count for people, in binary units: ``format_bytes(3 << 20) == '3.0 MiB'``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
