# The comparison: summary table and plots, also the content of `snakemake --report`.


localrules:
    aggregate,


rule aggregate:
    input:
        runs=[str(run.record) for run in STUDY.runs],
        tests=[str(run.test_result) for run in STUDY.runs],
    output:
        csv=report(
            f"{RESULTS}/summary.csv",
            category="Summary",
            caption="../report/summary.rst",
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
    log:
        f"{RESULTS}/logs/aggregate.log",
    conda:
        "../envs/scalelm.yaml"
    params:
        args=STUDY.aggregate_args(),
        out_dir=lambda wildcards, output: os.path.dirname(output.csv),
    shell:
        "python -m scalelm.study.aggregate {params.args} --out-dir {params.out_dir:q} > {log:q} 2>&1"
