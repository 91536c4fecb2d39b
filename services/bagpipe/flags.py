"""Command-line flags declared once, on the config dataclass a service runs with.

A field declared with :func:`flag` is a flag: its name (``--failure-timeout`` for ``failure_timeout``, or
``name=``), its help, its default (the field's), how its text is read (``parse``), its choices, and
whether it repeats (a ``tuple`` field without ``parse``: one value per occurrence). The rules about values
stay in the dataclass's ``__post_init__``, the one place they are written; a ``ValueError`` it raises
names the field (``"failure_timeout: must be > 0, got 0"``), and :func:`parse` reports it under the flag's
name.

Two hooks serve flags whose value depends on others: ``read(value, args)`` turns what was parsed into the
field's value (``--table-rows`` left out: the source's default tables, scaled by ``--scale``), and
``adds(parser)`` declares the helper flags such a ``read`` uses (``--scale``), which are no field.

A flag several configs share is declared by one function returning its :func:`flag` (``config_args``),
which each config calls for its field.

From the declarations come the service's parser (:func:`parser`), its config from parsed arguments
(:func:`config_of`) and the command line that gives a config back (:func:`argv`), which is how ``bagpipe
run`` and the chart hand each process its config. A field whose type is itself such a dataclass (the
``Coordination`` every service shares) adds its flags as a group.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

C = TypeVar("C")
_KEY = "bagpipe.flag"


@dataclasses.dataclass(frozen=True)
class Flag:
    help: str
    name: str | None = None  # default: the field's, with dashes
    parse: Callable[[str], Any] | None = None  # default: the field's type (int, float, str)
    choices: tuple[str, ...] | None = None  # (of the text, before ``parse``)
    metavar: str | None = None
    show: Callable[[Any], str] = str  # a value as argv() writes it
    read: Callable[[Any, argparse.Namespace], Any] | None = None  # parsed value -> the field's
    adds: Callable[[Any], None] | None = None  # declares the helper flags ``read`` uses
    # what argparse holds when the flag is absent, where that is not the field's default (``read`` maps it,
    # or the field has none: a positional field a service's parser still defaults)
    text_default: Any = None
    required: bool | None = None  # default: the field has no default
    omit: Callable[[Any, Any], bool] | None = None  # (value, config): argv() leaves the flag out
    aliases: tuple[str, ...] = ()  # other names the parser takes (``--num-shards``)
    # a field made of other flags only (``adds`` declares them, ``read`` makes the value, ``write`` gives
    # its flags back), with no option of its own: a trainer's model, from --model, --embedding-dim, ...
    write: Callable[[Any], list[str]] | None = None


def flag(
    help: str,  # noqa: A002
    *,
    default: Any = dataclasses.MISSING,
    name: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    show: Callable[[Any], str] = str,
    read: Callable[[Any, argparse.Namespace], Any] | None = None,
    adds: Callable[[Any], None] | None = None,
    text_default: Any = None,
    required: bool | None = None,
    omit: Callable[[Any, Any], bool] | None = None,
    aliases: Sequence[str] = (),
    write: Callable[[Any], list[str]] | None = None,
) -> Any:
    """A dataclass field that is also a command-line flag (no default: the flag is required, unless
    ``required=False`` and ``read`` makes the value from the others)."""
    meta = Flag(
        help=help,
        name=name,
        parse=parse,
        choices=tuple(choices) if choices else None,
        metavar=metavar,
        show=show,
        read=read,
        adds=adds,
        text_default=text_default,
        required=required,
        omit=omit,
        aliases=tuple(aliases),
        write=write,
    )
    return dataclasses.field(default=default, metadata={_KEY: meta})


def like(cls: type, field: str, /, **changes: Any) -> Any:
    """A field declared as ``cls``'s field ``field`` is, for a config that takes the same flag (``bagpipe
    run``'s ``RunConfig`` takes the services' flags): its default, help and reading, each of ``changes``
    (``default``, or any attribute of :class:`Flag`) replacing the original's."""
    original = next(f for f in dataclasses.fields(cls) if f.name == field)
    default = changes.pop("default", original.default)
    meta = dataclasses.replace(original.metadata[_KEY], **changes)
    return dataclasses.field(default=default, metadata={_KEY: meta})


