"""Every command's --help: each subcommand listed, no reST markup, the one exit-status table."""
from __future__ import annotations

import pytest

from invariant_infer.cli import exit_codes, main
from invariant_infer.cli.help_text import plain

COMMANDS = ("demo", "score", "serve", "check")


def help_of(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_plain_drops_double_backticks_and_keeps_the_words():
    assert plain("``invariant-infer score``: rows keyed by ``id``") == "invariant-infer score: rows keyed by id"


@pytest.mark.parametrize("argv", [(), *((command,) for command in COMMANDS)])
def test_help_has_no_markup_and_states_the_exit_statuses(capsys, argv):
    text = help_of(capsys, *argv)
    assert "``" not in text
    for code, meaning in exit_codes.MEANINGS.items():
        assert f"  {code}  {meaning}" in text


def test_the_top_level_help_lists_every_subcommand(capsys):
    text = help_of(capsys)
    description = text.split("positional arguments")[0]
    assert all(f"- {command}:" in description for command in COMMANDS)


def test_the_exit_statuses_are_distinct():
    codes = [exit_codes.OK, exit_codes.ROW_ERRORS, exit_codes.REFUSED, exit_codes.VERIFY_MISMATCH,
             exit_codes.RANK_FAILED, exit_codes.NOT_INVARIANT, exit_codes.UNSUPPORTED_MODEL]
    assert len(set(codes)) == len(codes) and set(codes) == set(exit_codes.MEANINGS)
