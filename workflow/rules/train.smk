# One training job per experiment x seed, then its consolidated model and the common test evaluation.


localrules:
    train_config,


rule train_config:
    output:
        f"{RESULTS}/runs/{{experiment}}/seed{{seed}}/train.yaml",
    log:
        f"{RESULTS}/logs/train_config/{{experiment}}/seed{{seed}}.log",
    params:
        settings=lambda wildcards: experiment(wildcards).training,
    run:
        with open(output[0], "w") as handle:
            yaml.safe_dump(params.settings, handle, sort_keys=False)


rule train:
    input:
        config=rules.train_config.output,
        data=rules.prepare.output,
        image=image_input,
    output:
        f"{RESULTS}/runs/{{experiment}}/seed{{seed}}/run.json",
    log:
        f"{RESULTS}/logs/train/{{experiment}}/seed{{seed}}.log",
    # resubmitted by the main Snakemake only: in the job's own Snakemake a stopped training must end the job
    retries: config["resources"].get("retries", 0) if workflow.is_main_process else 0
    conda:
        "../envs/scalelm.yaml"
    threads: lambda wildcards: experiment(wildcards).procs_per_node
    resources:
        **SITE_RESOURCES,
        nodes=lambda wildcards: experiment(wildcards).nodes,
        tasks=lambda wildcards: experiment(wildcards).nodes,
        # with an "mpi" key the job runs its shell in the batch shell, which Slurm's --signal does not reach; the
        # launcher starts the training in an srun step of its own, which it does reach (scalelm.supervise). The
        # plugin refuses mpi jobs of one task, so one node gets "": the key still counts, sbatch sees a plain job
        mpi=lambda wildcards: "srun" if experiment(wildcards).nodes > 1 else "",
        tasks_per_gpu=0,  # else the plugin asks for --ntasks-per-gpu=<tasks>: tasks x GPUs tasks of cpus_per_task
        cpus_per_task=per_proc("cpus_per_proc"),
        mem_mb=per_proc("mem_mb_per_proc"),
        runtime=config["resources"]["runtime_min"],
        gres=lambda wildcards: (
            f"gpu:{experiment(wildcards).procs_per_node}"
            if SITE.get("gpus_per_node")
            else ""
        ),
        slurm_extra=slurm_extra(stop_signal=True),
    params:
        launch=launch_args,
        prelude=site_prelude(),
    shell:
        "{params.prelude}python -m scalelm.launch {params.launch} -- --config {input.config:q} 2>&1 | tee {log:q}"


rule consolidate:
    input:
        rules.train.output,
    output:
        model=f"{RESULTS}/runs/{{experiment}}/seed{{seed}}/model.pt",
        meta=f"{RESULTS}/runs/{{experiment}}/seed{{seed}}/model.pt.json",
    log:
        f"{RESULTS}/logs/consolidate/{{experiment}}/seed{{seed}}.log",
    conda:
        "../envs/scalelm.yaml"
    resources:
        **SITE_RESOURCES,
        slurm_extra=slurm_extra(),
    params:
        run_dir=run_dir,
        run=in_container(),
    shell:
        "{params.run}python -m scalelm.consolidate --run-dir {params.run_dir:q} --out {output.model:q} > {log:q} 2>&1"


rule evaluate:
    input:
        model=rules.consolidate.output.model,
        data=rules.prepare.output,
    output:
        f"{RESULTS}/runs/{{experiment}}/seed{{seed}}/test.json",
    log:
        f"{RESULTS}/logs/evaluate/{{experiment}}/seed{{seed}}.log",
    conda:
        "../envs/scalelm.yaml"
    resources:
        **SITE_RESOURCES,
        slurm_extra=slurm_extra(),
    params:
        run=in_container(),
    shell:
        "{params.run}python -m scalelm.evaluate --model {input.model:q} --data {input.data:q} --split test --out {output:q} > {log:q} 2>&1"
