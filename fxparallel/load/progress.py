"""The loader's progress bars (bytes, rate), shown by one process per node.

On a terminal a finished bar is cleared (the line is reused). Written to a file or a pipe (a job's
log), clearing would leave the bar's text and the next log line on one line, joined by carriage
returns: there the finished bar is kept and ends with a newline.
"""
from __future__ import annotations

import sys


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # closed or wrapped streams
        return False


def byte_bar(desc: str, total=None, show: bool = True, file=None):
    """A tqdm bar counting bytes; ``file`` defaults to sys.stderr (looked up now, as logging does)."""
    from tqdm.auto import tqdm

    stream = file if file is not None else sys.stderr
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not show,
                leave=not _is_terminal(stream), file=stream)
