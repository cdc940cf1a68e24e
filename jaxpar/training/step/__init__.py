"""A training step: the execution plan made once, the run's pieces built, the passes and the jitted step."""
