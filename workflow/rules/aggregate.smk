# The comparison: summary table and plots, also the content of `snakemake --report`.


localrules:
    aggregate,


rule aggregate:
    input:
        runs=[f"{d}/run.json" for d in RUN_DIRS],
        tests=[f"{d}/test.json" for d in RUN_DIRS],
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
    log:
        f"{RESULTS}/logs/aggregate.log",
    conda:
        "../envs/scalelm.yaml"
    params:
        runs=shlex.join(arg for d in RUN_DIRS for arg in ("--run", d)),
        out_dir=lambda wildcards, output: os.path.dirname(output.csv),
    shell:
        "python -m scalelm.aggregate {params.runs} --out-dir {params.out_dir:q} > {log:q} 2>&1"
