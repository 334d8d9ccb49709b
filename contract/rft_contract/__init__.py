"""rft_contract: what the operator and every pod agree on (docs/design.md).

The RFTJob spec and status models (`spec`, `status`; the CRD is generated from them),
names, labels and environment keys (`names`), the S3 layout (`layout`), the manifest that
commits a checkpoint or weights export (`manifest`), storage on `str` URIs (`storage`,
`s3`), the job config every pod loads (`config`) and the status client (`jobapi`).
It imports neither torch nor kopf, so every image can carry it.
"""
