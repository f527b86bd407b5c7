"""Selectors: a small language that picks modules out of ``model.named_modules()``.

Grammar (see DESIGN.md)::

    selector := term ("," ["-"] term)*          union, "-" removes from the union so far
    term     := classes [":" names]              no ":" means any name but the root
    classes  := "*" | class ("|" class)*         class name (or a base class's), or dotted path
    names    := glob | "re:" regex | ""          fnmatch glob ("." literal), full-match regex,
                                                 or empty: the root module only

A regex runs to the next comma outside character classes, braces and parentheses (write
``\\,`` for a literal comma at the top level). Whitespace around any part is not part of
it (``Conv2d | Linear : re: fc\\d , -*:head``), after ``re:`` included; write ``\\ `` for
a space the regex begins or ends with. Wrappers (``torch.compile``, DataParallel,
DDP) are looked through: names are those of the wrapped model.

Selectors may come from config files, so they are treated as untrusted text:

- A dotted class path (``torch.nn.Linear``, ``mypkg.models.Block``) is looked up only in
  modules that are already imported (``sys.modules``); a selector never imports anything.
  Import the module first to use its classes. A name a package exports lazily and has not
  yet (``transformers.GPT2Model`` on a model ``AutoModel`` made: transformers' module
  ``__getattr__`` would import it; the name must be in the package's ``__all__``) is the
  model's class of that name from a module inside
  the package, else the one class of that name an imported module inside it defines; the
  ``__getattr__`` is never called.
- Python's ``re`` has no timeout, so a regex is checked before it runs (see
  :func:`_check_regex`): groups nest at most ``_MAX_REGEX_DEPTH`` deep, a quantified part
  may not hold another variable-width quantifier or alternatives that can start with the
  same character (the forms whose backtracking is exponential), and the remaining
  polynomial worst case is estimated per module name and refused over a budget.
"""
from __future__ import annotations

import fnmatch
import math
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ._options import close_matches

__all__ = ["SelectorError", "select", "parse_selector", "unwrap_model", "clean_name",
           "named_modules", "named_parameters"]


def _is_class_path(name: str) -> bool:
    """``Conv2d``, ``torch.nn.Linear``: dotted Python identifiers (any the language allows)."""
    return all(part.isidentifier() for part in name.split("."))


try:  # Python 3.11+
    from re import _constants as _sre_c
    from re import _parser as _sre_parse
except ImportError:  # pragma: no cover - Python 3.9/3.10
    import sre_constants as _sre_c
    import sre_parse as _sre_parse

_MAX_REGEX_DEPTH = 100  # groups nested deeper than this are refused (the parser recurses)
_REGEX_BUDGET = 5 * 10**7  # estimated backtracking steps one name may cost (about 1 s at worst)


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



def _class_end(text: str, i: int) -> int:
    """Index of the ``]`` closing the regex character class that opens at ``text[i]``
    (a leading ``^`` and a first ``]`` are part of the class; backslashes escape)."""
    j = i + 1
    if j < len(text) and text[j] == "^":
        j += 1
    if j < len(text) and text[j] == "]":
        j += 1
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    return j

def _glob_class_end(text: str, i: int) -> Optional[int]:
    """Index of the ``]`` closing the ``fnmatch`` character class that opens at ``text[i]``
    (a leading ``!`` and a first ``]`` are part of it); None where none closes it (fnmatch
    then takes the ``[`` literally)."""
    j = i + 1
    if j < len(text) and text[j] == "!":
        j += 1
    if j < len(text) and text[j] == "]":
        j += 1
    end = text.find("]", j)
    return None if end < 0 else end


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
            i = _class_end(selector, i) + 1
            continue
        if seen_colon and not in_regex and ch == "[":  # a glob's character class: "l.[1,2]"
            end = _glob_class_end(selector, i)
            if end is not None:
                i = end + 1
                continue
        if not in_regex and ch == ":" and not seen_colon:
            seen_colon = True
            k = i + 1
            while k < len(selector) and selector[k].isspace():
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


