"""The processes a host runs, shared by the instances (``hetero launch``, ``training.launcher``)
and the local run (``hetero local``, ``training.local``): the same command lines and the same
supervision on an EC2 instance, in a SageMaker container and on the person's machine.

It makes no AWS call and needs no credentials: it starts, watches and stops local processes.

Modules:

- ``roles``: the trainer's torchrun and the data server's command lines, from the spec;
- ``supervisor``: child processes that never outlive their parent (their own sessions, their
  descendants remembered, a child subreaper on Linux; terminated, then killed, on the way out);
- ``supervised``: a role's commands run under a supervisor for one generation, and the
  outcome its trainer ranks wrote.
"""
