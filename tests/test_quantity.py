"""Kubernetes quantities (detector/core/quantity.py), checked against the official Python client's
parse_quantity as an oracle. The oracle is looser than apimachinery's grammar (it takes whatever Python's
Decimal takes before the suffix: "NaN", " 8", "1_000", "1e3Ki"), so it judges only strings of the grammar;
what the API server would refuse is listed on its own."""

from __future__ import annotations

import ast
import itertools
import random
from decimal import Decimal
from pathlib import Path

import pytest

from detector.core.quantity import parse_quantity, whole_count

oracle = pytest.importorskip("kubernetes.utils.quantity").parse_quantity

SUFFIXES = ["", "n", "u", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei",
            "e0", "e3", "E3", "e+2", "e-2", "E-9", "e12", "e-12"]
NUMBERS = ["0", "1", "8", "08", "10", "123", "999999", "1.5", "0.25", "8.0", "8.", ".5", "3.14159", "1000000000000"]


def test_every_form_of_the_grammar_matches_the_oracle():
    for sign, number, suffix in itertools.product(["", "+", "-"], NUMBERS, SUFFIXES):
        text = f"{sign}{number}{suffix}"
        assert parse_quantity(text) == oracle(text), text


def agrees(text: str) -> bool:
    """The oracle multiplies in Decimal's default context (28 digits), so a longer product is rounded
    there; ours is exact, and equal once rounded the same way (unary plus rounds to the context)."""
    return +parse_quantity(text) == oracle(text)


def test_random_quantities_match_the_oracle():
    rng = random.Random(30)
    for _ in range(3000):
        whole = "".join(rng.choice("0123456789") for _ in range(rng.randint(0, 9)))
        frac = "".join(rng.choice("0123456789") for _ in range(rng.randint(0, 5)))
        number = whole + ("." + frac if rng.random() < 0.4 else "")
        if not any(c.isdigit() for c in number):
            number += "7"
        suffix = rng.choice(SUFFIXES[:16] + [f"e{rng.randint(-20, 20)}", f"E+{rng.randint(0, 20)}"])
        text = rng.choice(["", "+", "-"]) + number + suffix
        assert agrees(text), text


@pytest.mark.parametrize("text, value", [
    ("8", 8), ("8k", 8000), ("1e3", 1000), ("1E3", 1000), ("500m", Decimal("0.5")), ("8000m", 8),
    ("1Ki", 1024), ("16Gi", 16 * 2**30), ("1E", 10**18), ("1Ei", 2**60), ("-2", -2), ("+.5", Decimal("0.5")),
    ("12345678901234567890123456789012345", 12345678901234567890123456789012345),   # exact, past 28 digits
])
def test_values(text, value):
    assert parse_quantity(text) == value


# Refused by apimachinery's ParseQuantity; the Python client's parse_quantity takes some of them.
@pytest.mark.parametrize("text", [
    "", " ", "junk", "k", "Ki", ".", "+", "-", "1e", "1e+", "1ki", "1mi", "1Ki3", "1K", "1e3k", "1e3Ki", "1.5.2",
    " 8", "8 ", "8\n", "NaN", "Infinity", "-inf", "1_000", "0x10", "\u0668", "\uff18", "1e1.5", "8 k",
    "9" * 65, "1e1001", "1e-1001",
])
def test_junk_is_a_clear_value_error(text):
    with pytest.raises(ValueError) as error:
        parse_quantity(text)
    message = str(error.value)
    assert "\n" not in message and ("not a quantity" in message or "out of range" in message), message


@pytest.mark.parametrize("text, count", [("8", 8), ("8k", 8000), ("1e3", 1000), ("8000m", 8), ("8.0", 8),
                                          ("0", 0), ("+8", 8), ("0.008k", 8)])
def test_whole_counts(text, count):
    assert whole_count(text, "nvidia.com/gpu") == count


@pytest.mark.parametrize("text, words", [
    ("500m", "'500m' is 0.5, not a whole number"), ("7.5", "is 7.5, not a whole number"),
    ("-1", "negative"), ("1e19", "out of range"), ("eight", "not a quantity"), ("1e5000", "out of range"),
])
def test_not_a_count_says_why(text, words):
    with pytest.raises(ValueError) as error:
        whole_count(text, "nvidia.com/gpu allocatable")
    assert words in str(error.value) and "nvidia.com/gpu allocatable" in str(error.value)


def test_detector_never_imports_the_kubernetes_client():
    """The client's models cost the daemon tens of MiB; the quantity grammar is all it needs of it."""
    root = Path(__file__).resolve().parent.parent / "detector"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "kubernetes" or n.startswith("kubernetes.") for n in names), path
