# Configuration: apply or drop the local overlay, validate, resolve the study (matrix, site, image) before any job.
# Everything a rule needs comes from scalelm.study.workflow.Study; this file only binds it.
from snakemake.utils import validate

from scalelm.config import write_settings
from scalelm.errors import ScaleLMError
from scalelm.settings_yaml import read_settings
from scalelm.study.experiments import (
    apply_local_overlay,
    check_snakemake_command,
    command_line_values,
)
from scalelm.study.workflow import Study

try:
    # Snakemake's loader keeps the last of a duplicate key and expands aliases: each file read again by scalelm's
    # (scalelm.settings_yaml), which refuses both
    for path in workflow.configfiles:
        read_settings(path)
    # --config KEY=VALUE wins over the local overlay (Snakemake merged it in before the overlay was applied)
    given = command_line_values(workflow.config_settings.config)
    # --jobs, which remote execution needs (a job's own snakemake has no say)
    jobs = workflow.resource_settings.nodes if workflow.is_main_process else None
    check_snakemake_command(config, given, cluster_jobs=jobs)
    config = apply_local_overlay(config, given)
    validate(config, "../schemas/config.schema.yaml")
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
