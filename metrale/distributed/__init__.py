"""Tensor parallelism (and expert parallelism for MoE models) on `torch.distributed`.

Owner: distributed. The scheduler and the engine stay single: rank 0's `TransformerModel`
holds a `TensorParallelModule` (`module.py`) that sends each forward's host inputs to the
worker ranks (`protocol.py`) and runs its own share; the workers (`worker.py`, spawned by
`launch.py`) run the same share of the same forward. What a rank holds and how a module is
cut is `shard.py`; the process groups and collectives, `group.py` (NCCL on CUDA, gloo on
the CPU; no default process group, no module-level state).
"""
