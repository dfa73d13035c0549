"""What a PromQL expression reads: its vector selectors, found by a tokenizer.

Enough for the expressions this project ships (packaging/monitoring): metric
names, matchers, functions, aggregations with their label lists, binary
operators with `on`/`ignoring`/`group_left`, ranges, subqueries and `offset`.
"""

from __future__ import annotations

import re

_TOKENS = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<matchers>\{(?:"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|[^{}"'])*\})
  | (?P<range>\[[^\]]*\])
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+(?![A-Za-z0-9_:]))
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<other>.)
""", re.X | re.S)
# Keywords followed by a parenthesised list of label names, not of expressions.
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = _LABEL_LISTS | {"and", "or", "unless", "bool", "offset", "inf", "nan"}
# Aggregations may put `by (...)` between their name and their parenthesis.
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
                 "count_values", "bottomk", "topk", "quantile"}


def selectors(expr: str) -> list[str]:
    """The vector selectors of `expr`, as written (`name{matchers}`), in order."""
    tokens = [(m.lastgroup or "", m.group()) for m in _TOKENS.finditer(expr)
              if m.lastgroup != "space"]
    found: list[str] = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        after = tokens[i + 1] if i + 1 < len(tokens) else ("", "")
        if kind == "ident" and text.lower() in _LABEL_LISTS and after[1] == "(":
            i = tokens.index(("other", ")"), i)  # label names hold no parenthesis
        elif kind == "ident" and (after[1] == "(" or text.lower() in _KEYWORDS
                                  or text in _AGGREGATIONS):
            pass  # a function, an aggregation or a keyword
        elif kind == "ident":
            if after[0] == "matchers":
                text += after[1]
                i += 1
            found.append(text)
        elif kind == "matchers":
            found.append(text)
        i += 1
    return found
