# Data: prefetch (login node, the only step with internet), prepare once (vocabulary + token ids).


def prefetch_args():
    source = config["data"]["source"]
    if "files" in source:
        files = ",".join(f"{split}={path}" for split, path in source["files"].items())
        return f"--files {files} --format {source.get('format', 'text')}"
    return f"--dataset {source['dataset']} --name {source['name']}"


localrules:
    prefetch,
    prepare,


rule prefetch:
    output:
        directory(config["data"]["raw_dir"]),
    params:
        source=prefetch_args(),
    log:
        f"{RESULTS}/logs/prefetch.log",
    shell:
        "python -m scalelm.data.prefetch --out {output} {params.source} > {log} 2>&1"


rule prepare:
    input:
        rules.prefetch.output,
    output:
        directory(config["data"]["prepared_dir"]),
    params:
        options=("--lowercase " if config["data"].get("lowercase") else "")
        + f"--min-freq {config['data'].get('min_freq', 1)}",
    log:
        f"{RESULTS}/logs/prepare.log",
    shell:
        "python -m scalelm.data.prepare --raw {input} --out {output} {params.options} > {log} 2>&1"