def _group_depth(pattern: str) -> int:
    """How deep the parentheses of ``pattern`` nest (escapes and character classes skipped)."""
    depth = deepest = i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            i = _class_end(pattern, i) + 1
            continue
        if ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(0, depth - 1)
        i += 1
    return deepest


@dataclass(frozen=True)
class _RegexCost:
    """Worst-case backtracking of a regex without nested quantifiers, as a function of the
    name's length ``n``: ``branches * prod(min(n + 1, w) for w in bounded) * (n + 1)**unbounded
    / unbounded!`` (each variable-width quantifier picks one of its repeat counts)."""

    branches: float
    bounded: Tuple[int, ...]
    unbounded: int

    def log_steps(self, n: int) -> float:
        out = math.log(self.branches) + self.unbounded * math.log(n + 1) - math.lgamma(self.unbounded + 1)
        return out + sum(math.log(min(n + 1, w)) for w in self.bounded)

    def max_length(self) -> int:
        """The longest name this regex may be matched against within ``_REGEX_BUDGET``."""
        limit, n = math.log(_REGEX_BUDGET), 1
        if self.log_steps(10**9) <= limit:
            return 10**9
        while self.log_steps(n * 2) <= limit:
            n *= 2
        step = n // 2
        while step:
            if self.log_steps(n + step) <= limit:
                n += step
            step //= 2
        return n


_REPEATS = tuple(getattr(_sre_c, op) for op in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
                 if hasattr(_sre_c, op))
_ATOMIC = getattr(_sre_c, "ATOMIC_GROUP", None)


def _first_chars(items) -> Optional[set]:
    """The characters (case-folded) an alternative can start with; None if it cannot be told."""
    items = list(items)
    while items:
        op, av = items[0]
        if op is _sre_c.LITERAL:
            return {chr(av).casefold()}
        if op is _sre_c.IN:
            chars = set()
            for iop, iav in av:
                if iop is _sre_c.LITERAL:
                    chars.add(chr(iav).casefold())
                elif iop is _sre_c.RANGE and iav[1] - iav[0] < 1024:
                    chars.update(chr(c).casefold() for c in range(iav[0], iav[1] + 1))
                else:
                    return None
            return chars
        if op is _sre_c.SUBPATTERN:
            items = list(av[-1])
            continue
        return None
    return None  # an empty alternative


def _analyse_regex(parsed) -> Tuple[Optional[str], _RegexCost]:
    """Walk the parsed regex (iteratively): the reason it can backtrack exponentially (or
    None), and its polynomial cost model."""
    branches, bounded, unbounded = 1.0, [], 0
    stack = [(list(parsed), False)]
    while stack:
        items, in_repeat = stack.pop()
        for op, av in items:
            if op in _REPEATS:
                lo, hi, sub = av
                if lo != hi:
                    if in_repeat:
                        return ("a variable-width quantifier inside a quantified group (like (\\w+_?)+) "
                                "can backtrack exponentially; write it without the nesting "
                                "(e.g. [\\w_]+)"), _RegexCost(1.0, (), 0)
                    if hi == _sre_c.MAXREPEAT:
                        unbounded += 1
                    else:
                        bounded.append(hi - lo + 1)
                stack.append((list(sub), in_repeat or hi > 1))
            elif op is _sre_c.SUBPATTERN:
                stack.append((list(av[-1]), in_repeat))
            elif _ATOMIC is not None and op is _ATOMIC:
                stack.append((list(av), in_repeat))
            elif op in (_sre_c.ASSERT, _sre_c.ASSERT_NOT):
                stack.append((list(av[1]), in_repeat))
            elif op is _sre_c.BRANCH:
                alts = av[1]
                if in_repeat:
                    seen: set = set()
                    for alt in alts:
                        first = _first_chars(alt)
                        if first is None or first & seen:
                            return ("alternatives inside a quantified group that can start with the "
                                    "same character (like (a|ab)+ or (\\w|_)+) can backtrack "
                                    "exponentially; make them start differently or use a character "
                                    "class"), _RegexCost(1.0, (), 0)
                        seen |= first
                branches *= len(alts)
                stack.extend((list(alt), in_repeat) for alt in alts)
            elif op is _sre_c.GROUPREF_EXISTS:
                branches *= 2
                stack.extend((list(p), in_repeat) for p in av[1:] if p is not None)
    return None, _RegexCost(branches, tuple(bounded), unbounded)


