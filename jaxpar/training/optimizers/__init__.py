"""The optimizers: the registry that `[optimizer] name` picks from, and Muon's split work."""
