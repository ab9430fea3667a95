"""The exit statuses the ``moejax`` commands share (``moejax score --help`` lists them).

One table for every command, so that a script reads a status the same way whichever
command it ran.
"""

from __future__ import annotations

# The run stopped on a failure (a lost peer process, a run that ended before every line was
# answered): the results written so far are real ones.
FAILED_STATUS = 1
# Every result is an error (or any is, with ``--fail-on-errors``): the results are written,
# but a script must not take the run for a success.
ERRORS_STATUS = 3
# Standard output was closed before the results were written (``| head -1``): what a shell
# reports for a command killed by SIGPIPE (128 + 13).
BROKEN_PIPE_STATUS = 141