def _check_regex(selector: str, column: int, pattern: str) -> _RegexCost:
    """Refuse a regex that could run for unbounded time; return its cost model.

    ``re`` has no timeout, so the check is static and conservative: groups nest at most
    ``_MAX_REGEX_DEPTH`` deep (deeper, ``re``'s own parser would recurse without bound); no
    quantified group holds a variable-width quantifier or alternatives that may start with
    the same character (exponential backtracking: ``(\\w+_?)+!``, ``(a|a)*``). What is left
    backtracks at most polynomially in the name's length; :class:`_RegexCost` bounds it, and
    ``select`` refuses to match a name too long for :data:`_REGEX_BUDGET` steps.
    """
    depth = _group_depth(pattern)
    if depth > _MAX_REGEX_DEPTH:
        raise SelectorError(selector, column, f"regular expression nests groups {depth} deep; "
                                              f"at most {_MAX_REGEX_DEPTH} levels are allowed")
    try:
        re.compile(pattern)
        parsed = _sre_parse.parse(pattern)
    except re.error as exc:
        raise SelectorError(selector, column + (exc.pos or 0),
                            f"invalid regular expression: {exc.msg}") from None
    except OverflowError as exc:
        raise SelectorError(selector, column, f"invalid regular expression: {exc}") from None
    except RecursionError:
        raise SelectorError(selector, column, "regular expression is nested too deeply") from None
    reason, cost = _analyse_regex(parsed)
    if reason is not None:
        raise SelectorError(selector, column, f"regular expression refused: {reason}")
    if cost.log_steps(1) > math.log(_REGEX_BUDGET):
        raise SelectorError(selector, column, "regular expression refused: its alternatives and "
                                              "optional parts combine into too many ways to match")
    return cost


def _strip(text: str) -> Tuple[int, str]:
    """``text`` without the whitespace around it, and how much led it; a trailing
    whitespace character escaped with a backslash (a regex's ``\\ ``) is kept."""
    body = text.lstrip()
    lead = len(text) - len(body)
    end = len(body.rstrip())
    if end < len(body) and (end - len(body[:end].rstrip("\\"))) % 2:
        end += 1
    return lead, body[:end]


def _parse_term(selector: str, offset: int, text: str) -> _Term:
    lead, body = _strip(text)
    col = offset + lead
    if not body:
        raise SelectorError(selector, col, "empty term in selector (two commas, or a trailing comma?)")
    exclude = body.startswith("-")
    if exclude:
        whole, body = body, body[1:].lstrip()
        col = offset + lead + (len(whole) - len(body))
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
            if not _is_class_path(name):
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
        inner, pattern = _strip(name_part.lstrip()[3:])  # "re: x" is "x", as "A | B" is A, B
        kind = "regex"
        _check_regex(selector, name_col + lead_spaces + 3 + inner, pattern)
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


def _imported_class(selector: str, pat: _ClassPattern, known: Sequence[type]) -> type:
    """The class a dotted path names, found in the model's classes or in a module that is
    already imported. Never imports: selectors may come from files (``"this.Zen"`` would
    run the ``this`` module)."""
    for k in known:
        if f"{k.__module__}.{k.__qualname__}" == pat.text:
            return k
    parts = pat.text.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest imported module prefix
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        obj = vars(module).get(parts[cut])  # not getattr: a module's lazy __getattr__ imports
        for attr in parts[cut + 1:]:
            obj = getattr(obj, attr, None) if isinstance(obj, type) else None
        if isinstance(obj, type):
            return obj
        if parts[cut] not in vars(module) and _exports_lazily(module, parts[cut]):
            return _lazy_export(selector, pat, ".".join(parts[:cut]), parts[cut:], known)
        raise SelectorError(
            selector, pat.column,
            f"{pat.text!r} is not a class: module {'.'.join(parts[:cut])!r} has no class "
            f"{'.'.join(parts[cut:])!r}",
        )
    raise SelectorError(
        selector, pat.column,
        f"cannot find class {pat.text!r}: module {'.'.join(parts[:-1])!r} is not imported, and a "
        "selector never imports modules; import it before selecting (or name the class "
        f"without its module: {parts[-1]!r})",
    )


