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

Where a value comes from, last wins: the field's default; the service's table of a config file (`--config
pdserve.toml`: `[gateway]`, `[prefill]`, `[decode]`, keys named as the flags are, with or without the dashes'
underscores); an environment variable named after the flag (`--max-seqs` -> `PDSERVE_MAX_SEQS`); the flag itself.
`resolve` parses with all four and says which one each value came from (`pdserve config show`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import tomllib
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
    parse: Any = None  # reads the flag's text, where the default's type would not (comma-separated ports)
    repeat: bool = False  # a repeatable flag, its values gathered into a tuple (the default is one)


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
        if spec.repeat:
            group.add_argument(flag, action="append", default=list(default),  # type: ignore[arg-type]
                               dest=field.name, metavar=spec.metavar, help=f"{spec.help} (repeatable)")
            continue
        shown = spec.default_text or "%(default)s"
        group.add_argument(flag, type=spec.parse or type(default), default=default, dest=field.name,
                           metavar=spec.metavar, choices=list(spec.choices) or None,
                           help=f"{spec.help} (default: {shown})")


def read_settings(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """`cls` from the parsed flags of its settings, plus `given` (its fields that are not settings)."""
    return cls(**{field.name: tuple(getattr(args, field.name)) if spec.repeat else getattr(args, field.name)
                  for field, spec in settings(cls)}, **given)


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


ENV_PREFIX = "PDSERVE_"
# Each service's config class, by its role: the role names its table in a config file and its `pdserve config
# show` argument. Named, not imported, so that reading settings loads no service.
ROLES = {"gateway": "gateway.config:GatewayConfig", "prefill": "prefill_service.config:PrefillConfig",
         "decode": "decode_service.config:DecodeConfig"}


def role_of(config_class: type) -> str:
    """The role whose config class this is (its table in a config file)."""
    name = f"{config_class.__module__}:{config_class.__qualname__}"
    for role, path in ROLES.items():
        if path == name:
            return role
    raise LookupError(f"{name} is no service's config class (serving/settings.py ROLES)")


def config_class_of(role: str) -> type:
    """The config class of `role` (imports its service)."""
    module, name = ROLES[role].split(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def env_name(flag: str) -> str:
    """The environment variable that sets a flag's default: `--max-seqs` -> PDSERVE_MAX_SEQS."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option of `parser` that takes a setting, by its flag without dashes (`max-seqs`, `no-kv-shm`)."""
    return {flag.lstrip("-"): action for action in parser._actions if action.dest not in ("help", "config")
            for flag in action.option_strings if flag.startswith("--")}


def _file_defaults(path: str, section: str, options: dict[str, argparse.Action]) -> dict[str, Any]:
    """The `section` table of a TOML config file as argparse defaults (dest -> value)."""
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    unknown_tables = set(document) - set(ROLES)
    if unknown_tables:
        raise ValueError(f"--config {path}: unknown tables {sorted(unknown_tables)}; expected "
                         f"{', '.join(f'[{role}]' for role in ROLES)}")
    table = document.get(section, {})
    defaults: dict[str, Any] = {}
    for key, value in table.items():
        action = options.get(key.replace("_", "-"))
        if action is None:
            raise ValueError(f"--config {path}: [{section}] {key}: no such setting (see {section} --help)")
        if isinstance(action, argparse._StoreFalseAction):
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: [{section}] {key}: expected true or false")
            defaults[action.dest] = not value  # `no-kv-shm = true` turns kv_shm off
        elif isinstance(action, argparse._AppendAction):
            defaults[action.dest] = [str(v) for v in value] if isinstance(value, list) else [str(value)]
        else:
            if isinstance(value, dict | list | bool):
                raise ValueError(f"--config {path}: [{section}] {key} = {value!r}: expected a single value")
            defaults[action.dest] = _converted(action, str(value), f"--config {path}: [{section}] {key}")
    return defaults


def _converted(action: argparse.Action, text: str, where: str) -> Any:
    """`text` as the flag's type would read it; ValueError naming `where` it came from when it cannot."""
    try:
        return action.type(text) if callable(action.type) else text
    except ValueError:
        kind = {"float": "a number", "int": "an integer"}.get(getattr(action.type, "__name__", ""), "another value")
        raise ValueError(f"{where} = {text!r}: expected {kind}") from None


def _env_defaults(options: dict[str, argparse.Action]) -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    for flag, action in options.items():
        value = os.environ.get(env_name(flag))
        if value is None:
            continue
        if isinstance(action, argparse._StoreFalseAction):
            if value.lower() not in ("1", "true", "yes", "0", "false", "no", ""):
                raise ValueError(f"{env_name(flag)}={value!r}: expected true or false")
            defaults[action.dest] = value.lower() not in ("1", "true", "yes")
        elif isinstance(action, argparse._AppendAction):
            defaults[action.dest] = [v for v in value.split(",") if v]
        else:
            defaults[action.dest] = _converted(action, value, env_name(flag))
    return defaults


def resolve(parser: argparse.ArgumentParser, section: str, argv: list[str] | None
            ) -> tuple[argparse.Namespace, dict[str, str]]:
    """Parse `argv` over the defaults of a config file's `section`, then the environment; return the namespace
    and where each value came from ("default", "file", "env" or "flag"), by dest. ValueError names what is
    wrong (argparse itself exits on a malformed flag)."""
    parser.add_argument("--config", default=os.environ.get(ENV_PREFIX + "CONFIG", ""), metavar="FILE",
                        help=f"a TOML file whose [{section}] table sets defaults, keyed by flag name; the "
                        f"environment (PDSERVE_<FLAG>) and flags override it (default: ${ENV_PREFIX}CONFIG)")
    config, _ = parser.parse_known_args(argv)  # only --config matters here; the full parse below checks the rest
    options = _options(parser)
    sources = {action.dest: "default" for action in options.values()}
    layers = [("file", _file_defaults(config.config, section, options) if config.config else {}),
              ("env", _env_defaults(options))]
    for source, defaults in layers:
        parser.set_defaults(**defaults)
        sources.update(dict.fromkeys(defaults, source))
    given = argparse.ArgumentParser(add_help=False)  # which dests the command line itself sets
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            kwargs: dict[str, Any] = {"dest": action.dest, "default": argparse.SUPPRESS}
            if action.nargs == 0 or isinstance(action, argparse._StoreConstAction):
                kwargs["action"] = "store_const"
                kwargs["const"] = action.const if action.const is not None else True
            elif isinstance(action, argparse._AppendAction):
                kwargs["action"] = "append"
            given.add_argument(*action.option_strings, **kwargs)
    explicit, _ = given.parse_known_args(argv)
    sources.update(dict.fromkeys(vars(explicit), "flag"))
    sources.pop("config", None)
    # A repeatable flag on the command line replaces the file's or the environment's list, not adds to it.
    parser.set_defaults(**{action.dest: [] for action in options.values()
                           if isinstance(action, argparse._AppendAction) and action.dest in vars(explicit)})
    return parser.parse_args(argv), sources
