"""Weights & Biases in offline mode (`train.wandb: true`): the run's metrics as a W&B run under `<run_dir>/wandb/`.

Offline mode needs no API key and writes none: compute nodes have no network, and a key in a shared results tree
would leak. Upload later, from a machine with network and your own login, with
`wandb sync <run_dir>/wandb/offline-run-*`. Each attempt of a run (a resume after a stop) is a W&B run of its own
in the same group, so that W&B never sees a step go backwards. Needs the `wandb` package (`pip install
'scalelm[wandb]'`), checked by the training before its run directory is touched (the settings load
anywhere, a login node without wandb included).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from scalelm.errors import ConfigError


def check_available() -> None:
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "train.wandb=true logs to Weights & Biases in offline mode, which needs the wandb package: "
            "pip install 'scalelm[wandb]' (or wandb), or set train.wandb=false"
        )


class WandbRun:
    def __init__(self, directory: Path, group: str, config: dict[str, Any]):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, save_code=False, disable_git=True, x_disable_stats=True)
        self.run = wandb.init(  # into <dir>/wandb/offline-run-*: dir is the run directory
            mode="offline", dir=str(directory.parent), project="scalelm", group=group, config=config, settings=settings
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
