"""The number parsers the CLI and the pytest plugin share word a bad value the same way."""

from __future__ import annotations

import argparse

import pytest

from meshsim import options


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (options.integer("--jobs", minimum=1), "x", "--jobs takes an integer, got 'x'"),
        (options.integer("--jobs", minimum=1), "00", "--jobs must be >= 1, got 0"),
        (
            options.integer("--jobs", minimum=1, echo_text=True),
            "00",
            "--jobs must be >= 1, got 00",
        ),
        (options.integer("--communicate", minimum=0), "-1", "--communicate must be >= 0, got -1"),
        (options.seconds("--timeout"), "soon", "--timeout takes seconds, got 'soon'"),
        (options.seconds("--timeout"), "0.0", "--timeout must be > 0, got 0.0"),
    ],
)
def test_a_bad_value_names_the_flag_and_what_was_given(parse, text, message):
    with pytest.raises(ValueError) as info:
        parse(text)
    assert str(info.value) == message


def test_values_in_range_come_back_parsed():
    assert options.integer("--tp")("-3") == -3  # no bound: config flags check their own
    assert options.integer("--jobs", minimum=1)("8") == 8
    assert options.seconds("--timeout")("0.5") == 0.5


@pytest.mark.parametrize("error", [argparse.ArgumentTypeError, pytest.UsageError])
def test_the_caller_chooses_the_error_its_parser_reports(error):
    with pytest.raises(error, match="--world-size must be >= 1, got 0"):
        options.integer("--world-size", minimum=1, error=error)("0")
