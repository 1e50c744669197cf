"""Read a W&B sweep file and turn it into what the local runner needs: Optuna suggestions and trial commands.

One sweep YAML (see sweeps/) serves `wandb sweep` + `wandb agent` and `python -m search`.
W&B's own package (`sweeps`, installed by `wandb[sweeps]`) checks the file, so a file this module
accepts is a file W&B accepts. Its distributions map to Optuna like this:

    value (constant)                 passed as is, not searched
    values                           suggest_categorical (lists and dicts as choices too)
    int_uniform                      suggest_int(min, max)
    uniform                          suggest_float(min, max)
    log_uniform_values               suggest_float(min, max, log=True)
    inv_log_uniform_values           the same: its values are log-uniform on [min, max] too
    q_uniform                        suggest_int / suggest_float(min, max, step=q): the grid min, min+q, ...
    q_log_uniform_values             suggest_float(min, max, log=True), then rounded to a multiple of q
                                     as W&B does (an int when q is an int)
    log_uniform, inv_log_uniform,    (min/max as exponents) W&B's own check refuses them: use the
    q_log_uniform                    *_values forms
    categorical_w_probabilities,     refused with an error naming the parameter: Optuna has no
    normal, log_normal, q_normal,    weighted choices and samples only bounded ranges
    q_log_normal, beta, q_beta,
    nested parameters

Trial commands are built the way `wandb agent` builds them (wandb/wandb_agent.py, `_command_run`):
each `${macro}` token of `command` is replaced by its list of words, `${args}` by `--name=value`
with Python's `str()` of each value.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.errors import UsageError

DEFAULT_COMMAND = ["${env}", "${interpreter}", "${program}", "${args}"]  # wandb's default
ARG_MACROS = ("args", "args_no_equals", "args_no_boolean_flags")  # forms the runner can add --output_dir to
_SCALAR_TYPES = (type(None), bool, int, float, str)

# W&B's name for each schema definition in its sweep JSON schema
_DISTRIBUTION = {
    "param_single_value": "constant",
    "param_categorical": "categorical",
    "param_categorical_w_probabilities": "categorical_w_probabilities",
    "param_int_uniform": "int_uniform",
    "param_uniform": "uniform",
    "param_loguniform": "log_uniform",
    "param_loguniform_v2": "log_uniform_values",
    "param_inv_loguniform": "inv_log_uniform",
    "param_inv_loguniform_v2": "inv_log_uniform_values",
    "param_quniform": "q_uniform",
    "param_qloguniform": "q_log_uniform",
    "param_qloguniform_v2": "q_log_uniform_values",
    "param_normal": "normal",
    "param_qnormal": "q_normal",
    "param_lognormal": "log_normal",
    "param_qlognormal": "q_log_normal",
    "param_beta": "beta",
    "param_qbeta": "q_beta",
    "param_dict": "nested parameters",
}
_UNSUPPORTED = {
    "categorical_w_probabilities": "Optuna has no weighted choices; drop `probabilities` or list likely values twice",
    "normal": "Optuna samples only bounded ranges; use uniform with min/max",
    "q_normal": "Optuna samples only bounded ranges; use q_uniform with min/max",
    "log_normal": "Optuna samples only bounded ranges; use log_uniform_values with min/max",
    "q_log_normal": "Optuna samples only bounded ranges; use q_log_uniform_values with min/max",
    "beta": "Optuna has no beta prior; use uniform with min/max",
    "q_beta": "Optuna has no beta prior; use q_uniform with min/max",
    "nested parameters": "the templates take flat --name=value options; flatten it",
}


def _import_sweeps():
    with warnings.catch_warnings():  # the package still uses a pydantic v1 config key
        warnings.simplefilter("ignore")
        import sweeps
        from sweeps.config import schema

    return sweeps, schema


@dataclass
class Param:
    """One sweep parameter and how to draw it with Optuna."""

    name: str
    distribution: str  # W&B's name, e.g. "log_uniform_values"
    spec: dict  # the parameter's YAML entry with W&B's defaults filled in

    @property
    def constant(self) -> bool:
        return self.distribution == "constant"

    def suggest(self, trial) -> Any:
        """Draw this parameter for an Optuna trial; returns the value the template will get."""
        name, spec, kind = self.name, self.spec, self.distribution
        if kind == "constant":
            return spec["value"]
        if kind == "categorical":
            values = spec["values"]
            if all(isinstance(v, _SCALAR_TYPES) for v in values):
                return trial.suggest_categorical(name, values)
            # Optuna choices must be scalars: choose among the JSON texts and decode the pick.
            return json.loads(trial.suggest_categorical(name, [json.dumps(v) for v in values]))
        if kind == "int_uniform":
            return trial.suggest_int(name, spec["min"], spec["max"])
        if kind == "uniform":
            return trial.suggest_float(name, spec["min"], spec["max"])
        if kind in ("log_uniform_values", "inv_log_uniform_values"):
            return trial.suggest_float(name, spec["min"], spec["max"], log=True)
        q = spec.get("q", 1.0)
        if kind == "q_uniform":
            int_bounds = all(isinstance(spec[k], int) and not isinstance(spec[k], bool) for k in ("min", "max"))
            if int_bounds and isinstance(q, int):
                return trial.suggest_int(name, spec["min"], spec["max"], step=q)
            return trial.suggest_float(name, spec["min"], spec["max"], step=q)
        if kind == "q_log_uniform_values":
            # W&B: round(x / q) * q
            value = round(trial.suggest_float(name, spec["min"], spec["max"], log=True) / q) * q
            return int(value) if isinstance(q, int) else float(value)
        raise AssertionError(f"unmapped distribution {kind}")  # load_sweep refuses these

    def grid(self) -> list:
        """The values grid search walks through; only discrete parameters have them."""
        spec, kind = self.spec, self.distribution
        if kind == "constant":
            return [spec["value"]]
        if kind == "categorical":
            return list(spec["values"])
        if kind == "int_uniform":
            return list(range(spec["min"], spec["max"] + 1))
        raise UsageError(f"parameter {self.name}: grid search needs listed values, a constant or int_uniform, "
                         f"not {kind}")


@dataclass
class Sweep:
    """A checked sweep file."""

    path: Path
    config: dict
    metric: str
    goal: str  # "maximize" or "minimize"
    method: str
    program: str | None
    command: list[str]
    params: dict[str, Param] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.config.get("name") or self.path.stem)

    @property
    def direction(self) -> str:
        return self.goal

    @property
    def early_terminate(self) -> dict | None:
        return self.config.get("early_terminate")

    def suggest(self, trial) -> dict[str, Any]:
        """Values for every parameter (constants included), in the file's order."""
        return {name: param.suggest(trial) for name, param in self.params.items()}

    def constants(self) -> dict[str, Any]:
        return {name: p.spec["value"] for name, p in self.params.items() if p.constant}

    def grid_space(self) -> dict[str, list]:
        """Searched parameters and their grids, for method: grid."""
        return {name: p.grid() for name, p in self.params.items() if not p.constant}


