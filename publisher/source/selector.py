"""Kubernetes label selector syntax, checked as the API server checks it (apimachinery's
`labels.Parse`), so that `--label-selector` is refused at start with one line instead of being
answered 400 on every list for ever.

Equality-based (`k=v`, `k==v`, `k!=v`, `k=` for an empty value), set-based (`k in (a,b)`,
`k notin (a,b)`, `k`, `!k`) and `k>N`, `k<N` requirements, joined by commas; keys are qualified
names (`[prefix/]name`), values label values. Pure: no I/O.
"""

from __future__ import annotations

import re

_WHITESPACE = " \t\r\n"
_SPECIAL = "=!(),<>"
# The lexer's symbols: the longest one that matches is taken ("!=" before "!").
_SYMBOLS = ("!=", "==", "!", "(", ")", ",", "=", ">", "<")
_EXACT_OPERATORS = ("=", "==", "!=", ">", "<")
_SET_OPERATORS = ("in", "notin")
_END = ""

_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


# The same language as one regular expression, for the chart's values schema (a JSON schema has
# no parser). It never admits what the parser refuses; it is stricter in two corners a regular
# expression cannot count: a key's prefix is at most 4 DNS labels of at most 62 characters, or 8 of
# at most 30 (both within the 253 characters the API server allows), and a `>`/`<` number has at
# most 18 digits (always within int64).
_WS = r"[ \t\r\n]*"
_DNS_LABELS = r"[a-z0-9]([-a-z0-9]{{0,{inner}}}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{{0,{inner}}}[a-z0-9])?){{0,{more}}}"
# A DNS subdomain of at most 253 characters, as far as a regular expression can count them.
BOUNDED_DNS_SUBDOMAIN = f"({_DNS_LABELS.format(inner=60, more=3)}|{_DNS_LABELS.format(inner=28, more=7)})"
_PREFIX = f"{BOUNDED_DNS_SUBDOMAIN}/"
_LABEL_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?"
_KEY = rf"({_PREFIX})?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?"
_REQUIREMENT = (
    rf"(!{_WS}{_KEY}|{_KEY}("
    rf"{_WS}(==?|!=){_WS}{_LABEL_VALUE}"
    rf"|{_WS}[<>]{_WS}[0-9]{{1,18}}"
    rf"|[ \t\r\n]+(in|notin){_WS}\({_WS}{_LABEL_VALUE}{_WS}(,{_WS}{_LABEL_VALUE}{_WS})*\)"
    r")?)"
)
SELECTOR_PATTERN = rf"^{_WS}({_REQUIREMENT}{_WS}(,{_WS}{_REQUIREMENT}{_WS})*)?$"


class SelectorError(ValueError):
    """Why a label selector is not one the API server accepts."""


def _tokens(text: str) -> list[str]:
    """Symbols, keywords and identifiers, then _END. An identifier is a run of anything but
    whitespace and the symbols' characters."""
    tokens: list[str] = []
    position = 0
    while position < len(text):
        char = text[position]
        if char in _WHITESPACE:
            position += 1
        elif char in _SPECIAL:
            symbol = next(s for s in _SYMBOLS if text.startswith(s, position))
            tokens.append(symbol)
            position += len(symbol)
        else:
            end = position
            while end < len(text) and text[end] not in _WHITESPACE and text[end] not in _SPECIAL:
                end += 1
            tokens.append(text[position:end])
            position = end
    tokens.append(_END)
    return tokens


def _is_identifier(token: str) -> bool:
    # `in` and `notin` are identifiers where a key or a value is expected.
    return token != _END and token not in _SYMBOLS


def _shown(token: str) -> str:
    return "end of string" if token == _END else f"'{token}'"


def _check_key(key: str) -> None:
    prefix, slash, name = key.rpartition("/")
    problem = None
    if len(name) > 63 or not _NAME.match(name):
        problem = "a label key's name is at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit"
    elif slash and (not prefix or len(prefix) > 253 or "/" in prefix or not _DNS_SUBDOMAIN.match(prefix)):
        problem = "a label key's prefix is a lower-case DNS subdomain of at most 253 characters"
    if problem:
        raise SelectorError(f"key {key!r}: {problem}")


def _check_value(key: str, value: str) -> None:
    if len(value) > 63 or not _VALUE.match(value):
        raise SelectorError(
            f"value {value!r} of {key!r}: a label value is empty or at most 63 letters, digits, '-', '_' or '.', "
            "beginning and ending with a letter or digit"
        )


class _Parser:
    def __init__(self, text: str) -> None:
        self._tokens = _tokens(text)
        self._position = 0

    def _peek(self) -> str:
        return self._tokens[self._position]

    def _take(self) -> str:
        token = self._tokens[self._position]
        self._position = min(self._position + 1, len(self._tokens) - 1)
        return token

    def selector(self) -> None:
        while True:
            token = self._peek()
            if token == _END:
                return
            if token != "!" and not _is_identifier(token):
                raise SelectorError(f"found {_shown(token)}, expected: !, identifier, or end of string")
            self._requirement()
            token = self._take()
            if token == _END:
                return
            if token != ",":
                raise SelectorError(f"found {_shown(token)}, expected: ',' or end of string")
            following = self._peek()
            if following != "!" and not _is_identifier(following):
                raise SelectorError(f"found {_shown(following)}, expected: identifier after ','")

    def _requirement(self) -> None:
        negated = self._peek() == "!"
        if negated:
            self._take()
        key = self._take()
        if not _is_identifier(key):
            raise SelectorError(f"found {_shown(key)}, expected: identifier")
        _check_key(key)
        if negated or self._peek() in (_END, ","):
            return  # exists, or does not exist
        operator = self._take()
        if operator in _SET_OPERATORS:
            values = self._set_values()
            for value in values:
                _check_value(key, value)
            return
        if operator not in _EXACT_OPERATORS:
            raise SelectorError(f"found {_shown(operator)}, expected: in, notin, =, ==, !=, gt, lt")
        value = "" if self._peek() in (_END, ",") else self._take()
        if value and not _is_identifier(value):
            raise SelectorError(f"found {_shown(value)}, expected: identifier")
        if operator in (">", "<") and not (re.fullmatch(r"[+-]?[0-9]+", value) and -(2**63) <= int(value) < 2**63):
            raise SelectorError(f"{key}{operator}{value}: for '>' and '<' the value must be a 64-bit integer")
        _check_value(key, value)

    def _set_values(self) -> set[str]:
        token = self._take()
        if token != "(":
            raise SelectorError(f"found {_shown(token)}, expected: '('")
        values: set[str] = set()
        expect_value = True  # at the start and after each comma; an empty place is the value ""
        while True:
            token = self._take()
            if token == ")":
                if expect_value:
                    values.add("")
                return values
            if token == ",":
                if expect_value:
                    values.add("")
                expect_value = True
            elif _is_identifier(token) and expect_value:
                values.add(token)
                expect_value = False
            else:
                raise SelectorError(f"found {_shown(token)}, expected: ',', ')' or identifier")


def selector_problem(text: str) -> str | None:
    """Why the API server would answer 400 to `text` as a labelSelector, or None."""
    try:
        _Parser(text).selector()
    except SelectorError as exc:
        return str(exc)
    return None
