"""The pieces every family builds with, apart from the families: declared params and their roles,
the projections, norms and MLP layers, attention and its kernels, the ring, the mixture of experts'
routing and dispatch, and the chunked loss. They name logical axes only.
May import: jaxpar.core.
"""
