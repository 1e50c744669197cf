"""common.config: a dataclass becomes the command line, the YAML file and the sweep interface."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # so plain `pytest` works as well as `python -m pytest`
    sys.path.insert(0, str(REPO_ROOT))

from common.config import ConfigError, config_to_dict, may_change_on_resume, option, parse_config  # noqa: E402
from common.errors import UsageError  # noqa: E402


@dataclass
class Config:
    """Tiny training config."""

    learning_rate: float = field(default=3e-4, metadata={"help": "Peak learning rate."})
    batch_size: int = field(default=32, metadata={"help": "Examples per step."})
    epochs: int = 3
    use_amp: bool = field(default=False, metadata={"help": "Mixed precision."})
    widths: list[int] = field(default_factory=lambda: [32, 32], metadata={"help": "Layer widths."})
    scales: list[float] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    seed: Optional[int] = 0
    run_name: str | None = None
    tag: str = "base"

    def __post_init__(self):
        if self.learning_rate <= 0:
            raise ValueError("learning_rate must be > 0")


def parse(*argv: str) -> Config:
    return parse_config(Config, list(argv))


def error_of(*argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse(*argv)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- argv forms ---------------------------------------------------------------------------

def test_defaults_when_no_arguments():
    assert parse() == Config()


def test_equals_and_space_forms():
    assert parse("--batch_size=64").batch_size == 64
    assert parse("--batch_size", "64").batch_size == 64


def test_dash_and_underscore_spellings_are_the_same_field():
    assert parse("--learning-rate=0.1").learning_rate == 0.1
    assert parse("--learning_rate", "0.2").learning_rate == 0.2
    assert parse("--run-name", "x").run_name == "x"


def test_later_option_wins():
    assert parse("--epochs=1", "--epochs=2").epochs == 2


def test_negative_number_as_separate_value():
    assert parse("--seed", "-1").seed == -1


def test_positional_argument_rejected():
    assert "positional" in error_of("train.py")
    assert "positional" in error_of("--epochs=1", "extra")


def test_missing_value():
    assert error_of("--epochs") == "--epochs: missing value"
    assert error_of("--epochs", "--batch_size=2") == "--epochs: missing value"


def test_unknown_option_suggests_close_match():
    assert error_of("--lerning_rate=0.1") == "unknown option --lerning_rate (did you mean --learning_rate?)"
    assert error_of("--zzz=1") == "unknown option --zzz"


# --- bools --------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["True", "true", "1", "yes", "YES"])
def test_bool_true_spellings(text):
    assert parse(f"--use_amp={text}").use_amp is True


@pytest.mark.parametrize("text", ["False", "false", "0", "no"])
def test_bool_false_spellings(text):
    assert parse(f"--use_amp={text}", ).use_amp is False
    assert parse("--use_amp", text).use_amp is False


def test_bool_rejects_other_text():
    assert error_of("--use_amp=maybe") == "--use_amp: expected true/false, got 'maybe'"


def test_bare_bool_flag_means_true():
    assert parse("--use_amp").use_amp is True
    assert parse("--use-amp", "--epochs=1").use_amp is True


# --- numbers ------------------------------------------------------------------------------

def test_int_accepts_integral_float_text_and_rejects_fraction():
    assert parse("--batch_size=3.0").batch_size == 3
    assert isinstance(parse("--batch_size=3.0").batch_size, int)
    assert parse("--batch_size=1e3").batch_size == 1000
    assert error_of("--batch_size=3.5") == "--batch_size: expected an integer, got '3.5'"
    assert error_of("--batch_size=abc") == "--batch_size: expected an integer, got 'abc'"


@pytest.mark.parametrize("text, value", [("1e-4", 1e-4), ("0.001", 0.001), ("1", 1.0)])
def test_float_forms(text, value):
    result = parse(f"--learning_rate={text}").learning_rate
    assert result == value and isinstance(result, float)


def test_float_rejects_text():
    assert error_of("--learning_rate=fast") == "--learning_rate: expected a number, got 'fast'"


# --- lists, Optional, Literal -------------------------------------------------------------

def test_list_python_literal_form():
    assert parse("--widths=[64, 128]").widths == [64, 128]
    assert parse("--names=['a', 'b']").names == ["a", "b"]
    assert parse("--scales=[0.5, 1]").scales == [0.5, 1.0]


def test_list_comma_form_and_single_scalar():
    assert parse("--widths=64,128").widths == [64, 128]
    assert parse("--names", "a,b").names == ["a", "b"]
    assert parse("--widths=64").widths == [64]


def test_list_elements_are_converted_and_checked():
    assert parse("--widths=[64.0, 128]").widths == [64, 128]
    assert error_of("--widths=64,x") == "--widths: expected an integer, got 'x'"


@pytest.mark.parametrize("text", ["none", "null", "None"])
def test_optional_none(text):
    config = parse(f"--seed={text}", f"--run_name={text}")
    assert config.seed is None and config.run_name is None


def test_optional_value():
    assert parse("--seed=7").seed == 7
    assert error_of("--seed=x") == "--seed: expected an integer, got 'x'"


def test_non_optional_str_keeps_none_text():
    assert parse("--tag=none").tag == "none"


def test_literal_choices():
    assert parse("--optimizer=sgd").optimizer == "sgd"
    assert error_of("--optimizer=adam") == "--optimizer: expected one of adamw, sgd, got 'adam'"


# --- W&B sweep round trip -----------------------------------------------------------------

@dataclass
class OneFloat:
    x: float = 1.0


@dataclass
class OneInt:
    x: int = 1


@dataclass
class OneBool:
    x: bool = False


@dataclass
class OneList:
    x: list[int] = field(default_factory=list)


@dataclass
class OneStr:
    x: str = ""


@dataclass
class OneStrList:
    x: list[str] = field(default_factory=list)


@pytest.mark.parametrize("cls, value", [
    (OneFloat, 0.00031), (OneFloat, 3.1e-05), (OneInt, 64), (OneBool, True), (OneBool, False),
    (OneList, [64, 128]), (OneStr, "adamw"), (OneStrList, ["a", "b"]),
])
def test_wandb_agent_str_round_trip(cls, value):
    # wandb agent passes --x=<str(value)>; parsing must give back exactly the sampled value.
    parsed = parse_config(cls, [f"--x={value}"]).x
    assert parsed == value and type(parsed) is type(value)


# --- YAML config file ---------------------------------------------------------------------

def test_precedence_defaults_then_file_then_cli(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 1e-4\nbatch-size: 16\nepochs: 5\nwidths: [8, 16]\nuse_amp: true\n")
    config = parse("--config", str(path), "--epochs=9")
    assert config.learning_rate == 1e-4 and isinstance(config.learning_rate, float)  # YAML string "1e-4"
    assert config.batch_size == 16  # file beats default
    assert config.epochs == 9  # command line beats file
    assert config.widths == [8, 16] and config.use_amp is True
    assert config.optimizer == "adamw"  # untouched default
    # Command line wins regardless of where --config sits.
    assert parse("--epochs=9", f"--config={path}").epochs == 9


def test_file_values_are_checked_like_cli(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("batch_size: abc\n")
    assert error_of(f"--config={path}") == f"config file {path}: batch_size: expected an integer, got 'abc'"
    path.write_text("optimizer: adam\n")
    assert "expected one of adamw, sgd" in error_of(f"--config={path}")
    path.write_text("seed: null\nbatch_size: 4.0\n")
    assert parse(f"--config={path}").seed is None
    assert parse(f"--config={path}").batch_size == 4


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("foo: 1\n")
    assert error_of(f"--config={path}") == f"config file {path}: unknown key 'foo'"
    path.write_text("epoch: 1\n")
    assert error_of(f"--config={path}").endswith("unknown key 'epoch' (did you mean epochs?)")


def test_missing_file(tmp_path):
    path = tmp_path / "missing.yaml"
    message = error_of("--config", str(path))
    assert message.startswith(f"config file {path}") and "not found" in message


def test_bad_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("epochs: [1, 2\n")
    assert error_of(f"--config={path}").startswith(f"config file {path}: not valid YAML")


def test_yaml_top_level_not_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    assert error_of(f"--config={path}").startswith(f"config file {path}: expected a mapping")


# --- validation, help, helpers ------------------------------------------------------------

def test_post_init_value_error_becomes_config_error():
    assert error_of("--learning_rate=-1") == "learning_rate must be > 0"
    assert issubclass(ConfigError, UsageError)


def test_required_field():
    @dataclass
    class Needs:
        data_dir: str

    assert parse_config(Needs, ["--data_dir=d"]).data_dir == "d"
    with pytest.raises(ConfigError, match="missing required option --data_dir"):
        parse_config(Needs, [])


def test_unsupported_field_type_is_a_programming_error():
    @dataclass
    class Bad:
        x: dict = field(default_factory=dict)

    with pytest.raises(TypeError):
        parse_config(Bad, [])


def test_help_exits_zero_and_lists_every_option(capsys):
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as info:
            parse("--epochs=1", flag)
        assert info.value.code == 0
    out = capsys.readouterr().out
    for name in ("--learning_rate", "--batch_size", "--epochs", "--use_amp", "--widths", "--optimizer",
                 "--seed", "--run_name", "--config"):
        assert name in out
    assert "Peak learning rate." in out and "default: 0.0003" in out
    assert "{adamw,sgd}" in out and "list[int]" in out


def test_config_to_dict():
    data = config_to_dict(parse("--widths=1,2"))
    assert data["widths"] == [1, 2] and data["learning_rate"] == 3e-4
    assert set(data) == {f for f in Config.__dataclass_fields__}


def test_bad_flag_in_script_gives_one_line_and_exit_2(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from dataclasses import dataclass
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from common.config import parse_config
        from common.errors import with_exit_codes

        @dataclass
        class Config:
            learning_rate: float = 0.1

        @with_exit_codes
        def main():
            parse_config(Config)

        main()
    """))
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}  # rank 0 prints the error
    result = subprocess.run([sys.executable, str(script), "--lerning_rate=1"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert lines[0] == "error: unknown option --lerning_rate (did you mean --learning_rate?)"


# --- which options a resume may change -------------------------------------------------------------

@dataclass
class Session:
    steps: int = option(10, "Steps.", "[1, inf)")
    log_every: int = option(1, "Log every N steps.", "[1, inf)", may_change=True)
    workers: int = option(0, "Loader workers.", "[0, 8]", may_change=True)


@dataclass
class Trial(Session):
    log_every: int = option(5, "Log every N steps, less often here.", "[1, inf)")  # declared again, same policy
    workers: int = option(2, "Loader workers: part of this trial's data order.", "[0, 8]", may_change=False)
    sample: bool = option(True, "Sample at the end.", may_change=True)


def test_the_options_a_resume_may_change_are_declared_on_them_and_kept_by_a_field_declared_again():
    assert may_change_on_resume(Session) == {"log_every", "workers"}
    assert may_change_on_resume(Trial) == {"log_every", "sample"}  # `workers` said otherwise where declared again


def test_help_of_resume_names_every_form_it_takes(capsys):
    from common.config import RunOptions

    with pytest.raises(SystemExit):
        parse_config(RunOptions, ["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text at the terminal width
    resume_help = out[out.index("--resume str"):out.index("--checkpoint_every_steps")]
    for form in ("auto", "none", "checkpoint folder", "run folder"):
        assert form in resume_help, (form, resume_help)
