"""
errors.py: how bad input stops a program of ours (CONTRIBUTING.md, rule 4): one line naming the
flag, file or row, on stderr, and exit status 2 (argparse's), before any write; never a traceback.
Every module that refuses something calls fail; it imports nothing of ours, so any module can.
"""

import sys

from tqdm import tqdm


class BadInput(SystemExit):
    """What fail raises: a SystemExit of status 2 (the interpreter exits with it and prints no
    traceback), its own type so that a caller in the same process (a test, a study driver) can
    tell a refused input from any other exit. line: the line said."""

    def __init__(self, line: str):
        super().__init__(2)
        self.line = line


def fail(msg: str):
    """Stop with one line naming what was wrong: "error: msg" on stderr, exit status 2."""
    # tqdm.write puts the message on a line of its own, under a progress bar if one is drawn.
    tqdm.write(f"error: {msg}", file=sys.stderr)
    raise BadInput(msg)
