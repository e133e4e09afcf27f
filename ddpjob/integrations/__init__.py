"""Preemption callbacks for the trainers people already use, under `[train] command`
(docs/integrations.md): `ddpjob.integrations.hf` (Hugging Face Trainer, extra `ddpjob[hf]`) and
`ddpjob.integrations.lightning` (Lightning, extra `ddpjob[lightning]`).

Each module imports its own package only; neither is imported here, so `import ddpjob` and the
login side never pull in transformers, Lightning or torch. What both share (the job's signals and
exit status, the collective stop vote, the metrics lines) is in `_common.py`.
"""
