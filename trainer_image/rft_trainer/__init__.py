"""rft_trainer: what runs inside the RFTJob's trainer, inference and explorer pods.

The operator starts it as `torchrun ... -m rft_trainer --config /etc/rft/config.json`.
The FSDP2 trainer itself arrives with the trainer issue; until then the entry point
refuses to pretend (see __main__.py).
"""
