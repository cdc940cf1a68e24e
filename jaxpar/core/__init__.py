"""The bottom layer: the run configuration, user-facing errors, and the rule table from logical
axis names to mesh axes. It imports no other part of jaxpar.
"""
