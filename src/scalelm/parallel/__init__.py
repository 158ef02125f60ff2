"""Parallelism: a layout of the world's ranks (dims.py, layout.py: torch-free, read by the workflow, the planner and
the launcher), applied to the model by functions over a device mesh (tensor.py, data.py, pipeline.py, context.py
with ring_blocks.py and ring_transport.py, activation_checkpoint.py, compile.py), behind the hooks the trainer
uses (runtime.py: `Parallel`); the process group and device (env.py) and the CPU allocator's settings
(hostmemory.py)."""
