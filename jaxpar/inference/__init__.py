"""A trained model put to use: loaded onto a mesh, sampled, evaluated, exported.
May import every layer below it: core, nn, data, formats, models, parallel, training.
"""
