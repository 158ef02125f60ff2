# The Apptainer image (container.mode: build or image). Built or pulled on the login node, where the base image and
# registries are reachable; every training, consolidation and evaluation job then runs inside it.

if STUDY.image_definition:

    localrules:
        build_image,

    rule build_image:
        input:
            definition=STUDY.image_definition,
        output:
            STUDY.image,
        log:
            f"{RESULTS}/logs/build_image.log",
        conda:
            "../envs/scalelm.yaml"
        params:
            args=STUDY.build_image_args(),
        shell:
            "python -m scalelm.launch.container build --definition {input.definition:q} --out {output:q} "
            "{params.args} > {log:q} 2>&1"


if STUDY.image_uri:

    localrules:
        pull_image,

    rule pull_image:
        output:
            STUDY.image,
        log:
            f"{RESULTS}/logs/pull_image.log",
        conda:
            "../envs/scalelm.yaml"
        params:
            uri=STUDY.image_uri,
        shell:
            "python -m scalelm.launch.container pull --uri {params.uri:q} --out {output:q} > {log:q} 2>&1"
