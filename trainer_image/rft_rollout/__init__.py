"""rft_rollout: the explorer pods. Tasks -> sampled rollouts from the inference replicas
-> rewards -> version-tagged experience shards in the buffer (docs/design.md).

Runs as `python -m rft_rollout.explorer` in the trainer image.
"""
