"""What the benchmark tools share; every tool in ``cs336_systems.bench`` is a leaf over these modules and the
library, and no tool imports another (``tests/test_layout.py`` checks it).

- ``result_store``: the results file of a problem (resume, out-of-memory rows) and the environment every row carries
- ``timing``: synchronisation, timed calls and their statistics, ``do_bench`` (also agreed across ranks), peak
  memory, the measured matmul rate
- ``flops``: FLOP accounting of the language model (MFU)
- ``cli``: every tool's options (edition and size names, checked counts), device announcement, bars, tables
- ``model_sizes``: model sizes by canonical key, each edition's names for them, the memory of weights and AdamW
  state
- ``lm``: the language model under benchmark: built by size, random batches, one step in timed phases
- ``memory``: CUDA memory snapshots, the active-memory timeline, the largest allocations
- ``attention_grid``: the naive-attention grid (``pytorch_attention``, ``torch_compile``)
- ``attention_providers``: the attention implementations raced by name, their timing and checks, the leaderboard
  protocol
- ``distributed_launch``: one rank per GPU (self-spawned or under ``torchrun``), rank 0 deciding and writing
- ``ddp_step``: a data-parallel training step under a named DDP variant, with its exposed communication
- ``allreduce_fit``: the latency-bandwidth fit of all-reduce timings
- ``timeline``: compute and communication timelines from profiler traces, drawn
- ``step_split``: a profiled step's GPU time by kernel category (recompute and exposed communication included)
- ``leaderboard_2026_model``: the 2026 leaderboard step's configuration, FLOPs by part (and recomputed by a
  checkpoint plan), predicted memory per rank, the step's time on another card from measured rates and published
  peaks
- ``leaderboard_2026_check``: that step built on the ranks, and its check against one process
"""
