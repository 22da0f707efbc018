"""Runtime: sequence state (KV cache), the engine step, sampling and generation."""
