"""Built-in differentiable operations, one family per module (forward and backward adjacent)."""
