"""One dataclass per template becomes its command line (and its optional YAML file).

    @dataclass
    class Config(RunOptions):  # the options every template shares, declared once below
        learning_rate: float = option(3e-4, "Peak learning rate.", "(0, inf)")

    config = parse_config(Config)  # --learning_rate=1e-4 | --learning-rate 1e-4 | --config run.yaml

Values from a person typing, `wandb agent` (Python `str()` of each sampled value: `True`, `[64, 128]`, sometimes
`64.0` for an int) and YAML files go through the same coercion, so a sweep can set anything a person can.
Precedence: dataclass defaults < `--config` files (in the order given) < other options.

Every number has a range, and strings with fixed values their choices (`option(default, help, range)`);
`check_ranges` refuses anything else, `--help` shows each one, and code below the config trusts them."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import math
import os
import re
import sys
import types
import typing
from typing import Any, Literal, TypeVar, Union

import yaml

from common.errors import UsageError

T = TypeVar("T")

_NONE = {"none", "null"}
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}
_SCALARS = (int, float, str, bool)
_EXPECTED = {int: "an integer", float: "a number", str: "a string", bool: "true/false"}


class ConfigError(UsageError):
    """A command-line option or config-file entry is wrong; the message is one line naming it."""


# What --tracker takes (`tracker_names`); the packages of each (any one will do) and how to install them.
TRACKERS = ("wandb", "tensorboard", "mlflow", "trackio", "none")
TRACKER_PACKAGES = {"wandb": (("wandb",), "pip install wandb"),
                    "tensorboard": (("tensorboard", "tensorboardX"), "pip install tensorboard"),
                    "mlflow": (("mlflow",), "pip install mlflow"), "trackio": (("trackio",), "pip install trackio")}
MIXED_PRECISION_CHOICES = ("auto", "no", "bf16", "fp16")


def option(default: Any, help: str, range: str | tuple | None = None, *, may_change: bool | None = None) -> Any:
    """A config field: its default, its one-line help, the values it may take, and whether a resume may change it.
    `range`: an interval for numbers (`"[1, 1024]"` includes both ends, `"(0, 1)"` neither, `inf` means no bound), or a
    tuple of the choices for a string. Every int and float option needs one. `may_change=True`: how a session runs or is
    watched, not what is trained: a resume may change it (`may_change_on_resume`)."""
    metadata = ({"help": help} | ({"range": range} if range is not None else {})
                | ({"may_change": may_change} if may_change is not None else {}))
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def may_change_on_resume(config_cls: type) -> frozenset[str]:
    """The options of `config_cls` a resume may change (declared `option(..., may_change=True)`); any other
    difference means another run. A field redeclared without `may_change` keeps the policy its nearest base declares."""
    allowed = set()
    for f in dataclasses.fields(config_cls):
        declared = (vars(cls).get("__dataclass_fields__", {}).get(f.name) for cls in config_cls.__mro__)
        policy = next((d.metadata["may_change"] for d in declared if d is not None and "may_change" in d.metadata),
                      False)
        if policy:
            allowed.add(f.name)
    return frozenset(allowed)


@dataclasses.dataclass
class RunOptions:
    """The options every template shares: where a run writes, how it resumes, saves, logs and waits. A template's
    `Config` extends it (and may declare a field again for its own default)."""

    output_dir: str = option("runs/train", "Checkpoints, metrics, status.json and the export go here.", may_change=True)
    seed: int = option(0, "Seeds init, data order and every random draw of training.", "[0, 2147483647]")
    resume: str = option("auto", "auto (newest checkpoint in output_dir), none (start fresh), a checkpoint folder, "
                         "or a run folder (its newest complete checkpoint: --resume runs/x).", may_change=True)
    checkpoint_every_steps: int = option(0, "Also checkpoint every N optimizer steps (0: at evaluations only).",
                                         "[0, inf)", may_change=True)
    keep_last: int = option(3, "Periodic checkpoints to keep (the best is kept apart).", "[1, inf)", may_change=True)
    checkpoint_background: bool = option(True, "Write checkpoints in a background thread while training goes on "
                                         "(false: training waits for each save).", may_change=True)
    stop_after_steps: int = option(0, "End this session after N optimizer steps with a checkpoint (0: never).",
                                   "[0, inf)", may_change=True)
    log_every_steps: int = option(10, "Log the training loss every N optimizer steps.", "[1, inf)", may_change=True)
    tracker: str = option("wandb", "wandb (offline without credentials), tensorboard, mlflow, trackio, several "
                          "comma-separated (tensorboard,mlflow), or none.", may_change=True)
    wandb_project: str = option("training-template",
                                "The run's W&B project, MLflow experiment and trackio project.", may_change=True)
    timeout_s: int = option(600, "Seconds a rank waits for the others before the job fails.", "[1, 604800]",
                            may_change=True)
    mixed_precision: str = option("auto", "auto (bf16 > fp16 > none, by hardware), no, bf16, fp16.",
                                  MIXED_PRECISION_CHOICES)

    def __post_init__(self):
        check_ranges(self)
        check_trackers(self.tracker)
        check_wandb_project(self.wandb_project)


def tracker_names(value: str) -> list[str]:
    """The trackers a --tracker value names, in order: `none` is the empty list. Refuses (ValueError) an unknown
    name, one named twice, or none with others."""
    names = [name.strip() for name in value.split(",")]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown or len(set(names)) != len(names) or ("none" in names and len(names) > 1):
        raise ValueError(f"tracker must be one or several (comma-separated) of {', '.join(TRACKERS[:-1])}, or none; "
                         f"got {value!r}")
    return [name for name in names if name != "none"]


def check_trackers(value: str) -> None:
    """Refuse (ValueError) --tracker values that name no tracker, or a tracker whose package is not installed:
    found without importing it (a tracker's package loads only in a run that uses it)."""
    for name in tracker_names(value):
        modules, install = TRACKER_PACKAGES[name]
        found = False
        for module in modules:
            try:
                found = found or importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):  # a module that is half there, or one taken out of sys.modules
                pass
        if not found:
            raise ValueError(f"--tracker {name} needs the {modules[0]} package, which is not installed: {install} "
                             f"(or choose another --tracker)")


