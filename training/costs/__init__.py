"""What a job may spend and what it spent, shared by the instances (``training.launcher``) and
the person's commands (``training.workstation``).

It runs with the caller's credentials: the instance role on an instance, the person's own
(``AWS_PROFILE``, ...) for ``hetero job start`` and ``hetero status``. Every AWS call it makes
is recorded with the principal that makes it and checked against that principal's policies
(``tests/aws_calls.json``, docs/security.md).

Modules:

- ``budget``: ``job.max_hours`` and ``job.max_usd`` against the time since the job started,
  the whole cluster priced at its most (the launcher's budget watch; ``hetero status``);
- ``bill``: what the job's instances cost so far, from their launch and termination times;
- ``deploy_prices``: a deploy's job priced by its first host (Spot from AWS), recorded in the
  job record;
- ``backstop``: the scheduled action that takes every group to zero at the budget's deadline
  should no launcher do it (set by ``hetero job start`` and the first host, deleted at job
  end).
"""
