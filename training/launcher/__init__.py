"""The instance's side: the container's entry point (``hetero launch``) and the loop it runs on
an EC2 instance or in a SageMaker container, with the instance role's (or SageMaker's execution
role's) credentials.

Modules by concern: ``group`` (which instance group is this host in), ``backends`` (the place it
runs in: local, EC2 or SageMaker, as an object), ``peers`` (who else is in the cluster),
``plan`` (this host's role and its commands), ``ec2_start``, ``ec2_job`` and
``ec2_watches`` (an EC2 job's generations and what watches them), ``membership``, ``spot``,
``silent_hosts``, ``hang_watch`` and ``server_watch`` (hosts that leave, go silent or hang),
``job_end`` (scale the Auto Scaling groups to zero), ``launch`` (the command).
The processes a host runs (``roles``, ``supervisor``, ``supervised``) are in
``training.processes``, shared with the local run; the budget, the bill and the backstop are in
``training.costs``, shared with the person's commands. The person's commands (``hetero job
start``, ``hetero status``, ``hetero sagemaker submit``) are in ``training.workstation``; the
local run (``hetero local``) is in ``training.local``.
"""
