"""rft_serving: what runs in an inference pod (docs/design.md, "Weight sync").

`serve` is the reference engine (transformers, torch); `sync_agent` with its `engines`
adapters and `weights` (download + verify) keeps an engine on the job's target weights.
The sync agent imports no torch, so it fits the slim sidecar image.
"""
