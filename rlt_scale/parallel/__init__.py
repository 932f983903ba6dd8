"""Distributed plumbing applied around the model: gradient norms across
model-parallel shards, gathering shards to full tensors, data parallelism."""
