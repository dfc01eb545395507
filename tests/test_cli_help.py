"""Where the command line points for help: the top-level help lists what ``nf4convert SOURCE`` takes, and a usage
error names the help that lists the option it is about."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from nf4convert.cli.commands import main


def _run(*args):
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_the_top_level_help_lists_the_convert_options():
    code, output = _run("--help")
    convert = output[output.index("Convert options (nf4convert SOURCE [OPTIONS]") :]
    assert code == 0 and "Commands:" in output[: output.index("Convert options")]
    for option in ("-o, --output", "--dtype", "--device", "--dry-run", "--verify", "--push-to-hub", "--max-shard-size"):
        assert option in convert, option
    assert "--help" not in convert  # the group's own, listed once above


@pytest.mark.parametrize(
    "args,command",
    [
        (["./src", "--no-such-option"], "nf4convert convert --help"),
        (["convert", "./src", "--dtype", "int9"], "nf4convert convert --help"),
        (["batch", "./src", "-o", "root", "--no-such-option"], "nf4convert batch --help"),
        (["batch", "./src"], "nf4convert batch --help"),
        (["verify", "out"], "nf4convert verify --help"),
        (["-q", "verify", "out", "src"], "nf4convert --help"),  # the group's own rule: its help now lists convert's
    ],
)
def test_a_usage_error_points_at_the_help_that_lists_its_option(args, command):
    code, output = _run(*args)
    lines = output.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), output
    assert lines[0].endswith(f"(see '{command}')"), lines[0]
