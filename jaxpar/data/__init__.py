"""Text in, token batches out: corpora, tokenizers and vocabularies, prepared token files
(`python -m jaxpar.prepare`), and the deterministic batch loader.
May import: jaxpar.core.
"""
