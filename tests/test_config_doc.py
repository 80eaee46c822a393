"""docs/configuration.md is what disagg/tools/config_doc.py makes from the argparse definitions,
and it names every flag of `disagg serve`, the router and both workers."""

from __future__ import annotations

from disagg.tools import config_doc


def test_the_configuration_page_is_what_the_generator_makes():
    assert config_doc.DOC.read_text() == config_doc.generate(), (
        f"docs/configuration.md differs from the flags in the code: run `{config_doc.COMMAND}`"
    )


def test_every_flag_of_every_program_is_on_the_page():
    text = config_doc.generate()
    for program, parser in config_doc.parsers().items():
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in text, (program, option)


def test_the_page_does_not_depend_on_the_environment(monkeypatch):
    monkeypatch.setenv("DISAGG_PORT", "1234")
    monkeypatch.setenv("DISAGG_AUTH_TOKEN", "a-secret")
    monkeypatch.setenv("DISAGG_LOG_LEVEL", "DEBUG")
    text = config_doc.generate()
    assert "a-secret" not in text and "`1234`" not in text
    assert text == config_doc.DOC.read_text()


def test_a_flag_no_group_names_still_appears(monkeypatch):
    monkeypatch.setattr(config_doc, "PURPOSES", tuple((t, n, tuple(f for f in names if f != "--lease-seconds")) for t, n, names in config_doc.PURPOSES))
    text = config_doc.generate()
    other = text[text.index(f"## {config_doc.OTHER}"):]
    assert "`--lease-seconds`" in other
