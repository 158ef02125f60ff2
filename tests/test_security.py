"""What scalelm writes and reads: secrets in the environment stay out of every file and log; a tensor file that
holds a pickled object is refused instead of run."""

import subprocess
import sys
from pathlib import Path

import drills
import torch

SECRETS = {"WANDB_API_KEY": "wandb-key-0f3a9c", "HF_TOKEN": "hf_token_7d21e8", "AWS_SECRET_ACCESS_KEY": "aws-5b6c4d"}


def test_secrets_in_the_environment_are_never_written(tiny_config, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    config = tiny_config("secret", parallel__strategy="ddp", train__max_steps=6, checkpoint__every=3)
    result = drills.run(config)
    assert result.returncode == 0, result.stdout[-3000:]
    run_dir = drills.run_dir_of(config)
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"run.json", "metrics.jsonl", "trainer.pt", ".metadata"}
    for path in files:
        content = path.read_bytes()
        for value in SECRETS.values():
            assert value.encode() not in content, (path, value)
    for value in SECRETS.values():
        assert value not in result.stdout + result.stderr


class RunsCode:
    """A pickled object whose loading would create a file: what a malicious model file could do."""

    def __init__(self, proof: Path):
        self.proof = proof

    def __reduce__(self):
        return (Path.touch, (self.proof,))


def test_a_model_file_holding_a_pickled_object_is_refused_and_not_run(tmp_path, prepared):
    proof = tmp_path / "code-ran"
    model = tmp_path / "model.pt"
    torch.save({"model": {}, "extra": RunsCode(proof)}, model)
    out = tmp_path / "test.json"
    command = [sys.executable, "-m", "scalelm.study.evaluate", "--model", str(model), "--data", str(prepared), "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"error: {model} holds more than tensors and plain values and was not loaded" in result.stderr
    assert "Traceback" not in result.stderr
    assert not proof.exists() and not out.exists()