def _exports_lazily(module, name: str) -> bool:
    """Whether ``module`` exports ``name`` lazily: it has a module ``__getattr__`` (PEP 562)
    or a module class with one (transformers' and diffusers' ``_LazyModule``), and lists
    ``name`` in its ``__all__`` (``torch.Dropout`` is no such name: torch has a
    ``__getattr__``, but ``getattr(torch, "Dropout")`` raises)."""
    if "__getattr__" not in vars(module) and not hasattr(type(module), "__getattr__"):
        return False
    exported = vars(module).get("__all__")
    return isinstance(exported, (list, tuple, set, frozenset)) and name in exported


def _lazy_export(selector: str, pat: _ClassPattern, modname: str, rest: Sequence[str],
                 known: Sequence[type]) -> type:
    """The class ``modname.rest`` names where ``modname`` may export it lazily and has not
    yet (``transformers.GPT2Model`` on a model ``AutoModel`` made), found without running
    the ``__getattr__`` (which imports): the model's class of that name from a module
    inside ``modname``, else the one class of that name defined in an imported module
    inside it. None: an error naming what was tried and the fix."""
    qualname, prefix = ".".join(rest), modname + "."

    def unique(found):
        return sorted(set(found), key=lambda k: (k.__module__, id(k)))

    hits = unique(k for k in known if k.__qualname__ == qualname and k.__module__.startswith(prefix))
    if len(hits) != 1:
        found = []
        for name, module in list(sys.modules.items()):
            if not name.startswith(prefix) or module is None:
                continue
            obj = vars(module).get(rest[0]) if hasattr(module, "__dict__") else None
            for attr in rest[1:]:
                obj = getattr(obj, attr, None) if isinstance(obj, type) else None
            if isinstance(obj, type) and obj.__qualname__ == qualname and obj.__module__ == name:
                found.append(obj)
        hits = hits or unique(found)
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise SelectorError(
            selector, pat.column,
            f"{pat.text!r} is ambiguous: module {modname!r} has no class {qualname!r} yet (it "
            "exports names lazily, and a selector never imports) and its modules define several: "
            + ", ".join(repr(f"{k.__module__}.{k.__qualname__}") for k in hits)
            + "; name one by its full path",
        )
    raise SelectorError(
        selector, pat.column,
        f"cannot find class {pat.text!r}: module {modname!r} has no class {qualname!r} among "
        "its attributes yet, and it exports names lazily (a module __getattr__, which imports "
        "code on first access; a selector never imports); neither the model nor a module "
        f"inside {modname!r} already imported has a class {qualname!r}. Import it before "
        f"selecting (`from {modname} import {rest[0]}`), or name the class without its module "
        f"({rest[-1]!r})",
    )


def _class_matcher(selector: str, pat: _ClassPattern, known: Sequence[type],
                   module_names: Sequence[str] = ()) -> Callable[[nn.Module], bool]:
    if pat.dotted:
        try:
            cls = _imported_class(selector, pat, known)
        except SelectorError as exc:
            raise _as_name_hint(exc, pat.text, module_names) from None
        return lambda m, c=cls: isinstance(m, c)
    name = pat.text
    if (not any(k.__name__ == name for k in known) and not isinstance(getattr(nn, name, None), type)
            and not _imported_class_named(name)):
        candidates = sorted({k.__name__ for k in known} | {n for n in dir(nn) if n[:1].isupper()})
        close = close_matches(name, candidates, n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close[:3])}?" if close else ""
        raise _as_name_hint(SelectorError(
            selector, pat.column, f"no class named {name!r} in the model or in torch.nn{hint}"
        ), name, module_names)
    return lambda m: any(k.__name__ == name for k in type(m).__mro__)


