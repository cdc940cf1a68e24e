"""One training run: the jitted step, the loop, checkpoints, metrics, profiles and loss plots.
May import: jaxpar.core, jaxpar.models, jaxpar.data, jaxpar.parallel, jaxpar.interop.
"""
