"""Byte counts as people read them in messages: a refusal for a 40 kB shard must not say "0.000 GB"."""

_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def size_text(n_bytes: float) -> str:
    """Decimal units (disks and `df -H` count in them), the largest unit the value reaches, three significant
    figures: 512 B, 41.2 kB, 3.07 GB, 118 TB."""
    n, unit = float(n_bytes), _UNITS[0]
    for unit in _UNITS:
        if abs(n) < 999.5 or unit == _UNITS[-1]:
            break
        n /= 1000
    if unit == "B":
        return f"{int(round(n))} B"
    return f"{n:,.{2 if abs(n) < 10 else 1 if abs(n) < 100 else 0}f} {unit}"
