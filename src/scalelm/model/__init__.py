"""The causal Transformer language model (transformer.py), its parameters and tensor-parallel plan as data
(architecture.py, torch-free), its loss (loss.py) and its CPU and GPU fast paths (cpu_ops.py, gpu_ops.py)."""
