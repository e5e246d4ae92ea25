"""The local run, ``hetero local``: the whole heterogeneous topology as processes on one machine,
the person's own or a CI runner, never an instance.

It needs no credentials (no AWS account): its processes reach each other on loopback ports only
(the gRPC data servers, torchrun's rendezvous) and the run folder is a local one. Only a spec
whose dataset is an S3 prefix reaches AWS, with whatever credentials the environment holds
(the tests: moto's).

Modules:

- ``run``: ``hetero local``, one data server per dataprep instance of the spec, health-checked,
  then torchrun with the trainer; Ctrl-C or SIGTERM stops everything; ``local-run.json`` says
  how it ended;
- ``tier``: an elastic dataprep group's servers started and stopped beside the trainer, as an
  Auto Scaling group does on EC2 (the servers file and the desired-count file).

It runs the processes it shares with the instances from ``training.processes`` (``roles``,
``supervisor``, ``supervised``) and never imports the instance's loop (``training.launcher``):
tests/launcher/test_person_side_imports.py checks it in a fresh interpreter.
"""
