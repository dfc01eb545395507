"""Each option declared once (``options.py``, or the module it belongs to): an option declared in a test alone is a flag
of ``convert`` and ``batch`` with its help, a keyword of the API's ``convert``, an attribute of the options a run gets,
and its errors' hint names its flag. The environment's settings are read once into the options, and verify streams
a Hub SOURCE with them as a conversion does."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from nf4convert.errors import ArgumentError
from nf4convert.options import DECLARED, ConvertOptions, VerifyOptions, conversion_options, declare
from nf4convert.settings import Settings

from fixtures.cli import cli, one_error_line

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit")


def _level(text):
    if not str(text).isdigit():
        raise ArgumentError(f"scratch_level {text!r} is not a whole number", option="scratch_level")
    return int(text)


@pytest.fixture
def scratch_option():
    """A conversion option declared as a sink's module declares its own, and undeclared after."""
    from nf4convert.sinks import base  # noqa: F401  (whose registry's modules declare their own options)

    conversion_options()  # the sinks' own declared first, as in any run
    spec = declare("scratch_level", "How hard the scratch option tries.", default="2", parse=_level, after="dtype")
    try:
        yield spec
    finally:
        del DECLARED["scratch_level"]


class _Seen(Exception):
    pass


def test_an_option_declared_in_a_test_alone_is_in_help_the_api_and_the_options(scratch_option, monkeypatch):
    for command in ("convert", "batch"):
        shown = " ".join(cli(command, "--help").split("Options:")[1].split())
        assert "--scratch-level TEXT How hard the scratch option tries." in shown
        rows = [shown.index(row) for row in ("--dtype [", "--gguf-type [", "--scratch-level TEXT", "--device TEXT")]
        assert rows == sorted(rows)  # after --dtype, and after the sink's own option placed there before it
    assert "--scratch-level" not in cli("verify", "--help")

    assert ConvertOptions.parse().scratch_level == 2 and ConvertOptions().scratch_level == 2
    assert ConvertOptions.parse(scratch_level="7").scratch_level == 7
    assert ConvertOptions.parse(scratch_level="7").replace(scratch_level=8).scratch_level == 8
    with pytest.raises(ArgumentError, match="scratch_level 'x' is not a whole number"):
        ConvertOptions.parse(scratch_level="x")

    import nf4convert.cli.run as run
    import nf4convert.conversion as conversion
    from nf4convert import convert

    taken = []

    def seen(source, options, **rest):
        taken.append(options)
        raise _Seen

    monkeypatch.setattr(conversion, "converted", seen)
    with pytest.raises(_Seen):
        convert(EXAMPLE, "out", scratch_level="5")
    monkeypatch.setattr(run, "dry_run_plan", seen)
    with pytest.raises(_Seen):
        cli(EXAMPLE, "--scratch-level", "4", "--dry-run")
    assert [options.scratch_level for options in taken] == [5, 4]
    # its error names the flag on the command line, the keyword in the API
    line = one_error_line(cli(EXAMPLE, "--scratch-level", "x", "--dry-run", code=2))
    assert line == "Error: --scratch-level 'x' is not a whole number"


def test_the_api_takes_the_declared_keywords_and_refuses_others_as_python_does():
    from nf4convert import convert, verify

    keywords = list(inspect.signature(convert).parameters)
    assert keywords[:3] == ["source", "output", "on_output"]
    assert {"dtype", "gguf_type", "revision", "max_shard_size", "allow_non_finite"} <= set(keywords)
    assert inspect.signature(convert).parameters["max_shard_size"].default == "5GB"
    assert list(inspect.signature(verify).parameters)[:2] == ["output", "source"]
    with pytest.raises(TypeError, match=r"^convert\(\) got an unexpected keyword argument 'colour'$"):
        convert(EXAMPLE, "out", colour="red")
    with pytest.raises(TypeError, match=r"^verify\(\) got an unexpected keyword argument 'gguf_type'$"):
        verify("out", EXAMPLE, gguf_type="q8_0")


def test_settings_are_read_once_into_the_options(monkeypatch):
    monkeypatch.setenv("NF4CONVERT_STREAM_MEMORY", "64")
    options = ConvertOptions.parse()
    assert options.settings == Settings(stream_memory=64)
    monkeypatch.setenv("NF4CONVERT_STREAM_MEMORY", "32")
    assert options.replace(overwrite=True).settings.stream_memory == 64  # carried, not read again
    assert VerifyOptions.of(options).settings.stream_memory == 64
    assert VerifyOptions.parse().settings.stream_memory == 32
    monkeypatch.setenv("NF4CONVERT_STREAM_MEMORY", "lots")
    for parse in (ConvertOptions.parse, VerifyOptions.parse):
        with pytest.raises(ArgumentError, match="NF4CONVERT_STREAM_MEMORY='lots': not a whole number of 16 or more"):
            parse()


