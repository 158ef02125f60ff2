# Configuration: apply or drop the local overlay, validate, resolve the study (matrix, site, image) before any job.
# Everything a rule needs comes from scalelm.study.workflow.Study; this file only binds it.
from snakemake.utils import validate

from scalelm.config import write_settings
from scalelm.errors import ScaleLMError
from scalelm.study.experiments import apply_local_overlay
from scalelm.study.workflow import Study

config = apply_local_overlay(config)
validate(config, "../schemas/config.schema.yaml")
try:
    STUDY = Study(config, on_login_node=workflow.is_main_process)
except ScaleLMError as err:
    raise WorkflowError(f"invalid config: {err}")
RESULTS = STUDY.results
# paths of a run directory, with the {experiment} and {seed} wildcards
RUN = STUDY.run_pattern


wildcard_constraints:
    experiment="[A-Za-z0-9_-]+",
    seed="[0-9]+",
    nodes="[0-9]+",


def experiment(wildcards):
    return STUDY.experiment(wildcards)


def image_input(wildcards):
    return [STUDY.image] if STUDY.image else []
