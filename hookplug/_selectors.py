"""Selectors: a small language that picks modules out of ``model.named_modules()``.

Grammar (see DESIGN.md)::

    selector := term ("," ["-"] term)*          union, "-" removes from the union so far
    term     := classes [":" names]              no ":" means any name but the root
    classes  := "*" | class ("|" class)*         class name (or a base class's), or dotted path
    names    := glob | "re:" regex | ""          fnmatch glob ("." literal), full-match regex,
                                                 or empty: the root module only

A regex runs to the next comma outside character classes, braces and parentheses (write
``\\,`` for a literal comma at the top level). Wrappers (``torch.compile``, DataParallel,
DDP) are looked through: names are those of the wrapped model.
"""
from __future__ import annotations

import difflib
import fnmatch
import importlib
import re
import warnings
from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

import torch.nn as nn

__all__ = ["SelectorError", "select", "parse_selector", "unwrap_model"]

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


class SelectorError(ValueError):
    """A selector that cannot be parsed or that names a class that exists nowhere.

    The message quotes the selector and marks the offending column with a caret.
    """

    def __init__(self, selector: str, column: int, message: str):
        self.selector = selector
        self.column = column
        self.reason = message
        caret = " " * (column + 2) + "^"
        super().__init__(f"{message}\n  {selector}\n{caret}")


@dataclass(frozen=True)
class _ClassPattern:
    text: str
    column: int

    @property
    def dotted(self) -> bool:
        return "." in self.text


@dataclass(frozen=True)
class _Term:
    exclude: bool
    classes: Tuple[_ClassPattern, ...]  # empty tuple means "*"
    name_kind: str  # "glob" | "regex" | "root"
    name_pattern: str
    column: int


def _split_terms(selector: str) -> List[Tuple[int, str]]:
    """Split on top-level commas; inside a ``re:`` part, escapes, character classes and
    brackets protect commas."""
    parts, start, depth, i, in_regex, seen_colon = [], 0, 0, 0, False, False
    while i < len(selector):
        ch = selector[i]
        if in_regex and ch == "\\":
            i += 2
            continue
        if in_regex and ch == "[":  # a character class: brackets inside it are literal
            j = i + 1
            if j < len(selector) and selector[j] == "^":
                j += 1
            if j < len(selector) and selector[j] == "]":
                j += 1
            while j < len(selector) and selector[j] != "]":
                j += 2 if selector[j] == "\\" else 1
            i = j + 1
            continue
        if not in_regex and ch == ":" and not seen_colon:
            seen_colon = True
            k = i + 1
            while k < len(selector) and selector[k] == " ":
                k += 1
            if selector.startswith("re:", k):
                in_regex = True
                i = k + 3
                continue
        elif in_regex and ch in "({":
            depth += 1
        elif in_regex and ch in ")}":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            parts.append((start, selector[start:i]))
            start, in_regex, seen_colon = i + 1, False, False
        i += 1
    parts.append((start, selector[start:]))
    return parts


def _parse_term(selector: str, offset: int, text: str) -> _Term:
    lead = len(text) - len(text.lstrip())
    body = text.strip()
    col = offset + lead
    if not body:
        raise SelectorError(selector, col, "empty term in selector (two commas, or a trailing comma?)")
    exclude = body.startswith("-")
    if exclude:
        body = body[1:].lstrip()
        col = offset + lead + (len(text.strip()) - len(body))
        if not body:
            raise SelectorError(selector, col, "'-' must be followed by a term to remove")
    class_part, sep, name_part = body.partition(":")
    class_part_stripped = class_part.strip()
    classes: List[_ClassPattern] = []
    if class_part_stripped != "*":
        pos = col
        for alt in class_part.split("|"):
            alt_col = pos + (len(alt) - len(alt.lstrip()))
            name = alt.strip()
            if not name:
                raise SelectorError(selector, alt_col, "empty class name in alternation")
            if name == "*":
                raise SelectorError(selector, alt_col, "'*' cannot be combined with class names")
            if not _IDENT.fullmatch(name):
                bad = next((k for k, c in enumerate(name) if not (c.isalnum() or c in "_.")), 0)
                raise SelectorError(
                    selector, alt_col + bad,
                    f"expected a class name such as 'Conv2d' or 'torch.nn.Linear', got {name!r}",
                )
            classes.append(_ClassPattern(name, alt_col))
            pos += len(alt) + 1
    name_col = col + len(class_part) + 1
    if not sep:
        kind, pattern = "glob", "*"
    elif name_part.strip() == "":
        kind, pattern = "root", ""
    elif name_part.lstrip().startswith("re:"):
        lead_spaces = len(name_part) - len(name_part.lstrip())
        kind, pattern = "regex", name_part.lstrip()[3:].rstrip()
        try:
            re.compile(pattern)
        except re.error as exc:
            raise SelectorError(
                selector, name_col + lead_spaces + 3 + (exc.pos or 0),
                f"invalid regular expression: {exc.msg}",
            ) from None
    else:
        kind, pattern = "glob", name_part.strip()
        if any(c.isspace() for c in pattern):
            raise SelectorError(selector, name_col, "a name glob cannot contain spaces")
    return _Term(exclude, tuple(classes), kind, pattern, col)


