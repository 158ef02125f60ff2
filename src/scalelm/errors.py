"""Errors a user can fix, and the exit statuses: entry points print an error as one line and exit with status 2
(no traceback); a training stopped by a signal, checkpointed, exits EXIT_PREEMPTED; one stopped by its watchdog,
EXIT_HUNG."""

import functools
import os
import sys

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again later, the run will resume
EXIT_HUNG = 76  # a step overran its limit: the watchdog wrote its autopsy (scalelm.hang.watchdog) and stopped the job


class ScaleLMError(Exception):
    """A problem with the input or the environment, explained in the message."""

    exit_code = 2


class ConfigError(ScaleLMError):
    pass


class DataError(ScaleLMError):
    pass


class CheckpointError(ScaleLMError):
    pass


def error_line(err: Exception) -> str:
    """`error: <message>`, naming the rank among several processes (torchrun's RANK and WORLD_SIZE)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"error: [rank {os.environ.get('RANK', '?')}] {err}\n"
    return f"error: {err}\n"


def friendly_errors(main):
    """Decorate a CLI main(): a ScaleLMError becomes one `error: <message>` line on stderr and its exit code (2).

    The line goes out in one write: the ranks of a job share stderr, and an error raised on all of them would
    otherwise come out interleaved."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ScaleLMError as err:
            sys.stderr.write(error_line(err))
            sys.stderr.flush()
            sys.exit(err.exit_code)

    return wrapper
