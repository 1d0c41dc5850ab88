"""Kernel logic that every engine shares, written once.

Each object here is a rule of the attention algorithm (score mask, online softmax, tile scheduler,
pipeline, epilogue) that renders its own C++ for the emitters and evaluates itself in numpy for the
simulators, so the two engines (and the kernels still to come) compose it instead of restating it.
"""
