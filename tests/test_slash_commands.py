"""Slash commands: parsing a typed line, /mode's argument, and the help page's table of them."""

from __future__ import annotations

import pytest

from northcode.agent.approvals import Mode
from northcode.agent.slash_commands import NAMES, commands_table, mode_from_argument, parse_command
from northcode.tui.slash import SlashCommands


def test_parse_splits_name_and_argument():
    assert parse_command("/new") == ("new", "")
    assert parse_command("/mode   full-auto ") == ("mode", "full-auto")
    assert parse_command("/model org/model name") == ("model", "org/model name")


def test_an_unknown_command_lists_the_known_ones():
    with pytest.raises(ValueError, match="^unknown command /frob; the commands are /new /sessions /model /mode "
                                         "/undo /compact /mcp /clear /help /quit$"):
        parse_command("/frob now")


def test_mode_argument_names_a_mode_or_takes_the_next():
    assert mode_from_argument("", Mode.ASK) is Mode.AUTO_EDIT
    assert mode_from_argument("", Mode.FULL_AUTO) is Mode.PLAN and mode_from_argument("", Mode.PLAN) is Mode.ASK
    assert mode_from_argument("plan", Mode.ASK) is Mode.PLAN
    assert mode_from_argument("full-auto", Mode.ASK) is Mode.FULL_AUTO
    with pytest.raises(ValueError, match="mode 'bogus'"):
        mode_from_argument("bogus", Mode.ASK)


def test_the_table_lists_every_command_and_the_app_runs_each():
    lines = commands_table().splitlines()
    assert lines[:2] == ["| command | does |", "| --- | --- |"] and len(lines) == 2 + len(NAMES)
    assert "| /mode [plan\\|ask\\|auto-edit\\|full-auto] | show or set when tools ask first |" in lines
    assert "| /new | start a new session |" in lines
    assert all(callable(getattr(SlashCommands, f"cmd_{name}", None)) for name in NAMES)