def _imported_class_named(name: str) -> bool:
    """Whether an imported module has an ``nn.Module`` class ``name`` (``Conv1D`` on a BERT,
    in transformers: one selector, ``Linear|Conv1D``, serves GPT-2 and BERT; it matches
    nothing here, and a typo, which no module has, is still refused)."""
    for module in list(sys.modules.values()):
        obj = getattr(module, "__dict__", {}).get(name)
        if isinstance(obj, type) and obj.__name__ == name and issubclass(obj, nn.Module):
            return True
    return False


def _as_name_hint(exc: SelectorError, text: str, module_names: Sequence[str]) -> SelectorError:
    """``exc`` for a class part that reads as a module name (``lm_head``, ``transformer.h``)
    or a regex (``re``): it says how a name is written."""
    if text == "re":
        return SelectorError(exc.selector, exc.column, exc.reason + "; a regex over names is "
                             "written after a colon: '*:re:...'")
    if any(fnmatch.fnmatchcase(n, text) for n in module_names if n):
        return SelectorError(exc.selector, exc.column, exc.reason + f"; {text!r} is a module "
                             f"name here: a name is written after a colon, '*:{text}'")
    return exc


def _parse_error_hint(exc: SelectorError, module_names: Sequence[str]) -> SelectorError:
    """``exc`` (a selector that does not parse) with :func:`_as_name_hint`'s hint where the
    class part it points into is a module name or glob of the model (``net.0``, ``net.*``)."""
    if not exc.reason.startswith("expected a class name"):
        return exc
    start = exc.selector.rfind(",", 0, exc.column) + 1
    end = exc.selector.find(",", exc.column)
    term = exc.selector[start:len(exc.selector) if end < 0 else end].strip()
    excluded = term.startswith("-")
    class_part = term.lstrip("-").strip().partition(":")[0].strip()
    alt = next((a.strip() for a in class_part.split("|") if not _is_class_path(a.strip())), class_part)
    hinted = _as_name_hint(exc, alt, module_names)
    if excluded and hinted is not exc:  # (the same term, removed: '-*:net.0')
        hinted = SelectorError(exc.selector, exc.column, hinted.reason.replace(f"'*:{alt}'", f"'-*:{alt}'"))
    return hinted


def _name_matcher(selector: str, term: _Term) -> Callable[[str], bool]:
    if term.name_kind == "root":
        return lambda n: n == ""
    if term.name_kind == "regex":
        rx = re.compile(term.name_pattern)
        longest = _regex_max_length(term.name_pattern)

        def match(n: str) -> bool:
            if len(n) > longest:
                shown = n if len(n) <= 60 else n[:57] + "..."
                raise SelectorError(
                    selector, term.column,
                    f"module name {shown!r} has {len(n)} characters; this regular expression may "
                    f"be matched against names of at most {longest} (bounded matching time); "
                    "use a glob or a regex with fewer quantifiers",
                )
            return n != "" and rx.fullmatch(n) is not None

        return match
    pat = term.name_pattern
    return lambda n: n != "" and fnmatch.fnmatchcase(n, pat)


_MAX_LENGTHS: Dict[str, int] = {}


def _regex_max_length(pattern: str) -> int:
    """The longest name ``pattern`` (already checked) may be matched against."""
    longest = _MAX_LENGTHS.get(pattern)
    if longest is None:
        longest = _analyse_regex(_sre_parse.parse(pattern))[1].max_length()
        if len(_MAX_LENGTHS) < 1024:
            _MAX_LENGTHS[pattern] = longest
    return longest


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside ``torch.compile``'s ``OptimizedModule``,
    ``DataParallel``/``DistributedDataParallel``, FSDP1, ``checkpoint_wrapper`` and Lightning
    Fabric's ``_FabricModule`` at the root, so names do not depend on the wrapper (FSDP2's
    ``fully_shard`` wraps nothing)."""
    while True:
        inner = unwrap_model_once(model)
        if inner is model:
            return model
        model = inner


def unwrap_model_once(model: nn.Module) -> nn.Module:
    """The module one wrapper of :func:`unwrap_model` wraps; ``model`` where it is none."""
    if isinstance(model, torch.jit.ScriptModule):  # (its _modules is not a dict)
        return model
    inner = getattr(model, "_orig_mod", None)
    if not isinstance(inner, nn.Module):
        inner = next((model._modules[a] for a in _WRAPPED_ATTRS
                      if isinstance(model._modules.get(a), nn.Module)), None)
    if isinstance(inner, nn.Module):
        return inner
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return model.module
    inner = model._modules.get("_forward_module")  # Lightning Fabric's fabric.setup(model)
    if type(model).__name__ == "_FabricModule" and isinstance(inner, nn.Module):
        return inner
    return model


def ddp_wrapper(model: nn.Module) -> Optional[nn.Module]:
    """The first ``DistributedDataParallel`` among the wrappers :func:`unwrap_model` looks
    through (None: none). Its ``process_group`` holds the ranks holding replicas of the
    model's plain parameters (a data-parallel group of a pipeline x data-parallel job)."""
    while isinstance(model, nn.Module):
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model
        inner = unwrap_model_once(model)
        if inner is model:
            return None
        model = inner
    return None


