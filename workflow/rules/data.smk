# Data: prefetch (login node, the only step with internet), prepare once (vocabulary + token ids).


localrules:
    prefetch,
    prepare,


rule prefetch:
    output:
        directory(STUDY.settings.data.raw_dir),
    log:
        f"{RESULTS}/logs/prefetch.log",
    conda:
        "../envs/scalelm.yaml"
    params:
        source=STUDY.prefetch_args(),
    shell:
        "python -m scalelm.data.prefetch --out {output:q} {params.source} > {log:q} 2>&1"


rule prepare:
    input:
        rules.prefetch.output,
    output:
        directory(STUDY.settings.data.prepared_dir),
    log:
        f"{RESULTS}/logs/prepare.log",
    conda:
        "../envs/scalelm.yaml"
    params:
        options=STUDY.prepare_args(),
    shell:
        "python -m scalelm.data.prepare --raw {input:q} --out {output:q} {params.options} > {log:q} 2>&1"
