"""rft_trainer: the trainer pods (docs/design.md).

`python -m rft_trainer.launch` (torchrun keeping the worker's exit code) runs
`python -m rft_trainer --config /etc/rft/config.json` on every rank: `trainer.Trainer`
(the seed's Trainer API) owns the runtime, storage and checkpointer and drives
`engine.FSDPTrainEngine` through `engine.TrainEngineWrapper`; the engine's `roles` (actor,
reference, critic) are sharded by `parallelize`; `checkpoint` and `export` write the S3
layout of `rft_contract.layout`; `algorithms` holds the pure advantage and loss code.
"""
