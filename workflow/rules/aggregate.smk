# The comparison: summary tables and plots, also the content of `snakemake --report`; with expect_strict, the check
# that fails the workflow on a missed expectation, in a rule of its own so that a miss deletes none of them.


localrules:
    aggregate,
    check_expectations,


rule aggregate:
    input:
        runs=[str(run.record) for run in STUDY.runs],
        tests=[str(run.test_result) for run in STUDY.runs],
        # the summary names each model and its checksum
        models=[str(path) for run in STUDY.runs for path in (run.model, run.model_meta)],
        machine=[STUDY.baseline_file(nodes) for nodes in STUDY.baselines],
    output:
        csv=report(
            f"{RESULTS}/summary.csv",
            category="Summary",
            caption="../report/summary.rst",
        ),
        by_experiment=report(
            f"{RESULTS}/summary_by_experiment.csv",
            category="Summary",
            caption="../report/summary_by_experiment.rst",
        ),
        expectations=report(
            f"{RESULTS}/expectations.csv",
            category="Summary",
            caption="../report/expectations.rst",
        ),
        md=f"{RESULTS}/summary.md",
        loss_tokens=report(
            f"{RESULTS}/loss_vs_tokens.png",
            category="Loss curves",
            caption="../report/loss.rst",
        ),
        loss_time=report(
            f"{RESULTS}/loss_vs_time.png",
            category="Loss curves",
            caption="../report/loss.rst",
        ),
        scaling=report(
            f"{RESULTS}/scaling.png",
            category="Scaling",
            caption="../report/scaling.rst",
        ),
        utilisation=report(
            f"{RESULTS}/utilisation.png",
            category="Utilisation",
            caption="../report/utilisation.rst",
        ),
        pipeline=report(
            f"{RESULTS}/pipeline.png",
            category="Pipeline",
            caption="../report/pipeline.rst",
        ),
        experts=report(
            f"{RESULTS}/experts.png",
            category="Experts",
            caption="../report/experts.rst",
        ),
        trend=report(
            f"{RESULTS}/trend.png",
            category="History",
            caption="../report/trend.rst",
        ),
        machine=report(
            f"{RESULTS}/machine.csv",
            category="Machine",
            caption="../report/machine.rst",
        ),
    log:
        f"{RESULTS}/logs/aggregate.log",
    conda:
        "../envs/scalelm.yaml"
    params:
        args=STUDY.aggregate_args(),
        out_dir=lambda wildcards, output: os.path.dirname(output.csv),
    shell:
        "python -m scalelm.report.aggregate {params.args} --out-dir {params.out_dir:q} > {log:q} 2>&1"


rule check_expectations:
    input:
        rules.aggregate.output.expectations,
    output:
        touch(f"{RESULTS}/expectations.met"),
    log:
        f"{RESULTS}/logs/check_expectations.log",
    conda:
        "../envs/scalelm.yaml"
    shell:
        "python -m scalelm.report.expectations {input:q} 2>&1 | tee {log:q}"
