"""One training run: the jitted step, the loop, checkpoints, metrics, profiles and loss plots.
May import: jaxpar.core, jaxpar.nn, jaxpar.data, jaxpar.formats, jaxpar.models, jaxpar.parallel.
"""
