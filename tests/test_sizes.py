import pytest

from featcache.sizes import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [("64MiB", 64 << 20), ("2 GiB", 2 << 30), ("1.5GB", 1_500_000_000), ("10kb", 10_000),
     ("512", 512), ("0", 0), (4096, 4096), ("1TiB", 1 << 40), (".5KiB", 512)],
)
def test_parse(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "MiB", "-1", "1 parsec", "1.2.3GB"])
def test_bad_strings(bad):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(bad)


def test_bad_types_and_negatives():
    with pytest.raises(TypeError):
        parse_bytes(1.5)
    with pytest.raises(TypeError):
        parse_bytes(True)
    with pytest.raises(ValueError):
        parse_bytes(-5)


def test_format():
    assert format_bytes(3 << 20) == "3.0 MiB"
    assert format_bytes(100) == "100 B"
