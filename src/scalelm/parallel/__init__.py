"""Training strategies behind one interface (see base.Strategy); the trainer only ever sees that interface."""

from __future__ import annotations

from typing import TYPE_CHECKING

STRATEGIES = ("single", "ddp", "fsdp")

if TYPE_CHECKING:
    from scalelm.config import Config
    from scalelm.parallel.base import Strategy
    from scalelm.parallel.env import DistEnv


def strategy_class(name: str) -> type[Strategy]:
    if name == "single":
        from scalelm.parallel.single import SingleDevice as cls
    elif name == "ddp":
        from scalelm.parallel.ddp import DDPStrategy as cls
    elif name == "fsdp":
        from scalelm.parallel.fsdp import FSDPStrategy as cls
    else:  # config validation names the choices; this guards direct callers
        raise ValueError(f"unknown strategy {name!r}")
    return cls


def build_strategy(config: Config, env: DistEnv) -> Strategy:
    return strategy_class(config.parallel.strategy)(config.parallel, env)
