# Before the queue (scalelm.study.preflight): every experiment's memory planned against the site's GPUs before its
# training (rule plan: one that cannot fit is refused by name), and the optional wiring check `snakemake preflight`:
# each layout a few steps on this machine's CPU against one process, loss for loss.


localrules:
    plan,
    preflight_data,
    preflight_config,
    preflight_run,
    preflight,


rule plan:
    input:
        rules.prepare.output,
    output:
        str(RUN.plan),
    log:
        f"{RESULTS}/logs/plan/{{experiment}}/seed{{seed}}.log",
    threads: 0  # torch-free arithmetic: it waits for no core a training holds
    params:  # what the plan depends on: a change plans again
        training=lambda wildcards: experiment(wildcards).settings,
        geometry=lambda wildcards: experiment(wildcards).geometry,
        gpus=(STUDY.site.gpus_per_node, STUDY.site.gpu_memory_gb),
    run:
        STUDY.write_plan(wildcards, input[0], output[0])


rule preflight_data:
    input:
        rules.prepare.output,
    output:
        directory(f"{RESULTS}/preflight/data"),
    log:
        f"{RESULTS}/logs/preflight/data.log",
    conda:
        "../envs/scalelm.yaml"
    params:
        tokens=STUDY.preflight_tokens(),
    shell:
        "python -m scalelm.data.slice --data {input:q} --out {output:q} --tokens {params.tokens} > {log:q} 2>&1"


rule preflight_config:
    output:
        f"{RESULTS}/preflight/configs/{{run}}.yaml",
    log:
        f"{RESULTS}/logs/preflight/{{run}}.config.log",
    wildcard_constraints:
        run="[A-Za-z0-9_.-]+",
    params:
        settings=lambda wildcards: STUDY.preflight[wildcards.run]["settings"],
    run:
        write_settings(params.settings, output[0])


rule preflight_run:
    input:
        config=rules.preflight_config.output,
        data=rules.preflight_data.output,
    output:
        directory(f"{RESULTS}/preflight/runs/{{run}}"),
    log:
        f"{RESULTS}/logs/preflight/{{run}}.log",
    wildcard_constraints:
        run="[A-Za-z0-9_.-]+",
    conda:
        "../envs/scalelm.yaml"
    resources:
        training_run=1,  # one at a time: each takes all of this machine's cores
    params:
        procs=lambda wildcards: STUDY.preflight[wildcards.run]["world_size"],
    shell:
        "python -m scalelm.launch --nodes 1 --procs-per-node {params.procs} -- --config {input.config:q} > {log:q} 2>&1"


rule preflight:
    input:
        [f"{RESULTS}/preflight/runs/{name}" for name in STUDY.preflight],
    output:
        f"{RESULTS}/preflight/preflight.csv",
    log:
        f"{RESULTS}/logs/preflight/compare.log",
    conda:
        "../envs/scalelm.yaml"
    params:
        args=STUDY.preflight_args(),
    shell:
        "python -m scalelm.study.preflight compare {params.args} --out {output:q} 2>&1 | tee {log:q}"