def load_sweep(path: str | os.PathLike) -> Sweep:
    """Read and check a sweep YAML; every problem is a UsageError naming the file (and parameter)."""
    path = Path(path)
    where = f"sweep file {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{where}: not found") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"{where}: cannot read it ({getattr(error, 'strerror', None) or error})") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{where}: not valid YAML ({getattr(error, 'problem', None) or error}{at})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{where}: expected a mapping (method, metric, parameters, ...), got {type(config).__name__}")
    parameters = config.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise UsageError(f"{where}: needs a `parameters:` mapping of parameter names to distributions")

    sweeps, schema = _import_sweeps()
    params = {str(name): _check_param(where, str(name), spec, schema) for name, spec in parameters.items()}
    for name, param in params.items():
        if param.distribution in _UNSUPPORTED:
            raise UsageError(f"{where}: parameter {name}: {param.distribution} cannot be searched locally "
                             f"({_UNSUPPORTED[param.distribution]})")
        if name == "output_dir":
            raise UsageError(f"{where}: parameter output_dir: the runners give every trial its own output_dir; "
                             "remove it")
    violations = sweeps.schema_violations_from_proposed_config(config)
    if violations:
        more = f" (and {len(violations) - 1} more problem(s))" if len(violations) > 1 else ""
        raise UsageError(f"{where}: {' '.join(violations[0].split())}{more}")

    metric = config.get("metric")
    if not isinstance(metric, dict) or not metric.get("name"):
        raise UsageError(f"{where}: needs `metric: {{name: ..., goal: maximize|minimize}}` "
                         "naming a metric the template logs")
    command = config.get("command") or list(DEFAULT_COMMAND)
    if not all(isinstance(token, (str, int, float)) for token in command):
        raise UsageError(f"{where}: command must be a list of words")
    command = [str(token) for token in command]
    if not any(token in {f"${{{m}}}" for m in ARG_MACROS} for token in command):
        raise UsageError(f"{where}: command needs ${{args}} (or ${{args_no_equals}}) so each trial gets its options")
    if "${program}" in command and not config.get("program"):
        raise UsageError(f"{where}: command uses ${{program}} but the file sets no `program:`")
    return Sweep(
        path=path,
        config=config,
        metric=str(metric["name"]),
        goal=metric.get("goal", "minimize"),
        method=str(config.get("method")),
        program=config.get("program"),
        command=command,
        params=params,
    )