def add_grouped(p: Any, cls: type, groups: Mapping[str, Sequence[str]]) -> None:
    """Adds ``cls``'s flags to ``p`` in argument groups (title: the fields in it); every field of ``cls``
    that is a flag must be in one group."""
    named = [name for names in groups.values() for name in names]
    missing = [f.name for f, _, _ in _flags(cls) if f.name not in named]
    if missing or len(named) != len(set(named)):
        raise TypeError(f"{cls.__name__}: fields in no group or in two: {missing or named}")
    for title, names in groups.items():
        add_flags(p.add_argument_group(title), cls, only=names)


def group() -> Any:
    """A nested config's field without a default (its flags join the parser as a group). Spelled so,
    not bare, because the field after it may be a flag: to a type checker a ``flag(...)`` is a default."""
    return dataclasses.field()


def _flags(cls: type) -> list[tuple[dataclasses.Field[Any], Flag | None, Any]]:
    """(field, its flag or None for a nested config, the field's type) of every declared field."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_KEY)
        if meta is not None:
            out.append((f, meta, hints[f.name]))
        elif dataclasses.is_dataclass(hints[f.name]):
            out.append((f, None, hints[f.name]))
    return out


def option(f: dataclasses.Field[Any], meta: Flag) -> str:
    return "--" + (meta.name or f.name.replace("_", "-"))


def _base(kind: Any) -> Any:
    """``int`` for ``int | None``."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        return _base(args[0])
    return kind


def _repeats(kind: Any, meta: Flag) -> bool:
    return typing.get_origin(_base(kind)) is tuple and meta.parse is None


def _checked(parse: Callable[[str], Any], choices: tuple[str, ...]) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return parse(text)

    return read


def add_flags(p: Any, cls: type, only: Sequence[str] | None = None) -> None:
    """Adds the flags ``cls`` declares (``only`` these fields, if given), and those of its nested configs
    as groups, to ``p`` (a parser or an argument group)."""
    for f, meta, kind in _flags(cls):
        if only is not None and f.name not in only:
            continue
        if meta is None:
            add_flags(p.add_argument_group(kind.__name__.lower()), kind)
            continue
        if meta.adds is not None:
            meta.adds(p)
        if meta.write is not None:
            continue  # (made of the flags ``adds`` declared)
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        absent = meta.text_default is not None  # (the parser's own default stands in)
        required = meta.required if meta.required is not None else not (has_default or absent)
        base = _base(kind)
        if base is bool and meta.parse is None:
            p.add_argument(
                option(f, meta), action=argparse.BooleanOptionalAction, default=f.default, help=meta.help
            )
            continue
        repeats = _repeats(kind, meta)
        convert = meta.parse or (typing.get_args(base)[0] if repeats else base)
        if meta.choices and meta.parse is not None:
            convert, choices = _checked(meta.parse, meta.choices), None
        else:
            choices = meta.choices
        if meta.text_default is not None or meta.read is not None:
            default = shown = meta.text_default
        else:
            default = shown = f.default if has_default else None
        p.add_argument(
            option(f, meta),
            *meta.aliases,
            dest=f.name if meta.name is None else None,
            type=convert,
            required=required,
            default=[] if repeats else default,
            action="append" if repeats else "store",
            choices=choices,
            metavar=meta.metavar
            or ("{" + ",".join(meta.choices) + "}" if meta.choices and not choices else None),
            help=meta.help + ("" if required or repeats or shown in (None, ()) else f" (default {shown})"),
        )


