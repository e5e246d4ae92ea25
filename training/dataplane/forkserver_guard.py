"""Preloaded by the data server's forkserver (``lifetime.start_guarded_forkserver``): importing
it makes the importing forkserver die with the data server. Not for import anywhere else."""

from training.dataplane.lifetime import guard_this_forkserver

guard_this_forkserver()