def _check_param(where: str, name: str, spec: Any, schema) -> Param:
    prefix = f"{where}: parameter {name}"
    if not isinstance(spec, dict):
        raise UsageError(f"{prefix}: expected a mapping such as {{values: [...]}} or {{min: ..., max: ...}}, "
                         f"got {spec!r}")
    for key in ("min", "max", "q", "mu", "sigma", "a", "b"):
        value = spec.get(key)
        if isinstance(value, str):
            try:
                float(value)
            except ValueError:
                continue
            raise UsageError(f"{prefix}: {key}: {value!r} is text to YAML; write a number like 1.0e-4 (with a dot)")
    distribution = spec.get("distribution")
    if distribution is not None and distribution not in _DISTRIBUTION.values():
        known = ", ".join(sorted(v for v in _DISTRIBUTION.values() if " " not in v))
        raise UsageError(f"{prefix}: unknown distribution {distribution!r} (W&B defines: {known})")
    try:
        filled = schema.fill_parameter(name, spec)
    except schema.ParamValidationError:  # W&B's nested `parameters:` block
        filled = ("param_dict", spec)
    except ValueError as error:  # min >= max
        message = str(error)
        named = message if message.startswith(name) else f"parameter {name}: {message}"
        raise UsageError(f"{where}: {named}") from None
    if filled is None:
        raise UsageError(f"{prefix}: {spec!r} is not a W&B parameter "
                         "(need value, values, or min/max with a distribution)")
    kind, filled_spec = filled
    return Param(name=name, distribution=_DISTRIBUTION[kind], spec=filled_spec)


# ------------------------------------------------------------------------------------ commands
def format_args(values: dict[str, Any]) -> dict[str, list[str]]:
    """The word lists `wandb agent` substitutes for its args macros (sdk/launch/sweeps/utils.py)."""
    args, no_equals, no_booleans, no_hyphens = [], [], [], []
    for name, value in values.items():
        args.append(f"--{name}={value}")
        no_equals += [f"--{name}", str(value)]
        no_hyphens.append(f"{name}={value}")
        if isinstance(value, bool):
            if value:
                no_booleans.append(f"--{name}")
        else:
            no_booleans.append(f"--{name}={value}")
    return {
        "args": args,
        "args_no_equals": no_equals,
        "args_no_boolean_flags": no_booleans,
        "args_no_hyphens": no_hyphens,
        "args_json": [json.dumps(values)],
    }


