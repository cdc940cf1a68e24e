"""Checkpoints: orbax saves and verified restores, checksums, faults of the disk, resuming."""
