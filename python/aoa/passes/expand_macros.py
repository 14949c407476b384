"""Expand the template macros: `$LAYER_ID_OFFSET`, `$LAYER_ID` / `$EXPERT_ID`, `NAME[a:b]`, `*`.

These turn one written statement into zero or more statements over concrete names, using
the key sets of the source and destination (spec 5.2-5.5). They work on IR names, never on
re-joined token text, so two names stay two names (spec 0.4). The layout macros that need
shard counts (`^T`, `fused_*`) run later, after the chains are resolved (expand_fused.py).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from aoa.errors import MacroError
from aoa.ir import (
    ATTRIBUTE_KEYWORDS,
    Name,
    Origin,
    Program,
    Statement,
    make_name,
    make_statement,
)
from aoa.limits import MAX_MACRO_NAMES, MAX_TEMPLATE_INSTANCES
from aoa.passes.context import CompileContext

NAME = "expand_macros"

LAYER_ID_OFFSET = "$LAYER_ID_OFFSET"


_LAST_DIGIT = re.compile(r".*\d", re.DOTALL)
#: what the text past a key's last digit is mostly made of: stripped first, the rest of the
#: key then ends with that digit, or has none (`\d` and `str.isdecimal` both mean Nd)
_WORD_CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ._"


def _tail(text: str) -> str:
    """What follows the last digit of ``text`` (all of it, where it has none)."""
    kept = text.rstrip(_WORD_CHARACTERS)
    if not kept or kept[-1].isdecimal():
        return text[len(kept):]
    found = _LAST_DIGIT.match(text)
    return text[found.end():] if found else text


class _SortedKeys:
    """Keys sorted once, so a template only scans the keys that share its literal prefix,
    or those that end as it does."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = sorted(keys)

    def with_prefix(self, prefix: str) -> list[str]:
        start = bisect.bisect_left(self.keys, prefix)
        end = bisect.bisect_left(self.keys, prefix + "\U0010ffff")
        return self.keys[start:end]

    @functools.cached_property
    def _by_tail(self) -> dict[str, list[str]]:
        by_tail: dict[str, list[str]] = {}
        last_digit = _LAST_DIGIT.match  # `_tail`, inline: a model has 100k keys
        for key in self.keys:
            kept = key.rstrip(_WORD_CHARACTERS)
            if not kept or kept[-1].isdecimal():
                tail = key[len(kept):]
            else:
                found = last_digit(key)
                tail = key[found.end():] if found else key
            by_tail.setdefault(tail, []).append(key)
        return by_tail

    def ending_as(self, suffix: str) -> list[str]:
        """The keys, in order, that can be an id (digits) followed by ``suffix``: those
        whose text past their last digit is ``suffix``'s (templates share their prefix,
        `model.layers.`, with most keys, but their end with few)."""
        return self._by_tail.get(_tail(suffix), [])


class _Template(NamedTuple):
    """A name with $LAYER_ID / $EXPERT_ID (without `^T`) as a pattern over keys."""

    #: the placeholders in the order they first appear (the regex's groups)
    placeholders: tuple[str, ...]
    #: the text before the first placeholder and after the last one
    prefix: str
    suffix: str
    #: the whole pattern; None for one placeholder, matched by prefix, digits and suffix
    regex: re.Pattern | None


def _template(base: str) -> _Template:
    if base.count("$LAYER_ID") + base.count("$EXPERT_ID") == 1:
        placeholder = "$LAYER_ID" if "$LAYER_ID" in base else "$EXPERT_ID"
        prefix, suffix = base.split(placeholder)
        return _Template((placeholder,), prefix, suffix, None)
    parts = re.split(r"(\$EXPERT_ID|\$LAYER_ID)", base)
    regex, found = "", []
    for index, part in enumerate(parts):
        if index % 2 == 0:
            regex += re.escape(part)
        elif part in found:  # the same id twice in one name: both places agree
            regex += f"(?P={part[1:]})"
        else:
            found.append(part)
            regex += f"(?P<{part[1:]}>\\d+)"
    return _Template(tuple(found), parts[0], parts[-1], re.compile(regex))