def check_wandb_project(project: str) -> None:
    """Refuse (ValueError) a project name that wandb.init would refuse, but only after the run folder is written."""
    if not 1 <= len(project) <= 128 or set(project) & set("/\\#?%:"):
        raise ValueError(f"wandb_project {project!r}: W&B takes 1 to 128 characters, none of / \\ # ? % :")


def parse_config(config_cls: type[T], argv: list[str] | None = None) -> T:
    """Build `config_cls` from its defaults, then `--config` YAML files, then `--key=value` options."""
    if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
        raise TypeError(f"parse_config needs a @dataclass class, got {config_cls!r}")
    field_types = _field_types(config_cls)
    argv = sys.argv[1:] if argv is None else list(argv)
    # Help wins over any other mistake on the line: someone asking for help wants the listing.
    if "-h" in argv or "--help" in argv:
        try:
            print(format_help(config_cls), flush=True)
        except BrokenPipeError:  # `--help | head` stopped reading: fine, and nothing more to say at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)

    files, given = _split_argv(argv, field_types)
    from_files: dict[str, tuple[Any, str]] = {}
    for path in files:
        for key, value in _load_yaml(path).items():
            name = str(key).replace("-", "_")
            if name not in field_types:
                hint = _did_you_mean(name, field_types, "")
                raise ConfigError(f"config file {path}: unknown key {str(key)!r}{hint}")
            from_files[name] = (value, f"config file {path}: {key}")
    given = {**from_files, **given}

    missing = [f"--{f.name}" for f in dataclasses.fields(config_cls)
               if f.name in field_types and f.name not in given and _default(f) is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"missing required option {', '.join(missing)}")

    kwargs = {name: _coerce(field_types[name], value, where) for name, (value, where) in given.items()}
    try:
        return config_cls(**kwargs)
    except ValueError as error:  # range checks in the template's __post_init__
        message = " ".join(str(error).split("\n")).strip() or f"invalid {config_cls.__name__}"
        raise ConfigError(message) from error


def config_to_dict(config: Any) -> dict:
    """The config as a plain JSON-able dict, for logging and run metadata."""
    return dataclasses.asdict(config)


