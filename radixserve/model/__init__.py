"""Model execution: loading, layers, attention backends, model classes, runner, sampler."""
