"""`when:` expressions: what they match, what they refuse to compile, and that values stay data."""

from __future__ import annotations

import pytest

from detector.rules.expr import ExpressionError, Predicate, compile_predicate

PCIE = {"current_width": 8, "max_width": 16, "current_gen": 4, "max_gen": 4, "idle": False,
        "nvml_error": "", "driver": "nvidia", "temp": 71.5, "in_smi": None}


@pytest.mark.parametrize("text, expected", [
    ("current_width < max_width", True),
    ("current_width >= max_width", False),
    ("current_gen == max_gen", True),
    ("current_gen != max_gen", False),
    ("current_width <= 8", True),
    ("current_width > 8", False),
    ("temp >= 71.5", True),
    # chained comparisons mean what they mean in Python: both halves must hold
    ("1 < current_width <= 8", True),
    ("1 < current_width <= 7", False),
    ("8 <= current_width < max_width", True),
    ("current_width < max_width < 16", False),
])
def test_comparisons_including_chained(text: str, expected: bool) -> None:
    assert compile_predicate(text)(PCIE) is expected


@pytest.mark.parametrize("text, expected", [
    ("current_width < max_width and not idle", True),
    ("current_width < max_width and idle", False),
    ("idle or current_gen == max_gen", True),
    ("idle or current_gen < max_gen", False),
    ("not (idle or current_width == max_width)", True),
    ("current_width < max_width and (idle or driver == 'nvidia')", True),
])
def test_and_or_not(text: str, expected: bool) -> None:
    assert compile_predicate(text)(PCIE) is expected


@pytest.mark.parametrize("text, expected", [
    ("driver in ['nvidia', 'nouveau']", True),
    ("driver in ('nouveau', 'vfio-pci')", False),
    ("driver not in ['nouveau', 'vfio-pci']", True),
    ("current_width in [1, 2, 4, 8]", True),
    ("current_width not in [current_width, 16]", False),   # list items may be fields too
    ("driver in {'nvidia'}", True),
])
def test_in_and_not_in_lists(text: str, expected: bool) -> None:
    assert compile_predicate(text)(PCIE) is expected


@pytest.mark.parametrize("text, expected", [
    ("current_width * 2 == max_width", True),
    ("max_width - current_width == 8", True),
    ("current_width + 8 == max_width", True),
    ("current_width / max_width == 0.5", True),
    ("max_width % 3 == 1", True),
    ("-current_width < 0", True),
    ("current_width / (max_width - 16) > 0", False),       # division by zero does not match
])
def test_arithmetic(text: str, expected: bool) -> None:
    assert compile_predicate(text)(PCIE) is expected


def test_string_equality_is_exact() -> None:
    assert compile_predicate('driver == "nvidia"')(PCIE) is True
    assert compile_predicate("driver == 'NVIDIA'")(PCIE) is False
    assert compile_predicate('nvml_error == ""')(PCIE) is True
    assert compile_predicate('nvml_error != "GpuIsLost"')(PCIE) is True


def test_true_false_null_are_constants_not_fields() -> None:
    assert compile_predicate("idle == false")(PCIE) is True
    assert compile_predicate("idle == true")(PCIE) is False
    assert compile_predicate("in_smi == null")(PCIE) is True
    assert compile_predicate("in_smi != null")(PCIE) is False
    # an unknown (null) boolean is neither true nor false, so `== false` does not fire on it
    assert compile_predicate("in_smi == false")(PCIE) is False
    # they are constants, so they work with no fields at all
    assert compile_predicate("true")({}) is True
    assert compile_predicate("false")({}) is False
    assert compile_predicate("null == null")({}) is True


@pytest.mark.parametrize("text", [
    "missing_field > 1",
    "missing_field == 0",
    "not missing_field",
    "missing_field != 'x'",
    "current_width < max_width and missing_field",
])
def test_missing_field_never_matches(text: str) -> None:
    assert compile_predicate(text)(PCIE) is False


@pytest.mark.parametrize("text, fields", [
    ('"a" < 3', {}),
    ("driver < 3", PCIE),
    ("in_smi < 3", PCIE),                  # null compared with a number
    ("not (in_smi > 3)", PCIE),            # a type error inside `not` does not flip to a match
    ("driver + 1 == 2", PCIE),
    ("current_width in 8", PCIE),
])
def test_type_mismatch_never_matches(text: str, fields: dict) -> None:
    p = compile_predicate(text)
    assert p(fields) is False


def test_result_is_always_a_bool() -> None:
    p = compile_predicate("current_width or driver")
    assert p(PCIE) is True
    assert compile_predicate("nvml_error")(PCIE) is False


def test_predicate_keeps_its_source() -> None:
    p = compile_predicate("  current_width < max_width  ")
    assert isinstance(p, Predicate)
    assert "current_width < max_width" in p.source


# (At commit 5503a2c, frozenset(names) was taken before _compile() filled it, so .names was empty.)
@pytest.mark.parametrize("text, names", [
    ("current_width < max_width and not idle", {"current_width", "max_width", "idle"}),
    ("1 < x <= 3", {"x"}),
    ("d in [a, 'lit', 2] or e * 2 > f", {"a", "d", "e", "f"}),
    ("in_smi == false and x != null and y == true", {"in_smi", "x", "y"}),
])
def test_names_are_collected(text: str, names: set[str]) -> None:
    assert compile_predicate(text).names == frozenset(names)


