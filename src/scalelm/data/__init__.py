"""WikiText-2: prefetch (the only network access), prepare (vocabulary + token ids, once), windows for training and exact evaluation."""

from scalelm.data.prepared import PreparedData, load_prepared
from scalelm.data.windows import EvalBatches, TrainBatches

__all__ = ["PreparedData", "load_prepared", "TrainBatches", "EvalBatches"]
