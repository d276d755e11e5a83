"""A script's entry point: the errors its user can fix print one line and exit 2; a hang fails fast."""

from __future__ import annotations

import faulthandler
import os
import sys
from typing import Callable

import torch

from headstart.heads.directory import HeadsLoadError
from headstart.heads.export import ExportError
from headstart.heads.output_dir import OutputDirError
from headstart.heads.prompts import PromptSourceError
from headstart.heads.target import TargetLoadError
from headstart.train.config import ConfigError
from headstart.train.data import DataError
from headstart.train.engines import EngineError

WATCHDOG_ENV = "HEADSTART_WATCHDOG_S"  # seconds: a process still running then prints its threads' stacks and exits 1


class CheckpointError(RuntimeError):
    """A checkpoint or heads directory that cannot be written (full disk) or must not be loaded (not plain data)."""


# what a script's user can fix (recipe, flags, files, target, servers, disk): one line, exit 2; others: a traceback
USER_ERRORS = (ConfigError, DataError, TargetLoadError, HeadsLoadError, PromptSourceError, EngineError, ExportError,
               CheckpointError, OutputDirError)


def run_main(main: Callable) -> None:
    """A script's entry point: USER_ERRORS exit 2 with one line. With HEADSTART_WATCHDOG_S set, a process
    still running after that many seconds prints every thread's Python stack to stderr and exits (a hang fails fast)."""
    if os.environ.get(WATCHDOG_ENV):
        faulthandler.dump_traceback_later(float(os.environ[WATCHDOG_ENV]), exit=True)
    try:
        main()
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if torch.distributed.is_initialized():  # past the last barrier, files closed: exit without the group's teardown
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
