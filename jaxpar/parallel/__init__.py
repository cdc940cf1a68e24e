"""Where the work runs: the device mesh, ZeRO's shardings, the pipeline's schedule tables and
their executor, multi-process start-up, and the collectives read back from a compiled step.
May import: jaxpar.core, jaxpar.models, jaxpar.data.
"""
