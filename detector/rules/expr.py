"""`when:` predicates, such as `current_width < max_width and not idle`.

Parsed with Python's own `ast` and compiled from a small whitelist (comparisons, and/or/not,
arithmetic, literals, field names): nothing from a rule file is ever executed as code.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping

Fields = Mapping[str, Any]
_Fn = Callable[[Fields], Any]

_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}
_ARITH: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Mod: operator.mod,
}
_CONSTANT_NAMES = {"true": True, "false": False, "null": None, "none": None}


class ExpressionError(ValueError):
    """What is wrong with an expression, where (1-based column, when known) and in which expression:
    `'len(x)' is not allowed here at column 17 in 'width < len(x)': use field names, ...`."""

    def __init__(self, problem: str, source: str | None = None, column: int | None = None, hint: str = ""):
        self.problem, self.source, self.column, self.hint = problem, source, column, hint
        where = ""
        if column is not None and source is not None:
            where = f" at column {column}" + (" (the end)" if column > len(source) else "")
        quoted = f" in {source!r}" if source is not None else ""
        super().__init__(f"{problem}{where}{quoted}" + (f": {hint}" if hint else ""))


@dataclass(frozen=True)
class Predicate:
    source: str
    names: frozenset[str]
    _fn: _Fn
    columns: tuple[tuple[str, int | None], ...] = ()     # each name's first 1-based column in `source`

    def column_of(self, name: str) -> int | None:
        return dict(self.columns).get(name)

    def __call__(self, fields: Fields) -> bool:
        """True when the observation matches. Missing fields or mismatched types never match."""
        try:
            return bool(self._fn(fields))
        except (TypeError, ArithmeticError, ValueError, KeyError):
            return False


MAX_LENGTH = 2000


def compile_predicate(source: str) -> Predicate:
    if len(source) > MAX_LENGTH:
        raise ExpressionError(f"expression longer than {MAX_LENGTH} characters")
    text = source.lstrip()
    if not text:
        raise ExpressionError("empty expression: write a condition such as current_width < max_width")
    where = _Columns(source, text)
    try:
        tree = ast.parse(text, mode="eval")
        names: dict[str, int | None] = {}
        fn = _compile(tree.body, names, where)
    except SyntaxError as e:
        column = where.of_syntax_error(e)
        raise ExpressionError(f"not a valid expression: {e.msg}", source, column) from None
    except ExpressionError:
        raise
    except (RecursionError, MemoryError):
        raise ExpressionError("expression nested too deeply") from None
    except ValueError as e:          # e.g. a NUL byte
        raise ExpressionError(f"not a valid expression: {e}", source) from None
    return Predicate(source, frozenset(names), fn, tuple(names.items()))


class _Columns:
    """1-based columns in the expression as written (before the leading blanks were stripped for the
    parser); in a multi-line expression they run on across lines, a line break counting as one."""

    def __init__(self, source: str, parsed: str):
        self.source, self.lead = source, len(source) - len(parsed)
        self.lines = parsed.split("\n")
        self.line_starts = [0]
        for line in self.lines[:-1]:
            self.line_starts.append(self.line_starts[-1] + len(line) + 1)

    def of_node(self, node: ast.AST) -> int | None:
        lineno, col = getattr(node, "lineno", None), getattr(node, "col_offset", None)
        if lineno is None or col is None or not 1 <= lineno <= len(self.lines):
            return None
        chars = len(self.lines[lineno - 1].encode()[:col].decode(errors="ignore"))   # ast counts UTF-8 bytes
        return self.lead + self.line_starts[lineno - 1] + chars + 1

    def of_syntax_error(self, e: SyntaxError) -> int:
        """Python reports offset 0 when the expression ends too early: then the column is past the end."""
        if not e.offset or not e.lineno or not 1 <= e.lineno <= len(self.lines):
            return len(self.source) + 1
        return self.lead + self.line_starts[e.lineno - 1] + e.offset


def _compile(node: ast.AST, names: dict[str, int | None], where: _Columns) -> _Fn:
    if isinstance(node, ast.BoolOp):
        parts = [_compile(v, names, where) for v in node.values]
        if isinstance(node.op, ast.And):
            return lambda f: all(p(f) for p in parts)
        return lambda f: any(p(f) for p in parts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        inner = _compile(node.operand, names, where)
        if isinstance(node.op, ast.Not):
            return lambda f: not inner(f)
        return lambda f: -inner(f)
    if isinstance(node, ast.Compare):
        return _compare(node, names, where)
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        if isinstance(node.op, (ast.Mult, ast.Add, ast.Mod)) and (_is_sequence(node.left)
                                                                  or _is_sequence(node.right)):
            # `"x" * 10**9` or `[0] * 10**9` would allocate without bound: refused when the rules load
            raise ExpressionError(f"'{ast.unparse(node)}' repeats or joins strings or lists", where.source,
                                  where.of_node(node), "arithmetic is for numbers only")
        op = _ARITH[type(node.op)]
        left, right = _compile(node.left, names, where), _compile(node.right, names, where)
        return lambda f: op(_number(left(f)), _number(right(f)))
    if isinstance(node, ast.Name):
        if node.id.lower() in _CONSTANT_NAMES:
            value = _CONSTANT_NAMES[node.id.lower()]
            return lambda f: value
        names.setdefault(node.id, where.of_node(node))
        key = node.id
        return lambda f: f[key]
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        value = node.value
        return lambda f: value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_compile(e, names, where) for e in node.elts]
        return lambda f: [i(f) for i in items]
    raise ExpressionError(f"'{ast.unparse(node)}' is not allowed here", where.source, where.of_node(node),
                          "use field names, literals, comparisons (== != < <= > >= in), and/or/not and + - * / %")


def _is_sequence(node: ast.AST) -> bool:
    return isinstance(node, (ast.List, ast.Tuple, ast.Set)) or (
        isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)))


def _number(value: Any) -> int | float:
    """Arithmetic is for numbers only: no string repetition or %-formatting from a rule file."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"not a number: {value!r}")
    return value


def _compare(node: ast.Compare, names: dict[str, int | None], where: _Columns) -> _Fn:
    left = _compile(node.left, names, where)
    steps = [(_COMPARE[type(op)], _compile(right, names, where)) for op, right in zip(node.ops, node.comparators)
             if type(op) in _COMPARE]
    if len(steps) != len(node.ops):
        raise ExpressionError("'is' and 'is not' are not allowed", where.source, where.of_node(node),
                              "use == and !=")

    def fn(f: Fields) -> bool:
        a = left(f)
        for op, right in steps:
            b = right(f)
            if not op(a, b):
                return False
            a = b
        return True
    return fn
