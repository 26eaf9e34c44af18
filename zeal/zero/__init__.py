"""Where every byte of parameters, gradients and optimizer state lives."""
