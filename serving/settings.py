"""Settings written once. A config dataclass's field carries its command-line flag, its help and its bounds; the
argparse group, the bounds check and the reading back of parsed flags are generated from it:

    @dataclass(frozen=True)
    class DecodeConfig:
        max_seqs: int = setting(64, "sequences decoded at once", low=1)

        def __post_init__(self) -> None:
            check_settings(self)

    add_settings(parser.add_argument_group("decode"), DecodeConfig)
    config = read_settings(DecodeConfig, parser.parse_args(), server=..., model=...)

A flag is `--` and the field's name with dashes unless `flag=` names it; its argparse dest is the field's name.
A bool that is on by default gets a `flag=` that turns it off (`--no-kv-shm`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    help: str
    flag: str = ""  # default: --field-name
    low: float | None = None  # the least value allowed
    above: float | None = None  # values must be greater than this
    high: float | None = None  # the greatest value allowed
    choices: tuple[Any, ...] = ()
    metavar: str | None = None
    default_text: str = ""  # how --help shows the default, when the value alone would not say it


def setting(default: Any, help: str, **spec: Any) -> Any:
    """A dataclass field with a default and the flag that sets it (see `Setting` for `spec`)."""
    return dataclasses.field(default=default, metadata={"setting": Setting(help, **spec)})


def settings(cls: type) -> Iterator[tuple[dataclasses.Field, Setting]]:
    for field in dataclasses.fields(cls):
        spec = field.metadata.get("setting")
        if spec is not None:
            yield field, spec


def flag_of(field: dataclasses.Field, spec: Setting) -> str:
    return spec.flag or "--" + field.name.replace("_", "-")


def add_settings(group: argparse._ActionsContainer, cls: type) -> None:
    """One flag per setting of `cls`, its default the field's."""
    for field, spec in settings(cls):
        flag, default = flag_of(field, spec), field.default
        if isinstance(default, bool):
            if not default or not spec.flag:
                raise TypeError(f"{cls.__name__}.{field.name}: a bool setting is on by default and names the flag "
                                "that turns it off")
            group.add_argument(flag, action="store_false", dest=field.name, help=spec.help)
            continue
        shown = spec.default_text or "%(default)s"
        group.add_argument(flag, type=type(default), default=default, dest=field.name, metavar=spec.metavar,
                           choices=list(spec.choices) or None, help=f"{spec.help} (default: {shown})")


def read_settings(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """`cls` from the parsed flags of its settings, plus `given` (its fields that are not settings)."""
    return cls(**{field.name: getattr(args, field.name) for field, _ in settings(cls)}, **given)


def check_settings(config: Any) -> None:
    """ValueError naming the flag of the first setting out of its bounds (NaN is out of any)."""
    for field, spec in settings(type(config)):
        value = getattr(config, field.name)
        if spec.choices and value not in spec.choices:
            raise ValueError(f"{flag_of(field, spec)} {value!r}: expected one of {', '.join(map(repr, spec.choices))}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        bounds = [f">= {spec.low:g}" if spec.low is not None else "", f"> {spec.above:g}" if spec.above is not None
                  else "", f"<= {spec.high:g}" if spec.high is not None else ""]
        if (math.isnan(value) or (spec.low is not None and value < spec.low)
                or (spec.above is not None and value <= spec.above) or (spec.high is not None and value > spec.high)):
            raise ValueError(f"{flag_of(field, spec)} {value:g}: must be {' and '.join(b for b in bounds if b)}")
