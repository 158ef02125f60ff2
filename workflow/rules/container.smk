# The Apptainer image (container.mode: build or image). Built or pulled on the login node, where the base image and
# registries are reachable; every training, consolidation and evaluation job then runs inside it.

if config["container"]["mode"] == "build":

    localrules:
        build_image,

    rule build_image:
        input:
            definition=config["container"].get("definition", "containers/scalelm.def"),
        output:
            STUDY.image,
        log:
            f"{RESULTS}/logs/build_image.log",
        conda:
            "../envs/scalelm.yaml"
        params:
            base=config["container"].get("base_image", ""),
            options=shlex.join(
                f"--build-option={o}"
                for o in config["container"].get("build_options", [])
            ),
        shell:
            "python -m scalelm.launch.container build --definition {input.definition:q} --out {output:q} "
            "--base-image {params.base:q} {params.options} > {log:q} 2>&1"


if config["container"]["mode"] == "image" and "://" in config["container"]["image"]:

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
            uri=config["container"]["image"],
        shell:
            "python -m scalelm.launch.container pull --uri {params.uri:q} --out {output:q} > {log:q} 2>&1"