def test_names_exclude_constants_and_literals() -> None:
    # true/false/null (any case) and string literals are never field names
    names = compile_predicate("true == FALSE or null == 'current_width' or None == x").names
    assert names == frozenset({"x"})


@pytest.mark.parametrize("text", [
    "__import__('os')",
    "x.y",
    "x[0]",
    "lambda: 1",
    "[i for i in x]",
    "(x := 1)",
    'f"{x}"',
    "open('f')",
    "x if y else z",
    "2 ** 10",
    "{'a': 1}",
    "~x",
])
def test_disallowed_syntax_is_rejected_with_a_helpful_message(text: str) -> None:
    with pytest.raises(ExpressionError) as e:
        compile_predicate(text)
    message = str(e.value)
    assert "not allowed" in message
    # it says what IS allowed, so the author can fix the rule
    assert "comparisons" in message and "and/or/not" in message


def test_disallowed_part_is_named_in_the_message() -> None:
    with pytest.raises(ExpressionError, match=r"'open\('/etc/passwd'\)' is not allowed"):
        compile_predicate("current_width < 8 and open('/etc/passwd')")
    with pytest.raises(ExpressionError, match=r"'x\.__class__' is not allowed"):
        compile_predicate("x.__class__ == 1")


@pytest.mark.parametrize("text", ["x is None", "x is not null", "1 < x is 2"])
def test_is_is_rejected_and_points_to_equality(text: str) -> None:
    with pytest.raises(ExpressionError, match=r"'is' and 'is not' are not allowed at column 1 in '.*': use == and !="):
        compile_predicate(text)


def test_syntax_error_reports_the_column() -> None:
    with pytest.raises(ExpressionError) as e:
        compile_predicate("x ==== 1")
    assert str(e.value) == "not a valid expression: invalid syntax at column 5 in 'x ==== 1'"
    assert (e.value.problem, e.value.column, e.value.source) == ("not a valid expression: invalid syntax", 5,
                                                                 "x ==== 1")
    # Python says offset 0 when the text ends too early: the column is just past the end, and says so.
    with pytest.raises(ExpressionError, match=r"^not a valid expression: .* at column 16 \(the end\) in "
                                              r"'current_width <'$"):
        compile_predicate("current_width <")


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_expression_says_so(text: str) -> None:
    with pytest.raises(ExpressionError, match="^empty expression"):
        compile_predicate(text)


@pytest.mark.parametrize("text, column", [
    ("a < len(x)", 5),
    ("   a < len(x)", 8),                       # the leading blanks the parser never sees still count
    ('name == "é" and f(x)', 17),              # characters, not the UTF-8 bytes ast counts
    ("(a <\n len(b))", 7),                     # a line break counts as one character
])
def test_disallowed_part_is_located_in_the_expression_as_written(text: str, column: int) -> None:
    with pytest.raises(ExpressionError) as e:
        compile_predicate(text)
    assert e.value.column == column and e.value.source == text
    assert f" at column {column} in {text!r}: use field names" in str(e.value)


def test_each_name_knows_its_first_column() -> None:
    p = compile_predicate('  kind == "widht" and widht < 3 and widht > 1')
    assert p.column_of("kind") == 3
    assert p.column_of("widht") == 23                  # the name, not the same word inside a string
    assert p.column_of("nothere") is None


def test_expression_error_is_a_value_error() -> None:
    assert issubclass(ExpressionError, ValueError)


def test_malicious_looking_values_are_just_data(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    payload = "__import__('os').system('touch pwned')"
    # a rule comparing with such a string only compares
    p = compile_predicate(f'nvml_error == "{payload}"')
    assert p({"nvml_error": payload}) is True
    assert p({"nvml_error": "GpuIsLost"}) is False
    # a field value holding code is never evaluated, whatever the expression does with it
    q = compile_predicate("nvml_error != '' and nvml_error in [other, 'x'] or nvml_error + 1 == 1")
    assert q({"nvml_error": payload, "other": "open('f')"}) is False
    assert q({"nvml_error": payload, "other": payload}) is True
    assert not (tmp_path / "pwned").exists()
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("text, fields", [
    ('check_error % 1 == ""', {"check_error": "at 100%z"}),               # str % -> ValueError
    ('check_error * 100000000000000000000000 == ""', {"check_error": "x"}),  # -> OverflowError
])
def test_predicate_never_raises_on_mismatched_types(text: str, fields: dict) -> None:
    assert compile_predicate(text)(fields) is False


def test_deeply_nested_expression_is_an_expression_error() -> None:
    with pytest.raises(ExpressionError):
        compile_predicate("not " * 5000 + "x")


@pytest.mark.parametrize("expression", ['"x" * 1000000000 == message', "[0] * 99999999 == code",
                                        'message + "x" == "y"', "code % (1, 2) == 0"])
def test_repeating_or_joining_strings_and_lists_is_refused_when_rules_load(expression):
    """Such arithmetic could allocate without bound; it never reaches an observation."""
    with pytest.raises(ExpressionError, match="repeats or joins strings or lists at column"):
        compile_predicate(expression)