def check_ranges(config: Any) -> None:
    """Refuse (ValueError) a value of `config` outside its field's range (`option`): a float whose range has an
    `inf` end (never included) must be finite, NaN never passes. An int or float field without a range: TypeError."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        tp, _ = _unwrap_optional(hints[f.name])
        value, allowed = getattr(config, f.name), f.metadata.get("range")
        if isinstance(allowed, tuple):
            if value not in allowed:
                raise ValueError(f"{f.name} must be one of {', '.join(map(str, allowed))}, got {value!r}")
            continue
        if tp not in (int, float):
            continue
        if allowed is None:
            raise TypeError(f"{type(config).__name__}.{f.name}: an int or float option needs a range")
        if value is None:
            continue
        low_open, low, high, high_open = _interval(allowed)
        if tp is float and not math.isfinite(value) and (math.isinf(low) or math.isinf(high)):
            raise ValueError(f"{f.name} must be a finite number, got {value}")
        below = not (value > low if low_open else value >= low)
        above = not (value < high if high_open else value <= high)
        if not (below or above):
            continue
        if tp is float and not (math.isinf(low) or math.isinf(high)):
            expected = f"in {allowed}"
        elif below:
            expected = (">" if low_open else "at least" if tp is int else ">=") + f" {_number(low)}"
        else:
            expected = ("<" if high_open else "at most" if tp is int else "<=") + f" {_number(high)}"
        raise ValueError(f"{f.name} must be {expected}, got {value}")


_INTERVAL = re.compile(r"^([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])$")


def _interval(text: str) -> tuple[bool, float, float, bool]:
    match = _INTERVAL.match(text.strip())
    try:
        low, high = float(match.group(2)), float(match.group(3))
    except (AttributeError, ValueError):
        raise TypeError(f"range {text!r} is not an interval such as [0, 1) or (0, inf)") from None
    if (math.isinf(low) and match.group(1) == "[") or (math.isinf(high) and match.group(4) == "]") or not low < high:
        raise TypeError(f"range {text!r}: infinite ends are never included, and the low end comes first")
    return match.group(1) == "(", low, high, match.group(4) == ")"


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else str(value)


def format_help(config_cls: type) -> str:
    """The `--help` text: every option with its type, default and help."""
    field_types = _field_types(config_cls)
    prog = os.path.basename(sys.argv[0]) or "train.py"
    lines = [f"usage: {prog} [--config FILE] [--option=VALUE ...]", ""]
    doc = (config_cls.__doc__ or "").strip()
    if doc and not doc.startswith(f"{config_cls.__name__}("):  # skip dataclass's generated signature
        lines += [doc.split("\n\n")[0], ""]
    rows = []
    mro = config_cls.__mro__

    def declared_by(f: dataclasses.Field) -> int:  # the most basic class declaring the field: shared ones last
        return max(i for i, cls in enumerate(mro) if f.name in getattr(cls, "__annotations__", {}))

    for f in sorted(dataclasses.fields(config_cls), key=declared_by):  # the template's own options first
        if f.name not in field_types:
            continue
        default = _default(f)
        shown = "required" if default is dataclasses.MISSING else f"default: {default!r}"
        allowed = f.metadata.get("range")
        if allowed is not None:
            shown += f", one of {', '.join(map(str, allowed))}" if isinstance(allowed, tuple) else f", range {allowed}"
        rows.append((f"--{f.name} {_type_name(field_types[f.name])}", shown, f.metadata.get("help", "")))
    rows.append(("--config FILE", "", "YAML mapping of option names to values; the command line wins."))
    rows.append(("-h, --help", "", "Show this message and exit."))
    width = max(len(left) for left, _, _ in rows)
    lines.append("options (write --name=value or --name value; - and _ are interchangeable):")
    for left, shown, help_text in rows:
        lines.append(f"  {left.ljust(width)}  {shown}".rstrip())
        if help_text:
            lines.append(f"      {help_text}")
    return "\n".join(lines)


def _field_types(config_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(config_cls)  # resolves string annotations (`from __future__ import annotations`)
    out = {}
    for f in dataclasses.fields(config_cls):
        if not f.init:
            continue
        if f.name == "config":
            raise TypeError(f"{config_cls.__name__}: field name 'config' is reserved for --config FILE")
        inner, _ = _unwrap_optional(hints[f.name])
        origin, args = typing.get_origin(inner), typing.get_args(inner)
        if not (inner in _SCALARS or (origin is list and len(args) == 1 and args[0] in _SCALARS)
                or (origin is Literal and all(isinstance(a, (str, int)) for a in args))):
            # A template author's mistake, not the user's: fail loudly, not as a usage error.
            raise TypeError(f"{config_cls.__name__}.{f.name}: unsupported type {hints[f.name]!r}")
        out[f.name] = hints[f.name]
    return out


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        rest = [a for a in args if a is not type(None)]
        if len(args) == 2 and len(rest) == 1:
            return rest[0], True
        raise TypeError(f"unsupported union type {tp!r} (only Optional[X] is supported)")
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _unwrap_optional(tp)
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if origin is list:
        name = f"list[{args[0].__name__}]"
    elif origin is Literal:
        name = "{" + ",".join(map(str, args)) + "}"
    else:
        name = inner.__name__
    return f"{name}|none" if optional else name


def _did_you_mean(name: str, candidates: typing.Iterable[str], prefix: str) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _split_argv(argv: list[str], field_types: dict[str, Any]) -> tuple[list[str], dict[str, tuple[Any, str]]]:
    """Return (config files, {field: (raw string, option as written)})."""
    files, given = [], {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r}: positional arguments are not allowed"
                              " (write options as --name=value; see --help)")
        key, has_value, value = token[2:].partition("=")
        name = key.replace("-", "_")
        if name != "config" and name not in field_types:
            raise ConfigError(f"unknown option --{key}{_did_you_mean(name, [*field_types, 'config'], '--')}")
        if not has_value:
            if i < len(argv) and not argv[i].startswith("--"):  # -1 is a value: only `--` marks the next option
                value = argv[i]
                i += 1
            elif name != "config" and _unwrap_optional(field_types[name])[0] is bool:
                value = "true"  # bare --flag
            else:
                raise ConfigError(f"--{key}: missing value")
        if name == "config":
            files.append(value)
        else:
            given[name] = (value, f"--{key}")
    return files, given


def _load_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as file:
            data = yaml.safe_load(file)
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except (OSError, UnicodeDecodeError) as error:  # a directory, no permission, not UTF-8
        reason = getattr(error, "strerror", None) or error
        raise ConfigError(f"config file {path}: cannot read it ({reason})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        reason = getattr(error, "problem", None) or str(error).split("\n")[0]
        raise ConfigError(f"config file {path}: not valid YAML ({reason}{where})") from None
    if data is None:  # an empty file sets nothing
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of option names to values,"
                          f" got a {type(data).__name__}")
    return data


def _coerce(tp: Any, value: Any, where: str) -> Any:
    inner, optional = _unwrap_optional(tp)
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in _NONE)):
        return None
    origin = typing.get_origin(inner)
    if origin is list:
        return [_scalar(typing.get_args(inner)[0], item, where) for item in _as_list(value)]
    if origin is Literal:
        choices = typing.get_args(inner)
        if not isinstance(value, (list, dict)):
            for choice in choices:  # compare as text: a YAML 1 and a CLI "1" both match Literal[1]
                if str(value).strip() == str(choice):
                    return choice
        raise ConfigError(f"{where}: expected one of {', '.join(map(str, choices))}, got {value!r}")
    return _scalar(inner, value, where)


def _as_list(value: Any) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    if not isinstance(value, str):
        return [value]  # a YAML scalar for a list field
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        try:  # wandb agent passes str() of a list: "[64, 128]" or "['a', 'b']"
            parsed = ast.literal_eval(text)
            if isinstance(parsed, list):
                return parsed
        except (ValueError, SyntaxError):
            pass
        text = text[1:-1]  # unquoted strings, "[a, b]"
    return [part.strip() for part in text.split(",")] if text.strip() else []


def _scalar(tp: type, value: Any, where: str) -> Any:
    if value is not None and not isinstance(value, (list, tuple, dict)):
        # Non-strings (YAML, literal_eval) as their text: every source follows the same rules (PyYAML's "1e-4" too)
        text = value if isinstance(value, str) else str(value)
        if tp is str:
            return text
        text = text.strip()
        if tp is bool and text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        if tp is int:
            try:
                return int(text)
            except ValueError:
                pass
            try:  # wandb's bayes sampler can emit 64.0 for an int parameter
                number = float(text)
                if math.isfinite(number) and number.is_integer():
                    return int(number)
            except ValueError:
                pass
        if tp is float:
            try:
                return float(text)
            except ValueError:
                pass
    raise ConfigError(f"{where}: expected {_EXPECTED[tp]}, got {value!r}")
