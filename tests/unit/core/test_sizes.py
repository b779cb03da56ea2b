"""remat.core.sizes: memory sizes read from what users write, and written for messages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import remat
from remat.core.sizes import format_bytes, parse_bytes

GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize(
    "text, expected",
    [
        ("60GiB", 60 * GiB),
        ("60 GB", 60 * 10**9),
        ("512MiB", 512 * MiB),
        ("1.5", int(1.5 * GiB)),
        (1234, 1234),
        ("2tib", 2 * 2**40),
    ],
)
def test_parse_bytes(text, expected) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text, expected", [("2147483648", 2 * GiB), ("2GiB", 2 * GiB), ("512 MiB", 512 * MiB)])
def test_parse_bytes_reads_a_bare_number_as_bytes_for_allocator_sizes(text, expected) -> None:
    assert parse_bytes(text, "request", "b") == expected


def test_parse_bytes_refuses_a_fraction_of_a_byte() -> None:
    with pytest.raises(
        remat.ConfigError,
        match=r"request: '1.5' is not a whole number of bytes \(a bare number is "
        r"bytes\); give a unit, like 1.5GiB",
    ):
        parse_bytes("1.5", "request", "b")


@pytest.mark.parametrize("text", ["", "GiB", "60XB", "-3GiB", "1e3GB"])
def test_parse_bytes_rejects_with_an_example(text) -> None:
    with pytest.raises(remat.ConfigError, match="like 60GiB"):
        parse_bytes(text)


@pytest.mark.parametrize(
    "size, message",
    [
        ("0", "is no memory"),
        ("0GiB", "is no memory"),
        (0, "is 0 bytes"),
        (-5, "is -5 bytes"),
        (1.5e9, "is a float; give bytes as an int or text with a unit"),
    ],
)
def test_parse_bytes_rejects_sizes_that_are_no_memory_or_ambiguous(size, message) -> None:
    with pytest.raises(remat.ConfigError, match=message):
        parse_bytes(size)


def test_parse_bytes_takes_zero_only_where_asked() -> None:
    assert parse_bytes("0", "cublas_workspace", "b", zero=True) == parse_bytes(0, zero=True) == 0
    assert parse_bytes("0MiB", zero=True) == 0
    for size, message in (("-1", "cannot read '-1'"), (-1, "is -1 bytes")):
        with pytest.raises(remat.ConfigError, match=message):
            parse_bytes(size, zero=True)


@pytest.mark.parametrize(
    "n, text", [(60 * GiB, "60.00 GiB"), (GiB // 10 + 1, "0.10 GiB"), (GiB // 10, "102.40 MiB"), (0, "0.00 MiB")]
)
def test_format_bytes_uses_gib_down_to_a_tenth_then_mib(n, text) -> None:
    assert format_bytes(n) == text


@given(st.integers(min_value=1, max_value=2**50))
def test_a_size_written_in_bytes_reads_back_exactly(n: int) -> None:
    assert parse_bytes(f"{n}B") == parse_bytes(str(n), bare="b") == parse_bytes(n) == n
