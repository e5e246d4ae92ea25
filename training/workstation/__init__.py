"""The person's commands: what runs on the person's own machine, with the person's AWS
credentials (``AWS_PROFILE``, ``AWS_REGION``... the usual places), never on an instance.

Modules:

- ``jobstart``: ``hetero job start``, another job on the deployed cluster (the job pointer,
  the groups back at their counts, the day's prices recorded for the budget);
- ``status``: ``hetero status``, the deployed job as AWS and its job record see it (read-only);
- ``sagemaker_submit``: ``hetero sagemaker submit``, the spec as a SageMaker heterogeneous
  training job;
- ``sagemaker_budget``: that job's ``MaxRuntimeInSeconds`` from ``job.max_hours`` /
  ``job.max_usd`` at SageMaker's training rates (used by ``sagemaker_submit`` alone).

These modules never import the instance's loop (``training.launcher``: ``ec2_start``,
``ec2_job``, ``ec2_watches``, ``membership``, ``spot``, ``launch``, ``plan`` and the rest):
tests/launcher/test_person_side_imports.py checks it in a fresh interpreter. What they share
with the instances is in ``training.costs`` (the budget, the bill, a deploy's prices, the
backstop).
"""