# the child attributes of wrappers that are left out of names (FSDP1, checkpoint_wrapper,
# torch.compile's OptimizedModule: a submodule compiled in place, ``self.net =
# torch.compile(self.net)``, Lightning's recipe)
_WRAPPED_ATTRS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def clean_name(name: str) -> str:
    """A qualified name without the ``_fsdp_wrapped_module.``,
    ``_checkpoint_wrapped_module.`` and ``_orig_mod.`` segments wrappers insert."""
    if "_wrapped_module" not in name and "_orig_mod" not in name:
        return name
    parts = [p for p in name.split(".") if p not in _WRAPPED_ATTRS]
    return ".".join(parts)


def named_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``model.named_modules()`` with wrapper segments removed from the names; a wrapper
    and the module it wraps share a name, which goes to the wrapped (innermost) module."""
    out: Dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        out[clean_name(name)] = mod  # the wrapped module comes after its wrapper
    return list(out.items())


def module_aliases(model: nn.Module) -> Dict[int, List[str]]:
    """``{id(module): [its names]}`` for the modules reachable by more than one name
    (``self.dec = self.enc``): a selector may name any of them (the first 256 found); hooks
    and records use the one ``named_modules()`` gives."""
    names: Dict[int, List[str]] = {}
    todo: List[Tuple[str, nn.Module, frozenset]] = [("", model, frozenset())]
    while todo:  # every path, as named_modules(remove_duplicate=False) walks, but bounded
        prefix, mod, above = todo.pop()
        seen = names.setdefault(id(mod), [])
        if len(seen) >= _MAX_ALIASES:  # sharing nested at each level has exponentially many
            continue
        seen.append(clean_name(prefix))
        for attr, child in mod._modules.items():
            if child is not None and id(child) not in above:  # (a module holding its parent)
                todo.append((f"{prefix}.{attr}" if prefix else attr, child, above | {id(mod)}))
    return {k: v for k, v in names.items() if len(set(v)) > 1}


_MAX_ALIASES = 256  # names looked at per module


def named_parameters(model: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """``model.named_parameters()`` with wrapper segments removed from the names."""
    return [(clean_name(n), p) for n, p in model.named_parameters()]


def parameter_owners(model: nn.Module) -> Dict[int, List[Tuple[str, nn.Module, str]]]:
    """``{id(parameter): [(owner's name, owner module, attribute), ...]}``, one entry per
    owner (a tied parameter has several), each module once by its first name (a walk of
    every path never ends on a module graph with a cycle), first the owner
    ``named_parameters()`` names it by."""
    owners: Dict[int, List[Tuple[str, nn.Module, str]]] = {}
    for raw, mod in model.named_modules():
        prefix = clean_name(raw)
        for attr, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((prefix, mod, attr))
    return owners


def qualified(prefix: str, attr: str) -> str:
    """``prefix.attr``, or ``attr`` under the root."""
    return f"{prefix}.{attr}" if prefix else attr


def parameter_names(model: nn.Module) -> Dict[int, List[str]]:
    """``{id(parameter): [every name it has]}``, first the one ``named_parameters()`` gives: a
    tied parameter (``lm_head.weight`` is ``wte.weight``) has one per owner, and one per
    name of a shared owner (``module_aliases``)."""
    aliases = module_aliases(model)
    names: Dict[int, List[str]] = {}
    for pid, owners in parameter_owners(model).items():
        got = names[pid] = []
        for prefix, mod, attr in owners:
            for pre in (prefix, *aliases.get(id(mod), ())):
                if qualified(pre, attr) not in got:
                    got.append(qualified(pre, attr))
    return names


def check_strict(who: str, strict) -> None:
    """``strict`` of ``select()`` and ``attach()``: True or False, nothing else."""
    if not isinstance(strict, bool):
        raise TypeError(f"{who}: strict must be True or False, got {strict!r}")


def select(
    model: nn.Module, selector: str, *, strict: bool = False
) -> List[Tuple[str, nn.Module]]:
    """Return the ``[(name, module), ...]`` that ``selector`` picks, in ``named_modules()`` order.

    A dry run: nothing is attached. A selector that matches nothing warns, or raises
    :class:`SelectorError` with ``strict=True``; a term that matches only containers no
    forward calls (an ``nn.ModuleList``) warns.
    """
    result, containers = select_terms(model, selector, strict=strict, stacklevel=3)
    warn_never_called(selector, containers, stacklevel=3)
    return result


def warn_never_called(selector: str, containers: List[List[Tuple[str, nn.Module]]],
                      stacklevel: int) -> None:
    """The warning for each term of ``selector`` that matched only containers with no forward
    (``containers``, from :func:`select_terms`)."""
    for matched in containers:
        shown = ", ".join(f"{n or '<root>'!r} ({type(m).__name__})" for n, m in matched[:3])
        more = f" and {len(matched) - 3} more" if len(matched) > 3 else ""
        first = matched[0][0]
        warnings.warn(
            f"selector {selector!r} matched only {shown}{more}: containers with no forward of "
            "their own, which no forward calls, so hooks on their calls never run (stats, "
            "capture, flops and gradclamp on outputs record nothing for them); select their "
            f"children instead, e.g. '*:{first + '.' if first else ''}*' (params and "
            "gradclamp's params= take their children's parameters as they are)",
            stacklevel=stacklevel + 1)


def select_terms(model: nn.Module, selector: str, *, strict: bool = False, stacklevel: int = 2
                 ) -> Tuple[List[Tuple[str, nn.Module]], List[List[Tuple[str, nn.Module]]]]:
    """:func:`select`, and the matches of each term that matched only containers no forward
    calls (left for the caller to warn about: ``attach`` does where its plugins need calls)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"select() expects a torch.nn.Module, got {type(model).__name__}")
    check_strict("select()", strict)
    model = unwrap_model(model)
    try:
        terms = parse_selector(selector)
    except SelectorError as exc:  # a module name where a class goes ('net.0'): say how to write it
        raise _parse_error_hint(exc, [n for n, _ in named_modules(model)]) from None
    named = named_modules(model)
    aliases = module_aliases(model)
    known = list({k for _, m in named for k in type(m).__mro__})
    module_names = [n for n, _ in named]
    chosen: dict = {}
    containers = []  # the matches of terms that matched only containers no forward calls
    unmatched = []  # terms that match no module (a typo in a name, a class this model lacks)
    for term in terms:
        class_ok = [_class_matcher(selector, p, known, module_names) for p in term.classes]
        name_ok = _name_matcher(selector, term)
        matched = []
        hit = named_hit = False
        for name, mod in named:
            if not name_ok(name) and not any(name_ok(a) for a in aliases.get(id(mod), ())):
                continue
            named_hit = True
            if class_ok and not any(f(mod) for f in class_ok):
                continue
            hit = True
            if term.exclude:
                chosen.pop(name, None)
            else:
                chosen[name] = mod
                matched.append((name, mod))
        if matched and all(_never_called(m) for _, m in matched):
            containers.append(matched)
        if not hit:
            unmatched.append((term, named_hit))
    result = [(n, m) for n, m in named if n in chosen]
    if not result:  # one message, with each term's hint
        msg = f"selector {selector!r} matched no module of {type(model).__name__}"
        if len(terms) == 1 and unmatched:
            msg += _term_hint(selector, terms[0], model, module_names, unmatched[0][1])
        else:
            for term, named_hit in unmatched:
                hint = _term_hint(selector, term, model, module_names, named_hit)
                if hint:
                    msg += f"; its term {_term_text(selector, terms, term)!r}: {hint[2:]}"
        if strict:
            raise SelectorError(selector, 0, msg)
        warnings.warn(msg, stacklevel=stacklevel)
    elif len(terms) > 1:  # (a warning only, also under strict: the selection is not empty)
        for term, named_hit in unmatched:
            msg = _unmatched_term(selector, terms, term, model, module_names, named_hit)
            if msg:
                warnings.warn(msg, stacklevel=stacklevel)
    return result, containers


def _unmatched_term(selector: str, terms: List[_Term], term: _Term, model: nn.Module,
                    names: List[str], named_hit: bool) -> str:
    """The warning for a term of ``selector`` that matches no module, with close names
    where its name pattern matches none (``named_hit``: it does, of other classes); '' for
    the idioms that may match nothing: ``*`` (a model that is one module) and a subtree's
    removal, ``-*:head.*``, where ``head`` has no children."""
    glob = term.name_kind == "glob"
    if glob and term.name_pattern == "*" and not term.classes:
        return ""
    if (glob and term.exclude and term.name_pattern.endswith(".*")
            and any(fnmatch.fnmatchcase(n, term.name_pattern[:-2]) for n in names if n)):
        return ""
    text = _term_text(selector, terms, term)
    msg = (f"selector {selector!r}: its term {text!r} matches no module of {type(model).__name__} "
           f"({'nothing removed' if term.exclude else 'nothing added'})")
    return msg + _term_hint(selector, term, model, names, named_hit)


def _term_text(selector: str, terms: List[_Term], term: _Term) -> str:
    """``term`` as written in ``selector`` (an exclusion with its ``-``)."""
    i = terms.index(term)
    span = selector[term.column:terms[i + 1].column] if i + 1 < len(terms) else selector[term.column:]
    if i + 1 < len(terms) and "," in span:
        span = span[:span.rfind(",")]  # (the comma before the next term)
    text = span.strip()
    return "-" + text if term.exclude and not text.startswith("-") else text


def _term_hint(selector: str, term: _Term, model: nn.Module, names: List[str], named_hit: bool) -> str:
    """Why a term may match nothing, as ``"; ..."`` (``''``: no idea): the root named by
    ``*``, names matched only by modules of other classes, close names, ``|`` in a name."""
    msg = ""
    glob = term.name_kind == "glob"
    if glob and term.name_pattern == "*":
        known = list(type(model).__mro__)
        if any(_class_matcher(selector, p, known)(model) for p in term.classes):
            form = f"{'-' if term.exclude else ''}{'|'.join(p.text for p in term.classes)}:"
            msg += f"; '*' never names the root: it is {'removed' if term.exclude else 'selected'} with {form!r}"
    elif named_hit:
        msg += "; the modules its names match are of other classes"
    elif glob:
        if "|" in term.name_pattern:  # (alternatives of names, as of classes)
            cls = ("-" if term.exclude else "") + ("|".join(p.text for p in term.classes) or "*")
            parts = term.name_pattern.split("|")
            either = ", ".join(f"{cls}:{n}" for n in parts)
            regex = "" if any(c in "*?[" for c in term.name_pattern) else f" or {cls + ':re:' + term.name_pattern!r}"
            return f"; '|' separates class names only: for either name write {either!r}{regex}"
        close = close_matches(term.name_pattern, [n for n in names if n], n=3)
        if close:
            msg += f"; did you mean {' or '.join(repr(c) for c in close)}?"
    return msg


def _never_called(module: nn.Module) -> bool:
    """A container (``ModuleList``, ``ModuleDict``, ``ParameterList``) no forward can call:
    it has no forward of its own."""
    return getattr(type(module), "forward", None) is nn.Module.forward

