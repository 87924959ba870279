"""How every `conductor` subcommand prints its --help: with the default of each option.

argparse's ArgumentDefaultsHelpFormatter shows defaults only for options that have help text; this
one shows them for every option that has a default worth printing (not None, not a flag's False),
so `conductor replay --help` tells that `round_robin` is the policy unless one is given.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        if action.nargs == 0:  # store_true / store_const: the default is not something to type
            return text
        return f"{text} (default: %(default)s)".strip()