def expand_envvars(token: str) -> str:
    """`${envvar:NAME}` becomes $NAME (or NAME when unset), as wandb does."""
    import re

    return re.sub(r"\$\{envvar:([A-Z0-9_]*)\}", lambda m: os.environ.get(m.group(1), m.group(1)), token)


def build_command(sweep: Sweep, values: dict[str, Any], extra: list[str] = (),
                  output_dir: str | None = None) -> list[str]:
    """The argument list for one trial: the sweep's command with its macros filled in.

    `extra` (options given after `--` to the runner) and `--output_dir` follow the parameters,
    so they win over values of the same name. `accelerate launch` gets a free
    `--main_process_port` unless the command names one, so trials on one machine never share a port.
    """
    tail = list(extra) + ([f"--output_dir={output_dir}"] if output_dir is not None else [])
    words = format_args(values)
    macros = {
        "env": ["/usr/bin/env"] if os.name == "posix" else [],
        "interpreter": ["python"],
        "program": [str(sweep.program)] if sweep.program else [],
    }
    argv: list[str] = []
    for token in sweep.command:
        token = expand_envvars(token)
        if token.startswith("${") and token.endswith("}"):
            macro = token[2:-1]
            if macro in ARG_MACROS:
                argv += words[macro] + tail
            elif macro in macros:
                argv += macros[macro]
            else:
                raise UsageError(f"sweep file {sweep.path}: command macro {token} is not supported by the local runner "
                                 f"(supported: {', '.join('${' + m + '}' for m in [*macros, *ARG_MACROS])})")
        else:
            argv.append(token)
    return add_launch_port(argv)


def parse_options(words: list[str]) -> list[tuple[str, Any, list[str]]]:
    """Split `--name=value`, `--name value` and bare `--flag` words as the templates' parse_config reads them.

    Returns (field name, value, the words as written) per option; the name has `-` spelled `_`,
    the value is the text given, or True for a bare flag. A word that is no option's value is
    skipped (the template refuses it anyway).
    """
    options, i = [], 0
    while i < len(words):
        token = words[i]
        i += 1
        if not token.startswith("--") or token == "--":
            continue
        key, has_value, value = token[2:].partition("=")
        written = [token]
        if not has_value:
            if i < len(words) and not words[i].startswith("--"):
                value, written = words[i], [token, words[i]]
                i += 1
            else:
                value = True
        options.append((key.replace("-", "_"), value, written))
    return options


def effective_values(values: dict[str, Any], extra: list[str] = ()) -> dict[str, Any]:
    """The parameters as a trial got them: a sampled (or constant) value that an option after `--`
    overrides is that option's value (its text, or True for a bare flag)."""
    given = {name: value for name, value, _ in parse_options(list(extra))}  # the last one wins, as in parse_config
    return {name: given.get(name.replace("-", "_"), value) for name, value in values.items()}


def effective_args(values: dict[str, Any], extra: list[str] = ()) -> list[str]:
    """The options a trial ran with, each once: `--name=value` for every parameter that no option
    after `--` overrides, then the options after `--` as written (they come last, so they won;
    of one given twice, the last; `--config` files all, as they all apply)."""
    options = parse_options(list(extra))
    last = {name: i for i, (name, _, _) in enumerate(options)}
    kept = [word for i, (name, _, written) in enumerate(options) if name == "config" or last[name] == i
            for word in written]
    return [f"--{name}={value}" for name, value in values.items() if name.replace("-", "_") not in last] + kept


def overridden_args(values: dict[str, Any], extra: list[str] = ()) -> list[str]:
    """`--name=value` of each parameter an option after `--` replaced (what did not run)."""
    given = {name for name, _, _ in parse_options(list(extra))}
    return [f"--{name}={value}" for name, value in values.items() if name.replace("-", "_") in given]