def _names(statement: Statement) -> tuple[Name, ...]:
    return statement.left + statement.right


def _spelled_as_keyword(name: Name) -> bool:
    """Whether ``name`` is spelled as one of Paddle's attribute keywords (`axis`, `dtype`,
    ...). Paddle's macros cannot tell such a tensor from an attribute (quirk Q21): its
    $LAYER_ID_OFFSET leaves the name without the tag, and its $LAYER_ID / $EXPERT_ID asks
    the placeholders only of the names before it; the names from it on are taken as
    written in every instance (`layers.$LAYER_ID.w, axis -> x.$LAYER_ID.w, axis=0` joins
    the one tensor `axis` to each layer's). aoa takes those programs as Paddle does."""
    return name.array is None and name.text in ATTRIBUTE_KEYWORDS


def _id_format(text: str, placeholders: tuple[str, ...]) -> str | None:
    """A name with $LAYER_ID / $EXPERT_ID as a format string, so each of a template's
    thousands of instances costs one `format_map` (None: the name has no placeholder)."""
    if not any(p in text for p in placeholders):
        return None
    text = text.replace("{", "{{").replace("}", "}}")
    for placeholder in placeholders:
        text = text.replace(placeholder, "{" + placeholder[1:] + "}")
    return text


class _Expander:
    def __init__(self, ctx: CompileContext) -> None:
        self.ctx = ctx
        #: the statements expanded so far, of which `produced()` tells the names written
        self.expanded: list[Statement] = []
        self._produced: set[str] = set()
        self._produced_upto = 0  # how many of `expanded` _produced covers
        self._produced_keys: _SortedKeys | None = None  # _produced sorted, when asked

    @functools.cached_property
    def source_keys(self) -> _SortedKeys:
        return _SortedKeys(self.ctx.source_keys)

    @functools.cached_property
    def destination_keys(self) -> _SortedKeys:  # sorted only when a `*` asks
        return _SortedKeys(self.ctx.destination_keys)

    def expand(self, statement: Statement) -> list[Statement]:
        left, right = statement.left, statement.right
        if len(left) == 1 and len(right) == 1:  # the usual: a rename, a cast, a ^T
            (source,), (target,) = left, right
            if not (source.array or target.array):
                renamed = self._renamed(statement, source.text, target.text)
                if renamed is not None:
                    self.expanded += renamed
                    return renamed
        names = left + right
        texts = "\n".join([n.text for n in names])  # names hold no newline
        macros = []
        if LAYER_ID_OFFSET in texts:
            macros.append(self.layer_id_offset)
        if "$LAYER_ID" in texts or "$EXPERT_ID" in texts:  # what $LAYER_ID_OFFSET leaves too
            macros.append(self.ids)
        # filling in ids and offsets makes no `[a:b]` and no `*`: a statement without them
        # skips those two macros for all of its (maybe thousands of) instances
        if any([n.array for n in names]):
            macros.append(self.arrays)
        if "*" in texts:
            macros.append(self.stars)
        if not macros:
            self.expanded.append(statement)
            return [statement]
        result = macros[0](statement)
        for macro in macros[1:]:
            result = [out for s in result for out in macro(s)]
        self.expanded += result
        return result

    def _renamed(self, statement: Statement, source: str, target: str
                 ) -> list[Statement] | None:
        """A statement of one name a side and no `[a:b]`: itself when no macro is in its
        names, its instances when it is a template of one `$LAYER_ID` or `$EXPERT_ID` in
        both names; None for anything else (`ids` and the other macros take it: they
        give the same instances, and any error)."""
        texts = source + target
        if "$" not in texts and "*" not in texts:
            return [statement]
        if "*" in texts or LAYER_ID_OFFSET in texts:
            return None
        pattern = target if self.ctx.reverse or "_ID" not in source else source
        placeholder = "$LAYER_ID" if "$LAYER_ID" in pattern else "$EXPERT_ID"
        if (pattern.count("$") != 1 or placeholder not in pattern or source.count("$") != 1
                or target.count("$") != 1 or placeholder not in source
                or placeholder not in target):
            return None
        base = pattern[:-2] if pattern.endswith("^T") else pattern
        prefix, suffix = base.split(placeholder)
        numbers = self._numbers_between(prefix, suffix, self.source_keys)
        if not numbers and not self.ctx.reverse and (produced := self.produced()).keys:
            numbers = self._numbers_between(prefix, suffix, produced)
        if not numbers or len(numbers) > MAX_TEMPLATE_INSTANCES:
            return None  # `ids` says so
        source_name, target_name = statement.left[0], statement.right[0]
        source_span, target_span = source_name.span, target_name.span
        attributes, span = statement.attributes, statement.span
        origin = Origin("id", statement)  # one for all instances: they share their parent
        return [make_statement((make_name(source.replace(placeholder, number), source_span),),
                               (make_name(target.replace(placeholder, number), target_span),),
                               attributes, span, origin)
                for number in map(str, sorted(numbers))]

    @staticmethod
    def _numbers_between(prefix: str, suffix: str, keys: _SortedKeys) -> set[int]:
        """The ids of the keys that are ``prefix``, digits, ``suffix`` (`_match_ids` of a
        template of one placeholder)."""
        start, end = len(prefix), len(suffix)
        return set(map(int, [number for key in keys.ending_as(suffix)
                             if key.startswith(prefix) and key.endswith(suffix)
                             and (number := key[start:len(key) - end]).isdecimal()]))

    def produced(self) -> _SortedKeys:
        """Names written by the statements expanded so far (asked only of a template that
        matches no source key, so not worked out for every instance)."""
        new = self.expanded[self._produced_upto:]
        if new or self._produced_keys is None:
            self._produced.update([n.base for s in new
                                   for n in (s.left if self.ctx.reverse else s.right)])
            self._produced_upto = len(self.expanded)
            self._produced_keys = _SortedKeys(self._produced)
        return self._produced_keys

    # $LAYER_ID_OFFSET -------------------------------------------------------------------
    def layer_id_offset(self, statement: Statement) -> list[Statement]:
        names = _names(statement)
        tagged = [n for n in names if LAYER_ID_OFFSET in n.text]
        if not tagged:
            return [statement]
        for name in names:
            if LAYER_ID_OFFSET not in name.text and not _spelled_as_keyword(name):
                raise MacroError(
                    f"'{name.text}' lacks {LAYER_ID_OFFSET}, which every name of this "
                    "statement must carry", name.span,
                    hint="Write the tag in every name, or split the statement in two.")
        side = statement.right if self.ctx.reverse else statement.left
        pattern = next((n for n in side if LAYER_ID_OFFSET in n.text), tagged[0])
        prefix, _, suffix = pattern.base.partition(LAYER_ID_OFFSET)
        regex = re.compile(re.escape(prefix) + r"(\d+)" + re.escape(suffix))
        ids = sorted({int(m.group(1)) for key in self.source_keys.with_prefix(prefix)
                      if (m := regex.fullmatch(key))})
        if not ids:
            self.expands_to_nothing(pattern, LAYER_ID_OFFSET)
        result = []
        for layer in ids:
            left_id, right_id = (layer + 1, layer) if self.ctx.reverse else (layer, layer - 1)
            if min(left_id, right_id) < 0:
                raise MacroError(
                    f"source layer {layer} would map to layer -1", pattern.span,
                    hint="$LAYER_ID_OFFSET maps layer n to n-1; start the source at layer 1 "
                         "or map layer 0 with a statement of its own.")
            result.append(statement.derive(
                "layer_id_offset",
                [self._substitute(n, {LAYER_ID_OFFSET: str(left_id)}) for n in statement.left],
                [self._substitute(n, {LAYER_ID_OFFSET: str(right_id)}) for n in statement.right],
                statement.attributes))
        return result

    def expands_to_nothing(self, pattern: Name, *placeholders: str) -> None:
        """A template that matches no key: Paddle drops the statement without a word, and
        the keys it meant to rename then pass on under their own names (a likely typo)."""
        message = f"'{pattern.text}' matches no source key: the statement expands to nothing"
        if not self.ctx.strict:
            self.ctx.note(message, pattern.span)
            return
        example = pattern.base
        for placeholder in placeholders:
            example = example.replace(placeholder, "0")
        import difflib  # (for this message only)

        close = difflib.get_close_matches(example, self.source_keys.keys, n=1)
        like = f" (a source key like it: '{close[0]}')" if close else ""
        raise MacroError(message, pattern.span,
                         hint=f"Check the name against the source keys{like}, or delete the "
                              "statement; --lenient (strict=False) lets it expand to nothing, "
                              "as Paddle does.")

    @staticmethod
    def _substitute(name: Name, values: dict[str, str]) -> Name:
        text = name.text
        for placeholder, value in values.items():
            text = text.replace(placeholder, value)
        return Name(text, name.span, name.array) if text != name.text else name

    # $LAYER_ID / $EXPERT_ID ---------------------------------------------------------------
    def ids(self, statement: Statement) -> list[Statement]:
        names = _names(statement)
        pattern = None
        for name in (statement.right if self.ctx.reverse else names):
            if "$LAYER_ID" in name.text or "$EXPERT_ID" in name.text:
                pattern = name
                break
        if pattern is None:
            if not any("$LAYER_ID" in n.text or "$EXPERT_ID" in n.text for n in names):
                return [statement]
            raise MacroError(
                "in reverse mode the $LAYER_ID / $EXPERT_ID template is taken from the right "
                "of '->', which has none", statement.span,
                hint="Write the placeholder in the names right of '->' too.")
        template = _template(pattern.base)
        found = template.placeholders
        values: dict[str, set[int]] = (
            {found[0]: set()} if len(found) == 1 else {p: set() for p in found})
        matched = self._match_ids(template, self.source_keys, values)
        if not matched and not self.ctx.reverse and (produced := self.produced()).keys:
            # Spec 0.5: a template over temporaries expands over the ids they were made with.
            self._match_ids(template, produced, values)
        marks = [p[1:] for p in found]
        for name in names:
            if _spelled_as_keyword(name):
                break  # (Paddle checks the names before such a one only: Q21)
            text = name.text
            missing = [p for p, mark in zip(found, marks) if mark not in text] if len(
                found) > 1 else (found if marks[0] not in text else ())
            if missing:
                raise MacroError(
                    f"'{name.text}' lacks {', '.join(missing)}, which every name of this "
                    "template must carry", name.span,
                    hint="All names of a $LAYER_ID / $EXPERT_ID statement must use the same "
                         "placeholders.")
        ordered = found if len(found) == 1 else tuple(sorted(found))
        instances = math.prod(map(len, values.values()))
        if instances > MAX_TEMPLATE_INSTANCES:
            counts = " times ".join(f"{len(values[p])} {p}" for p in ordered)
            raise MacroError(
                f"'{pattern.text}' would expand to {instances} statements ({counts}), more "
                f"than {MAX_TEMPLATE_INSTANCES}", pattern.span,
                hint="Each placeholder takes every id found for it in the keys; write the "
                     "ids that go together as separate templates.")
        if not instances:
            self.expands_to_nothing(pattern, *found)
        attributes, span = statement.attributes, statement.span
        origin = Origin("id", statement)  # one for all instances: they share their parent
        if len(ordered) == 1:
            (placeholder,) = ordered
            numbers = list(map(str, sorted(values[placeholder])))

            def column(name: Name) -> list[Name]:
                """The name in every instance, one template name at a time."""
                text, span, array = name.text, name.span, name.array
                if placeholder not in text:
                    return [name] * len(numbers)
                return [make_name(text.replace(placeholder, number), span, array)
                        for number in numbers]
        else:
            fields = [p[1:] for p in ordered]
            filled = [dict(zip(fields, combination)) for combination in itertools.product(
                *(list(map(str, sorted(values[p]))) for p in ordered))]

            def column(name: Name) -> list[Name]:
                """The name in every instance, one template name at a time."""
                text_format = _id_format(name.text, ordered)
                if text_format is None:
                    return [name] * len(filled)
                return [make_name(text, name.span, name.array)
                        for text in map(text_format.format_map, filled)]

        # both sides hold a name at least (the grammar's), so zip makes every instance
        lefts = zip(*map(column, statement.left))
        rights = zip(*map(column, statement.right))
        return [make_statement(left, right, attributes, span, origin)
                for left, right in zip(lefts, rights)]

    @staticmethod
    def _match_ids(template: _Template, keys: _SortedKeys, values: dict[str, set[int]]
                   ) -> bool:
        prefix, suffix = template.prefix, template.suffix
        candidates = keys.ending_as(suffix)
        if template.regex is None:  # prefix, digits, suffix
            start, end = len(prefix), len(suffix)
            numbers = [number for key in candidates
                       if key.startswith(prefix) and key.endswith(suffix)
                       and (number := key[start:len(key) - end]).isdecimal()]
            values[template.placeholders[0]].update(map(int, numbers))
            return bool(numbers)
        fullmatch = template.regex.fullmatch
        found = [m.groups() for key in candidates
                 if key.startswith(prefix) and (m := fullmatch(key))]
        for index, value_set in enumerate(values.values()):
            value_set.update(map(int, {row[index] for row in found}))
        return bool(found)

    # NAME[a:b] ----------------------------------------------------------------------------
    def arrays(self, statement: Statement) -> list[Statement]:
        if not any(n.array for n in _names(statement)):
            return [statement]

        def expand(names: Sequence[Name]) -> list[Name]:
            out = []
            for name in names:
                if name.array is None:
                    out.append(name)
                    continue
                start, end = name.array
                if start >= end:
                    raise MacroError(f"'{name}' is an empty range", name.span,
                                     hint="NAME[a:b] names NAME_a ... NAME_(b-1); b must be "
                                          "greater than a.")
                if end - start > MAX_MACRO_NAMES:
                    raise MacroError(f"'{name}' names {end - start} tensors, more than "
                                     f"{MAX_MACRO_NAMES}", name.span,
                                     hint="NAME[a:b] names NAME_a ... NAME_(b-1), one tensor "
                                          "each.")
                out.extend(Name(f"{name.text}_{i}", name.span) for i in range(start, end))
            return out

        return [statement.derive("array", expand(statement.left), expand(statement.right),
                                 statement.attributes)]

    # * ------------------------------------------------------------------------------------
    def stars(self, statement: Statement) -> list[Statement]:
        if not any("*" in n.text for n in _names(statement)):
            return [statement]
        left_keys, right_keys = ((self.destination_keys, self.source_keys) if self.ctx.reverse
                                 else (self.source_keys, self.destination_keys))
        left_what, right_what = (("destination", "source") if self.ctx.reverse
                                 else ("source", "destination"))
        return [statement.derive("star", self._star(statement.left, left_keys, left_what),
                                 self._star(statement.right, right_keys, right_what),
                                 statement.attributes)]

    def _star(self, names: Sequence[Name], keys: _SortedKeys, what: str) -> list[Name]:
        out = []
        for name in names:
            if "*" not in name.text:
                out.append(name)
                continue
            if name.text.count("*") > 1:
                raise MacroError(f"'{name.text}' has more than one '*'", name.span,
                                 hint="A name may hold one '*', which matches a number.")
            prefix, suffix = name.text.split("*")
            transposed = suffix.endswith("^T")
            if transposed:
                suffix = suffix[:-2]
            regex = re.compile(re.escape(prefix) + r"(\d+)" + re.escape(suffix))
            matches = sorted((int(m.group(1)), key) for key in keys.with_prefix(prefix)
                              if (m := regex.fullmatch(key)))
            if not matches:
                raise MacroError(
                    f"'{name.text}' matches no {what} key", name.span,
                    hint=f"'*' stands for a number in a {what} key; check the name against "
                         f"the {what} keys.")
            out.extend(Name(key + ("^T" if transposed else ""), name.span)
                       for _, key in matches)
        return out


def run(program: Program, ctx: CompileContext) -> Program:
    expander = _Expander(ctx)
    for statement in program.statements:
        expander.expand(statement)
    return Program(tuple(expander.expanded))
