"""unbroken.state: a training state as named tensors, and a tensor's part on this rank.

- :mod:`~unbroken.state.training_state`: the state's names (model, optimizer,
  RNG), captured and restored whatever the optimizer and the layout;
- :mod:`~unbroken.state.parts`: a tensor's part on this rank (a DTensor's
  local shard, or all of it).

Both the checkpoint and the snapshot read and write these names; nothing here
knows where a state is kept.
"""
