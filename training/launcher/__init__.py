"""The container's entry point (``hetero launch``).

Modules by concern: ``group`` (which instance group is this host in), ``peers`` (who else is in
the cluster), ``roles`` (the trainer's torchrun and the data server's command lines),
``supervisor`` (child processes that never outlive the launcher), ``spot`` (Spot interruption
watch), ``job_end`` (scale the Auto Scaling groups to zero), ``launch`` (the command).
The person's commands (``hetero job start``, ``hetero status``, ``hetero sagemaker submit``) are
in ``training.workstation``; the local run (``hetero local``) is in ``training.local``.
"""
