"""unbroken.checkpoint: the last resort, persistent checkpoints on disk.

- :mod:`~unbroken.checkpoint.checkpointer`: writing (in the background),
  verifying and loading a whole training state, and finding the latest;
- :mod:`~unbroken.checkpoint.sharded`: a sharded state's parts (ZeRO-1's
  moment ranges, HSDP's local shards) in a checkpoint;
- :mod:`~unbroken.checkpoint.writer` (safetensors files written by several
  threads into host buffers), :mod:`~unbroken.checkpoint.slot` (the one
  background write at a time), :mod:`~unbroken.checkpoint.files` (a run's
  checkpoint directories and their commit records),
  :mod:`~unbroken.checkpoint.schedule` (when to save, which to keep),
  :mod:`~unbroken.checkpoint.dcp` (``torch.distributed.checkpoint``, imported
  on first use).
"""
