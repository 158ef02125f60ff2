# The Apptainer image every training job runs in (container.mode: build or image); none for the local default.


def image_input(wildcards):
    return [config["container"]["image"]] if config["container"]["mode"] == "build" else []


def container_args():
    """Launcher options that run each torchrun inside the image."""
    if config["container"]["mode"] == "none":
        return ""
    binds = [config["data"]["prepared_dir"], RESULTS]
    gpu = "--gpu " if SITE.get("gpus_per_node") else ""
    return f"--container {config['container']['image']} {gpu}" + " ".join(f"--bind {b}" for b in binds)
