"""The backward graph: nodes, saved tensors and hooks."""
