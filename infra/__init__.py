"""CDK stacks and constructs that stand up a heterogeneous training cluster from a spec."""
