# One training job per experiment x seed, then one job that consolidates its model and scores it on the test split
# (one process: a second job would wait in the queue again for a few seconds' work); and the machine's baseline, one
# job per node count of the matrix, on the geometry of its widest experiment.


localrules:
    train_config,


rule train_config:
    output:
        str(RUN.train_config),
    log:
        f"{RESULTS}/logs/train_config/{{experiment}}/seed{{seed}}.log",
    threads: 0  # a file of settings: it waits for no core a training holds
    params:
        settings=lambda wildcards: experiment(wildcards).settings,
    run:
        write_settings(params.settings, output[0])


rule train:
    input:
        config=rules.train_config.output,
        data=rules.prepare.output,
        plan=rules.plan.output,  # refused there if it cannot fit the site's GPUs
        image=image_input,
    output:
        str(RUN.record),
    log:
        f"{RESULTS}/logs/train/{{experiment}}/seed{{seed}}.log",
    # resubmitted by the main Snakemake only: in the job's own Snakemake a stopped training must end the job
    retries: STUDY.resources.retries if workflow.is_main_process else 0
    conda:
        "../envs/scalelm.yaml"
    threads: lambda wildcards: STUDY.train_threads(wildcards, workflow.cores)
    resources:
        **STUDY.train_resources(),
    params:
        launch=STUDY.launch_args,
        prelude=STUDY.site.prelude(),
    shell:
        "{params.prelude}python -m scalelm.launch {params.launch} -- --config {input.config:q} 2>&1 | tee {log:q}"


rule evaluate:
    input:
        run=rules.train.output,
        data=rules.prepare.output,
    output:
        model=str(RUN.model),
        meta=str(RUN.model_meta),
        test=str(RUN.test_result),
    log:
        f"{RESULTS}/logs/evaluate/{{experiment}}/seed{{seed}}.log",
    conda:
        "../envs/scalelm.yaml"
    resources:
        **STUDY.job_resources(),
    params:
        run_dir=lambda wildcards: STUDY.run(wildcards).path,
        run=STUDY.in_container(),
    shell:
        "{params.run}python -m scalelm.train.evaluation --consolidate {params.run_dir:q} --model {output.model:q} "
        "--data {input.data:q} --split test --out {output.test:q} > {log:q} 2>&1"


rule machine_baseline:
    input:
        config=STUDY.baseline_config,
        data=rules.prepare.output,  # its model is the study's: the prepared vocabulary, not a stand-in's
        image=image_input,
    output:
        STUDY.baseline_file("{nodes}"),
    log:
        f"{RESULTS}/logs/machine_baseline/nodes{{nodes}}.log",
    conda:
        "../envs/scalelm.yaml"
    threads: lambda wildcards: STUDY.train_threads(wildcards, workflow.cores)
    resources:
        **STUDY.train_resources(),
    params:
        launch=STUDY.launch_args,
        options=STUDY.baseline_args,
        prelude=STUDY.site.prelude(),
    shell:
        "{params.prelude}python -m scalelm.launch --program baseline {params.launch} -- {params.options} --out {output:q} 2>&1 | tee {log:q}"
