"""``hetero rehearse``: a spec's whole AWS lifecycle on one machine, with no AWS account.

moto stands in for EC2, Auto Scaling and S3 (``aws``); every emulated instance gets its own
IMDSv2 endpoint (``imds``) and runs the real launcher entry point as a process tree
(``instances``); faults are injected at training steps (``faults``, ``injector``), S3 can be cut
off (``s3proxy``); at the end the sample logs, the groups and the checkpoints are audited
(``audit``, ``params``) and written to ``rehearsal.json`` (``report``). ``rehearse`` ties one run
together; ``cli`` is the subcommand.
"""
