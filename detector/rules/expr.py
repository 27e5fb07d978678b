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
    pass


@dataclass(frozen=True)
class Predicate:
    source: str
    names: frozenset[str]
    _fn: _Fn

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
    try:
        tree = ast.parse(source.strip(), mode="eval")
        names: set[str] = set()
        fn = _compile(tree.body, names)
    except SyntaxError as e:
        where = f" at column {e.offset}" if e.offset is not None else ""
        raise ExpressionError(f"not a valid expression: {e.msg}{where}") from None
    except (RecursionError, MemoryError):
        raise ExpressionError("expression nested too deeply") from None
    except ValueError as e:          # e.g. a NUL byte
        raise ExpressionError(f"not a valid expression: {e}") from None
    return Predicate(source, frozenset(names), fn)


def _compile(node: ast.AST, names: set[str]) -> _Fn:
    if isinstance(node, ast.BoolOp):
        parts = [_compile(v, names) for v in node.values]
        if isinstance(node.op, ast.And):
            return lambda f: all(p(f) for p in parts)
        return lambda f: any(p(f) for p in parts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        inner = _compile(node.operand, names)
        if isinstance(node.op, ast.Not):
            return lambda f: not inner(f)
        return lambda f: -inner(f)
    if isinstance(node, ast.Compare):
        return _compare(node, names)
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        op, left, right = _ARITH[type(node.op)], _compile(node.left, names), _compile(node.right, names)
        return lambda f: op(_number(left(f)), _number(right(f)))
    if isinstance(node, ast.Name):
        if node.id.lower() in _CONSTANT_NAMES:
            value = _CONSTANT_NAMES[node.id.lower()]
            return lambda f: value
        names.add(node.id)
        key = node.id
        return lambda f: f[key]
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        value = node.value
        return lambda f: value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_compile(e, names) for e in node.elts]
        return lambda f: [i(f) for i in items]
    where = f" (at column {node.col_offset + 1})" if hasattr(node, "col_offset") else ""
    raise ExpressionError(f"'{ast.unparse(node)}' is not allowed here{where}: use field names, literals, "
                          "comparisons (== != < <= > >= in), and/or/not and + - * / %")


def _number(value: Any) -> int | float:
    """Arithmetic is for numbers only: no string repetition or %-formatting from a rule file."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"not a number: {value!r}")
    return value


def _compare(node: ast.Compare, names: set[str]) -> _Fn:
    left = _compile(node.left, names)
    steps = [(_COMPARE[type(op)], _compile(right, names)) for op, right in zip(node.ops, node.comparators)
             if type(op) in _COMPARE]
    if len(steps) != len(node.ops):
        raise ExpressionError("'is' and 'is not' are not allowed: use == and !=")

    def fn(f: Fields) -> bool:
        a = left(f)
        for op, right in steps:
            b = right(f)
            if not op(a, b):
                return False
            a = b
        return True
    return fn
