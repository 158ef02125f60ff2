"""Errors a user can fix. Entry points print them as one line and exit with status 2 (no traceback)."""

import functools
import sys


class ScaleLMError(Exception):
    """A problem with the input or the environment, explained in the message."""

    exit_code = 2


class ConfigError(ScaleLMError):
    pass


class DataError(ScaleLMError):
    pass


class CheckpointError(ScaleLMError):
    pass


def friendly_errors(main):
    """Decorate a CLI main(): a ScaleLMError becomes `error: <message>` on stderr and its exit code (2)."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ScaleLMError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(err.exit_code)

    return wrapper