def parse_selector(selector: str) -> Tuple[_Term, ...]:
    """Parse ``selector`` into terms; raise :class:`SelectorError` on malformed input."""
    if not isinstance(selector, str):
        raise TypeError(f"selector must be a str, got {type(selector).__name__}")
    if not selector.strip():
        raise SelectorError(selector, 0, "empty selector; use '*' for every module")
    terms = tuple(_parse_term(selector, off, text) for off, text in _split_terms(selector))
    if terms[0].exclude:
        raise SelectorError(selector, terms[0].column, "a selector cannot start with '-' (nothing to remove from yet)")
    return terms


def _class_matcher(selector: str, pat: _ClassPattern, known: Sequence[type]) -> Callable[[nn.Module], bool]:
    if pat.dotted:
        module_path, _, attr = pat.text.rpartition(".")
        cls = None
        try:
            cls = getattr(importlib.import_module(module_path), attr, None)
        except Exception:  # noqa: BLE001 - an unimportable path falls back to name matching
            cls = None
        if isinstance(cls, type):
            return lambda m, c=cls: isinstance(m, c)
        qual = pat.text
        if any(f"{k.__module__}.{k.__qualname__}" == qual for k in known):
            return lambda m: any(f"{k.__module__}.{k.__qualname__}" == qual for k in type(m).__mro__)
        raise SelectorError(selector, pat.column, f"cannot import class {pat.text!r}")
    name = pat.text
    if not any(k.__name__ == name for k in known) and not isinstance(getattr(nn, name, None), type):
        candidates = sorted({k.__name__ for k in known} | {n for n in dir(nn) if n[:1].isupper()})
        close = difflib.get_close_matches(name, candidates, n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise SelectorError(
            selector, pat.column, f"no class named {name!r} in the model or in torch.nn{hint}"
        )
    return lambda m: any(k.__name__ == name for k in type(m).__mro__)


def _name_matcher(term: _Term) -> Callable[[str], bool]:
    if term.name_kind == "root":
        return lambda n: n == ""
    if term.name_kind == "regex":
        rx = re.compile(term.name_pattern)
        return lambda n: n != "" and rx.fullmatch(n) is not None
    pat = term.name_pattern
    return lambda n: n != "" and fnmatch.fnmatchcase(n, pat)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside ``torch.compile``'s ``OptimizedModule`` and
    ``DataParallel``/``DistributedDataParallel``, so names do not depend on the wrapper."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
        elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        else:
            return model


def select(
    model: nn.Module, selector: str, *, strict: bool = False
) -> List[Tuple[str, nn.Module]]:
    """Return the ``[(name, module), ...]`` that ``selector`` picks, in ``named_modules()`` order.

    A dry run: nothing is attached. A selector that matches nothing warns, or raises
    :class:`SelectorError` with ``strict=True``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"select() expects a torch.nn.Module, got {type(model).__name__}")
    model = unwrap_model(model)
    terms = parse_selector(selector)
    named = list(model.named_modules())
    known = list({k for _, m in named for k in type(m).__mro__})
    chosen: dict = {}
    for term in terms:
        class_ok = [_class_matcher(selector, p, known) for p in term.classes]
        name_ok = _name_matcher(term)
        for name, mod in named:
            if not name_ok(name):
                continue
            if class_ok and not any(f(mod) for f in class_ok):
                continue
            if term.exclude:
                chosen.pop(name, None)
            else:
                chosen[name] = mod
    result = [(n, m) for n, m in named if n in chosen]
    if not result:
        msg = f"selector {selector!r} matched no module of {type(model).__name__}"
        if strict:
            raise SelectorError(selector, 0, msg)
        warnings.warn(msg, stacklevel=2)
    return result

