"""Choosing a layout before paying for it: compile-only devices for TPU and GPU targets, the
`--dry-run` placement, the step-time estimate, `python -m jaxpar.plan` and `python -m jaxpar.bench`.
May import every layer below it: core, nn, data, formats, models, parallel, training.
"""
