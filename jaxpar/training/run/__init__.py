"""One training run: its phases, outputs, metrics, evaluations, signals, lock and the loss plots."""
