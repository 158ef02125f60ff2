"""Every random stream's seed, derived in one place from the run's seed: the order of the training windows in each
epoch, each data-parallel rank's dropout, and fresh dropout streams where a checkpoint resumes into another world size
(its ranks' saved generator states cannot be restored one to one). Distinct epochs, ranks and steps get distinct
seeds; the model's initial weights come from the run's seed itself."""


def epoch_order(seed: int, epoch: int) -> int:
    """The permutation of the training windows in `epoch` (every rank draws the same)."""
    return seed * 1_000_003 + epoch


def dropout(seed: int, dp_rank: int) -> int:
    """A data-parallel rank's dropout masks: its own, the same within a TP group (its activations are replicated)."""
    return seed * 1000 + dp_rank


def dropout_after_resume(step: int, dp_rank: int) -> int:
    """A rank's dropout after resuming at `step` from a checkpoint of another world size."""
    return 1_000_003 * (step + 1) + dp_rank