def launcher_config_file(command: list[str]) -> tuple[int, str] | None:
    """The launcher's --config_file in a sweep's `command`: (index of the word holding the path, the path), or None.

    Only the words before `${program}` (or the args) are the launcher's; a --config_file after them is the program's.
    """
    ends = [i for i, token in enumerate(command) if token in {"${program}", *(f"${{{m}}}" for m in ARG_MACROS)}]
    launcher = command[: min(ends)] if ends else command
    for i, token in enumerate(launcher):
        if token == "--config_file" and i + 1 < len(launcher):
            return i + 1, launcher[i + 1]
        if token.startswith("--config_file="):
            return i, token.split("=", 1)[1]
    return None


def check_command_files(sweep: Sweep, cwd: str | os.PathLike | None = None) -> None:
    """Refuse a sweep whose command names an accelerate config file, or a program, that does not exist.

    `accelerate launch --config_file missing.yaml` fails in every trial with accelerate's own
    traceback; checked once before the first trial, it is one line naming the file instead.
    Paths are relative to `cwd` (default: the working directory), as the trials will see them.
    """
    base = Path(cwd or os.getcwd())
    found = launcher_config_file(sweep.command)
    if found is not None and not (base / expand_envvars(found[1])).is_file():
        raise UsageError(f"sweep file {sweep.path}: the command's --config_file {found[1]} does not exist "
                         f"(relative to {base})")
    if "${program}" in sweep.command and sweep.program and not (base / str(sweep.program)).is_file():
        raise UsageError(f"sweep file {sweep.path}: program {sweep.program} does not exist (relative to {base})")


def with_launch(sweep: Sweep, program: str | None = None, config_file: str | None = None) -> Sweep:
    """The sweep with its `program` and its command's accelerate --config_file replaced (the runners'
    --program and --config_file), so a copied project runs its own train.py with a sweep file as shipped.

    Both are paths relative to the working directory, as the trials see them. A --config_file where the
    command names none is added after `accelerate launch`. Refused in one line: a path that does not exist,
    a command without `${program}` (for --program) or without `accelerate launch` (for --config_file).
    """
    command, config = list(sweep.command), dict(sweep.config)
    for option, path in (("--program", program), ("--config_file", config_file)):
        if path is not None and not Path(path).is_file():
            raise UsageError(f"{option} {path} does not exist (relative to {os.getcwd()})")
    if program is not None:
        if "${program}" not in command:
            raise UsageError(f"--program {program}: the command of sweep file {sweep.path} has no ${{program}}")
        config["program"] = program
    if config_file is not None:
        found, at = launcher_config_file(command), launch_options_at(command)
        if found is not None:
            index, _ = found
            command[index] = f"--config_file={config_file}" if command[index].startswith("--") else config_file
        elif at is not None:
            command[at:at] = ["--config_file", config_file]
        else:
            raise UsageError(f"--config_file {config_file}: the command of sweep file {sweep.path} "
                             "starts no `accelerate launch`")
        config["command"] = command
    return dataclasses.replace(sweep, program=config.get("program"), command=command, config=config)


def launch_options_at(argv: list[str]) -> int | None:
    """Where `accelerate launch`'s own options start in `argv` (after `launch`), or None without one."""
    for i, token in enumerate(argv[:-1]):
        if os.path.basename(token) == "accelerate" and argv[i + 1] == "launch":
            return i + 2
        if token == "accelerate.commands.launch":
            return i + 1
    return None


def add_launch_port(argv: list[str]) -> list[str]:
    """Give `accelerate launch` its own free rendezvous port unless the command sets one."""
    at = launch_options_at(argv)
    if at is None or any(token.startswith("--main_process_port") for token in argv):
        return argv
    return argv[:at] + [f"--main_process_port={free_port()}"] + argv[at:]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
