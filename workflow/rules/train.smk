# One training job per experiment x seed, then its consolidated model and the common test evaluation.


def launch_args(wildcards):
    e = experiment(wildcards)
    args = f"--nodes {e.nodes} --procs-per-node {e.procs_per_node} {container_args()}"
    if SITE.get("host_suffix"):
        args += f" --host-suffix {SITE['host_suffix']}"
    if SITE.get("port_range"):
        args += " --port-range {} {}".format(*SITE["port_range"])
    return args


def per_proc(key):
    return lambda wildcards: config["resources"][key] * experiment(wildcards).procs_per_node


localrules:
    train_config,


rule train_config:
    output:
        f"{RESULTS}/runs/{{experiment}}/seed{{seed}}/train.yaml",
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
    params:
        launch=launch_args,
    log:
        f"{RESULTS}/logs/train/{{experiment}}/seed{{seed}}.log",
    threads: lambda wildcards: experiment(wildcards).procs_per_node
    resources:
        nodes=lambda wildcards: experiment(wildcards).nodes,
        tasks=lambda wildcards: experiment(wildcards).nodes,
        tasks_per_node=1,
        mpi=lambda wildcards: "srun" if experiment(wildcards).nodes > 1 else "",
        cpus_per_task=per_proc("cpus_per_proc"),
        mem_mb=per_proc("mem_mb_per_proc"),
        runtime=config["resources"]["runtime_min"],
        gres=lambda wildcards: (
            f"gpu:{experiment(wildcards).procs_per_node}" if SITE.get("gpus_per_node") else ""
        ),
    shell:
        "python -m scalelm.launch {params.launch} -- --config {input.config} > {log} 2>&1"


rule consolidate:
    input:
        rules.train.output,
    output:
        model=f"{RESULTS}/runs/{{experiment}}/seed{{seed}}/model.pt",
        meta=f"{RESULTS}/runs/{{experiment}}/seed{{seed}}/model.pt.json",
    params:
        run_dir=run_dir,
    log:
        f"{RESULTS}/logs/consolidate/{{experiment}}/seed{{seed}}.log",
    shell:
        "python -m scalelm.consolidate --run-dir {params.run_dir} --out {output.model} > {log} 2>&1"


rule evaluate:
    input:
        model=rules.consolidate.output.model,
        data=rules.prepare.output,
    output:
        f"{RESULTS}/runs/{{experiment}}/seed{{seed}}/test.json",
    log:
        f"{RESULTS}/logs/evaluate/{{experiment}}/seed{{seed}}.log",
    shell:
        "python -m scalelm.evaluate --model {input.model} --data {input.data} --split test --out {output} > {log} 2>&1"
