"""Inference backends behind one protocol: the in-process legacy model and Triton."""