def test_verify_streams_a_hub_source_with_the_settings_a_conversion_takes(monkeypatch, tmp_path):
    import nf4convert.verification.verify as verification
    from nf4convert import verify
    from nf4convert.hub.stream import StreamSettings

    made = []

    class Recorded(verification.HubWeights):
        def __init__(self, **given):
            super().__init__(**given)
            made.append(self.settings)
            raise _Seen

    monkeypatch.setattr(verification, "HubWeights", Recorded)
    monkeypatch.setenv("NF4CONVERT_STREAM_MEMORY", "64")
    monkeypatch.setenv("NF4CONVERT_STREAM_REQUESTS", "3")
    (tmp_path / "out").mkdir()
    with pytest.raises(_Seen):
        verify(tmp_path / "out", EXAMPLE, device="cpu")
    assert made == [StreamSettings(memory_bytes=64 << 20, requests_at_once=3)]


def test_to_chooses_the_output_format_where_out_does_not_say_it(tmp_path):
    from nf4convert.dtypes import output_dtype
    from nf4convert.sinks.base import sink_for
    from nf4convert.sinks.gguf.sink import GgufFile
    from nf4convert.verification.gguf import GgufCheck

    for given, chosen in [
        (dict(to="gguf"), "gguf"),
        (dict(to="GGUF", output="model"), "gguf"),
        (dict(to="safetensors", output="dense"), "safetensors"),
        (dict(output="model"), "safetensors"),
        (dict(to="gguf", output="m.gguf", gguf_type="q8_0"), "gguf"),
    ]:
        assert sink_for(ConvertOptions.parse(**given)).name == chosen, given
    for given, refused in [
        (dict(to="pdf"), "to 'pdf' is not one of gguf, safetensors"),
        (dict(to="safetensors", output="m.gguf"), "to='safetensors' asks for a safetensors output, but the output's"),
        (dict(to="safetensors", gguf_type="q8_0"), "to='safetensors' asks for a safetensors output"),
    ]:
        with pytest.raises(ArgumentError, match=refused) as error:
            sink_for(ConvertOptions.parse(**given))
        assert error.value.option == "to"
    auto, fp16 = ConvertOptions.parse(to="gguf"), ConvertOptions.parse(to="gguf", dtype="fp16")
    assert GgufFile.batch_output(tmp_path, "m", auto) == str(tmp_path / "m-<dtype>.gguf")  # the plan decides
    assert GgufFile.batch_output(tmp_path, "m", fp16) == str(tmp_path / "m-f16.gguf")
    assert fp16.dtype == output_dtype("fp16")
    (tmp_path / "plain").write_bytes(b"GGUF\x03\x00\x00\x00")
    (tmp_path / "other").write_bytes(b"PK\x03\x04")
    assert GgufCheck.claims(str(tmp_path / "plain")) and GgufCheck.claims("x.GGUF")
    assert not GgufCheck.claims(str(tmp_path / "other")) and not GgufCheck.claims(str(tmp_path))


def test_a_gguf_named_freely_with_to_converts_and_verifies(tmp_path):
    pytest.importorskip("conversion")  # the "gguf" extra: llama.cpp's converter
    out = tmp_path / "plain-name"
    made = cli(EXAMPLE, "-o", out, "--to", "gguf", "--device", "cpu", "-q")
    assert "GGUF bf16" in made and out.read_bytes()[:4] == b"GGUF"
    shown = cli("verify", out, EXAMPLE, "--device", "cpu", "-q")
    assert "OK: bit-exact with llama.cpp's converter" in shown


def test_help_imports_the_sinks_declarations_not_the_sinks():
    import subprocess
    import sys

    code = """
import sys
from nf4convert.cli.commands import main
for args in (["convert", "--help"], ["batch", "--help"], ["x", "--gguf-type", "q9"]):
    try:
        main(args)
    except SystemExit:
        pass
heavy = ("numpy", "nf4convert.plan", "nf4convert.sinks.gguf.sink")
print("loaded", sorted(name for name in heavy if name in sys.modules))
"""
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "--gguf-type [f32|" in shown and "--imatrix FILE" in shown and "--to FORMAT" in shown
    assert "loaded []" in shown, shown
