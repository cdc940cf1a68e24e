"""The model families, a folder each (model, config, Hugging Face adapter), and what is built on any of
them: the registry and the one model class (family.py), the interface a family implements,
Hugging Face checkpoints in and out (hf.py), the KV-cache decode, and FLOPs per token.
May import: jaxpar.core, jaxpar.nn, jaxpar.formats.
"""
