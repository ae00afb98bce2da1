"""Opt-in measurements of the worker's step loop: a torch.profiler window and forward timing."""