def check(config: Any) -> None:
    """Checks each flag's value in ``config`` as its flag would read it (a config built in Python, not
    parsed): its type, its reader's rule (``positive_int``: >= 1) and its choices. Lists become the tuples
    the field holds. ValueError names the field: ``"trainers: must be >= 1, got 0"``."""
    for f, meta, kind in _flags(type(config)):
        if meta is None or meta.read is not None or meta.write is not None:
            continue
        value = getattr(config, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue  # (as declared)
        base = _base(kind)
        if isinstance(value, list) and typing.get_origin(base) is tuple:
            value = tuple(value)
            object.__setattr__(config, f.name, value)
        if value is None:
            if base is not kind:  # (optional)
                continue
            raise ValueError(f"{f.name}: needs a value")
        expected = typing.get_origin(base) or base
        if expected is float:
            expected = (int, float)
        if not isinstance(value, expected) or (isinstance(value, bool) and base is not bool):
            raise ValueError(f"{f.name}: expected {getattr(base, '__name__', base)}, got {value!r}")
        items = value if _repeats(kind, meta) else (value,)
        for item in items:
            text = meta.show(item)
            if meta.choices and text not in meta.choices:
                raise ValueError(f"{f.name}: expected one of {', '.join(meta.choices)}, got {item!r}")
            if meta.parse is not None:
                try:
                    meta.parse(text)
                except (argparse.ArgumentTypeError, ValueError) as e:
                    raise ValueError(f"{f.name}: {e}") from None


def parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(p, cls)
    return p


def config_of(cls: type[C], a: argparse.Namespace, **given: Any) -> C:
    """The config ``cls`` from parsed arguments (``given`` fields are not flags of its parser)."""
    values = dict(given)
    for f, meta, kind in _flags(cls):
        if f.name in values:
            continue
        if meta is None:
            values[f.name] = config_of(kind, a)
            continue
        if meta.write is not None and meta.read is not None:
            values[f.name] = meta.read(None, a)
            continue
        value = getattr(a, option(f, meta)[2:].replace("-", "_"))
        if _repeats(kind, meta):
            value = tuple(value)
        values[f.name] = meta.read(value, a) if meta.read is not None else value
    return cls(**values)


def argv(config: Any) -> list[str]:
    """The flags that give ``config`` back through :func:`config_of` (defaults left out)."""
    out: list[str] = []
    for f, meta, kind in _flags(type(config)):
        value = getattr(config, f.name)
        if meta is None:
            out += argv(value)
            continue
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        if meta.omit is not None and meta.omit(value, config):
            continue
        if meta.write is not None:
            out += meta.write(value)
            continue
        name = option(f, meta)
        if _base(kind) is bool and meta.parse is None:
            out.append(name if value else "--no-" + name[2:])
        elif _repeats(kind, meta):
            for item in value:
                out += [name, meta.show(item)]
        elif value is not None:
            out += [name, meta.show(value)]
    return out


def parse(
    cls: type[C],
    p: argparse.ArgumentParser,
    args: list[str] | None = None,
    **given: Any,
) -> C:
    """Parses ``args`` into ``cls``; a rule of the dataclass that refuses a value exits with the parser's
    usage and the flag's name (``--failure-timeout: must be > 0, got 0``)."""
    return from_args(cls, p, p.parse_args(args), **given)


def from_args(cls: type[C], p: argparse.ArgumentParser, a: argparse.Namespace, **given: Any) -> C:
    """``cls`` from what ``p`` parsed; a refused value exits as :func:`parse` says."""
    try:
        return config_of(cls, a, **given)
    except ValueError as e:
        field, sep, why = str(e).partition(": ")
        names = _names(cls)
        p.error(f"{names[field]}: {why}" if sep and field in names else str(e))


class ConfigError(ValueError):
    """A config's value that is refused: ``field`` (as Python names it), ``flag`` (as the command line
    does) and ``why``. Its text is ``"field: why"``, as every config's ``ValueError``."""

    def __init__(self, field: str, flag: str | None, why: str) -> None:
        super().__init__(f"{field}: {why}" if field else why)
        self.field, self.flag, self.why = field, flag, why

    @classmethod
    def of(cls, config: type, error: ValueError) -> ConfigError:
        """``error`` (``"field: why"``) of a rule of ``config`` or of a config it builds."""
        field, sep, why = str(error).partition(": ")
        names = _names(config)
        parts = field.split("/")  # (a rule of two fields: "hot_fraction/hot_share")
        if not sep or not all(part in names for part in parts):
            return cls("", None, str(error))
        return cls(field, "/".join(names[part] for part in parts), why)


def _names(cls: type) -> dict[str, str]:
    """Field name -> its flag, over ``cls`` and its nested configs (a nested rule names its own field)."""
    names: dict[str, str] = {}
    for f, meta, kind in _flags(cls):
        if meta is None:
            names = {**_names(kind), **names}
        else:
            names[f.name] = option(f, meta)
    return names
