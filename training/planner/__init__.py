"""The planner (``hetero plan``): which cluster gives the most expected samples per dollar.

One module per concern, in the order a plan uses them:

- ``priors``: every assumed number, with its source and date; ``facts`` bundles them;
- ``results``: measured figures from benchmarks/results (the throughput results store and the
  existing benchmark outputs);
- ``workload``: the spec's job in the planner's units (model size from its architecture);
- ``candidates``: the configurations to compare (``--compare`` strings or the spec's types);
- ``throughput``, ``network``, ``dataplane``, ``preemption``: one term of the model each;
- ``prices`` and ``placement``: live AWS data where credentials exist, offline tables otherwise;
- ``target``: an accuracy target's samples, given or read from a finished run's summary.json;
- ``evaluate``: one configuration end to end, the ranking and the Pareto front;
- ``report``: table, CSV, JSON and plot; ``specfile``: the winner written into a spec;
- ``cli``: the command.

Formulas and priors are documented in docs/planner.md.
"""
